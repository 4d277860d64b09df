"""A wheel install (`pip install .`) renders the same job script as the checkout: the template ships in it.

The wheel is built from a copy of the checkout, so that setuptools' `build/` and `*.egg-info` never
land in the working tree (and a stale `build/lib` there cannot leak into the wheel under test).
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from rltools.config import load_config
from rltools.launch.sbatch import render_sbatch

FIXED = ["run.dir=/scratch/rltools/runs/wheel", "cluster.python=/opt/rltools/venv/bin/python", "cluster.launcher=slurm"]
# Run with only the unpacked wheel on PYTHONPATH (ahead of the checkout's editable install).
RENDER = """
import sys
import rltools
from rltools.config import load_config
from rltools.launch.sbatch import render_sbatch
print(rltools.__file__)
sys.stdout.write(render_sbatch(load_config(sys.argv[1], sys.argv[2:])))
"""
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "runs",
                                     ".pytest_cache", ".hypothesis")


def build_wheel(repo: Path, tmp: Path) -> Path:
    source = tmp / "source"
    shutil.copytree(repo, source, symlinks=True, ignore=NOT_SOURCES)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", tmp / "dist", source], check=True)
    (wheel,) = (tmp / "dist").glob("rltools-*.whl")
    return wheel


def test_wheel_install_renders_the_checkouts_job_script(repo, tmp_path, monkeypatch):
    for var in ("RLTOOLS_RUNS", "RLTOOLS_TINY_MODEL"):
        monkeypatch.delenv(var, raising=False)
    installed = tmp_path / "site"
    with zipfile.ZipFile(build_wheel(repo, tmp_path)) as wheel:
        wheel.extractall(installed)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = repo / "configs" / "demo.yaml"
    run = subprocess.run([sys.executable, "-c", RENDER, config, *FIXED], cwd=elsewhere, text=True,
                         capture_output=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(installed)})
    assert run.returncode == 0, run.stderr
    module, script = run.stdout.split("\n", 1)
    assert Path(module).is_relative_to(installed)
    assert script == render_sbatch(load_config(config, FIXED))
