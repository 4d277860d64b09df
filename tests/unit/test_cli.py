import subprocess
import sys

# Fails the import of any heavy package: what login nodes lack.
BLOCK_HEAVY = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'vllm', 'transformers', 'h5py', 'peft', 'numpy'):
            raise ImportError('heavy import on the login-node path: ' + name)
sys.meta_path.insert(0, Block())
from rltools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_light(*argv, cwd, env=None):
    return subprocess.run([sys.executable, "-c", BLOCK_HEAVY, *argv], capture_output=True, text=True, cwd=cwd, env=env)


def test_dry_run_imports_no_heavy_package(repo, tmp_path):
    result = run_light("submit", str(repo / "configs/aime.yaml"), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH hetjob" in result.stdout


def test_render_imports_no_heavy_package(repo, tmp_path):
    out = tmp_path / "job.sbatch"
    result = run_light("render", str(repo / "configs/demo.yaml"), "-o", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert out.read_text().startswith("#!/bin/bash")


def test_the_blocker_works(tmp_path):
    code = BLOCK_HEAVY.replace("from rltools.cli import main\nsys.exit(main(sys.argv[1:]))", "import numpy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0 and "heavy import" in result.stderr


def test_slurm_submit_without_slurm_says_what_to_do(repo, tmp_path):
    """The Slurm submit path is login-node light too, and a machine without sbatch gets a clear error."""
    run_dir = tmp_path / "run"
    result = run_light(
        "submit", str(repo / "configs/demo.yaml"), "--set", f"run.dir={run_dir}", "--set", "cluster.launcher=slurm",
        cwd=tmp_path, env={"PATH": str(tmp_path)},
    )
    assert result.returncode == 2, result.stderr
    assert "sbatch not found" in result.stderr and "cluster.launcher: local" in result.stderr


def test_status_of_a_directory_that_is_not_a_run(tmp_path):
    result = run_light("status", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert "not a run directory" in result.stderr
