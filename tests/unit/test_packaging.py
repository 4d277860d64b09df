"""A wheel install (`pip install .`) renders the same job script as the checkout: the template ships in it.
And the wheels carried to a GPU machine without network (scripts/gpu-wheels.sh) bring what they need.

The wheel is built from a copy of the checkout, so that setuptools' `build/` and `*.egg-info` never
land in the working tree (and a stale `build/lib` there cannot leak into the wheel under test).
"""

import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


# What the GPU test machine brings that the carried wheels need (DESIGN.md: python3 3.12, torch 2.11,
# numpy, no network). Not typing-extensions: torch needs it too, but pydantic needs a newer one.
GPU_MACHINE_HAS = {"torch", "numpy"}
GPU_MACHINE = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
               "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def test_the_gpu_machines_wheels_carry_every_requirement_of_theirs(repo):
    """gpu-check.sh installs the carried wheels with --no-deps: a requirement left behind is met by
    whatever the machine has, if anything (pydantic 2.14 on an older typing-extensions fails to import)."""
    found = re.search(r"^carried=\(([^)]*)\)", (repo / "scripts" / "gpu-wheels.sh").read_text(), re.M)
    assert found, "scripts/gpu-wheels.sh names its wheels in carried=(...)"
    carried = {canonicalize_name(name) for name in found.group(1).split()}
    assert {"pydantic", "submitit", "tensorboardx", "megatron-core"} <= carried
    left_behind = []
    for name in sorted(carried):
        for line in metadata.requires(name) or []:  # as installed here: gpu-wheels.sh carries these versions
            requirement = Requirement(line)
            needed = requirement.marker is None or requirement.marker.evaluate(GPU_MACHINE)
            if needed and canonicalize_name(requirement.name) not in carried | GPU_MACHINE_HAS:
                left_behind.append(f"{name} needs {requirement}")
    assert not left_behind, left_behind
