"""Trainer rank 0's requeue: Slurm answers `scontrol requeue` by sending SIGTERM to every task of the
job, the requeuing trainer included, sometimes before scontrol returns. The trainer must still log
what it did and return (it exits right after, at its checkpoint). The local Slurm tier runs the real
thing (tests/slurm/test_preemption.py, where this race once lost the "requeued job" line); here a
stand-in `scontrol` sends that SIGTERM first, every time."""

import os
import subprocess
import sys

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from rltools.runtime.preempt import StopFlag, requeue
StopFlag("USR2")  # starting: a SIGTERM would end the process at once
requeue("42")
print("returned")
"""


def test_the_requeue_survives_the_sigterm_it_triggers_and_says_so(tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\nkill -TERM $PPID\nsleep 0.2\nexit 0\n")
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "requeued job 42" in result.stdout and "returned" in result.stdout
