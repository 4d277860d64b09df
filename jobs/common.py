"""What every role entry point does around its loop: logging, one torch thread on CPU, exit codes.

Two ways in: `python -m jobs.<role> RUN_DIR` (plain sbatch script, local launcher) and
`run_submitted`, the call the submitit executor pickles (rltools/launch/slurm.py).
"""

import logging
import os
import signal
import sys


def run_role(role: str, argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m jobs.{role} RUN_DIR", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(name)s: %(message)s", stream=sys.stdout)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from rltools.errors import UserError

    try:
        if role == "generator":
            from rltools.generate.loop import run_generator as loop
        else:
            from rltools.train.loop import run_trainer as loop
        return loop(argv[0]) or 0  # the trainer returns 3 when it stopped at a checkpoint on a signal
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


class RoleFailed(RuntimeError):
    """A role ended with a non-zero exit code; submitit records it as the task's error."""


def run_submitted(run_dir: str) -> str:
    """The task body under the submitit executor: run this task's role (srun sets RLTOOLS_ROLE)."""
    from rltools.launch.role_env import RoleEnv
    from rltools.preempt import EXIT_STOPPED

    # submitit's handlers would make SIGTERM a no-op (scancel then waits out KillWait) and requeue
    # the job from generator task 0 on the preemption signal, with no checkpoint: Slurm's default
    # actions apply instead.
    for signum in (signal.SIGTERM, signal.SIGCONT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    logging.getLogger("submitit").propagate = False  # it has its own handler: no doubled lines
    env = RoleEnv.from_environ()
    code = run_role(env.role, [run_dir])
    if code == EXIT_STOPPED:  # not an error: stopped at a checkpoint; the job script records the code
        raise SystemExit(code)
    if code:
        raise RoleFailed(f"{env.role} {env.rank} exited with code {code}; see its log in {run_dir}/slurm/logs")
    return f"{env.role} {env.rank} finished"
