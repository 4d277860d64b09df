"""The slurm tier: real jobs on the local cluster from scripts/local-slurm.sh."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from rltools.launch.slurm import ACTIVE


@pytest.fixture(scope="session")
def slurm():
    """Skip without a local cluster, except in CI (RLTOOLS_REQUIRE_SLURM=1), where it must be up."""
    problem = None
    if not shutil.which("sbatch"):
        problem = "sbatch not found"
    else:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
        if "UP" not in ping.stdout:
            problem = f"slurmctld not answering: {ping.stdout.strip()} {ping.stderr.strip()}"
    if problem:
        if os.environ.get("RLTOOLS_REQUIRE_SLURM") == "1":
            pytest.fail(f"local Slurm required but {problem}; run: bash scripts/local-slurm.sh start")
        pytest.skip(f"no local Slurm ({problem}); run: bash scripts/local-slurm.sh start")


def demo_run(repo, tmp_path, *overrides, entries=None, config_name="demo.yaml"):
    """A shipped config (the demo's) as a Slurm job in tmp_path (memory left to the partition),
    prepared for sbatch."""
    from rltools.config import load_config
    from rltools.launch.run_dir import prepare_run_dir
    from rltools.launch.sbatch import render_sbatch

    config = load_config(repo / "configs" / config_name, slurm_demo_overrides(tmp_path / "run", *overrides)[1::2])
    return prepare_run_dir(config, render_sbatch(config, entries))


def sbatch(script) -> str:
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def job_states(job_id: str) -> dict[str, str]:
    """State per hetjob component ({'generators': 'COMPLETED', ...}), as `rltools status` reads it."""
    from rltools.launch.slurm import job_state

    return {name: c["state"] for name, c in job_state(job_id)["components"].items()}


def wait_for_job(job_id: str, timeout_s: float = 180.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = job_states(job_id)
        if states and not ACTIVE & set(states.values()):
            return states
        time.sleep(1.0)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still {job_states(job_id)} after {timeout_s:.0f} s (cancelled)")


def cli(*argv, timeout: float = 600) -> subprocess.CompletedProcess:
    """`rltools ARGV...` in a subprocess, as a user types it."""
    return subprocess.run([sys.executable, "-m", "rltools", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout)


def slurm_demo_overrides(run_dir, *overrides) -> list[str]:
    """--set arguments: the demo config as a Slurm job in run_dir (memory left to the partition)."""
    base = ["cluster.launcher=slurm", f"run.dir={run_dir}", "cluster.generators.mem=null", "cluster.trainers.mem=null"]
    return [word for override in [*base, *overrides] for word in ("--set", override)]
