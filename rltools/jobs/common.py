"""What every role entry point does around its loop: logging, one torch thread on CPU, exit codes.

Two ways in: `python -m rltools.jobs.<role> RUN_DIR` (plain sbatch script, local launcher) and
`run_submitted`, the call the submitit executor pickles (rltools/launch/slurm.py).
"""

import errno
import logging
import os
import signal
import sys


def run_role(role: str, argv: list[str]) -> int:
    from rltools.runtime import faults
    from rltools.runtime.preempt import catch_early

    catch_early(role)  # before the slow imports below: a preemption signal must not kill a starting role
    faults.point(f"{role}.start")
    if len(argv) != 1:
        print(f"usage: python -m rltools.jobs.{role} RUN_DIR", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("rltools").info("%s starting in %s (pid %d)", role, argv[0], os.getpid())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars in a log file
    engine = "RLTOOLS_ENGINE_RESTART" in os.environ  # a generator's engine: its supervisor checked the model
    if not engine and not check_model_first(role, argv[0]):
        return 2
    if role == "generator" and not engine:
        from rltools.generate.supervisor import supervise  # it starts this module again as the engine

        return supervise(argv[0])
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from rltools.errors import UserError

    try:
        if role == "generator":
            from rltools.generate.loop import run_generator as loop
        elif role == "judge":
            from rltools.generate.judge import run_judge as loop
        else:
            from rltools.train.loop import run_trainer as loop
        return loop(argv[0]) or 0  # the trainer returns 3 when it stopped at a checkpoint on a signal
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except OSError as err:  # a full disk, a read-only or vanished filesystem: say which file, and what next
        print(f"error: {role}: {describe_os_error(err)}; once that is fixed, `rltools resume {argv[0]}` continues "
              "from the last checkpoint", file=sys.stderr, flush=True)
        logging.getLogger("rltools").debug("traceback", exc_info=True)
        return 1


def check_model_first(role: str, run_dir: str) -> bool:
    """`submit`'s checks of model.path (a judge's: reward.judge.model), again, before the role imports
    torch or loads anything: under Slurm `submit` skips them when the login node does not see the
    model (node-local scratch, a filesystem of the compute nodes), and a bad model would otherwise fail
    minutes later, deep inside the loading or out of memory. Prints the same message as `submit`
    would; False when it failed."""
    from rltools.config import load_config
    from rltools.errors import UserError
    from rltools.launch.preflight import check_judge, check_model
    from rltools.paths import RunPaths

    try:
        config = load_config(RunPaths(run_dir).config)
        if role == "judge":
            check_judge(config)
        else:
            check_model(config)
    except UserError as err:
        print(f"error: {role}: {err}", file=sys.stderr, flush=True)
        return False
    return True


def describe_os_error(err: OSError) -> str:
    """One short line: the system's words for the errno (h5py's own message runs to several lines)."""
    what = os.strerror(err.errno) if err.errno else (err.strerror or str(err))
    where = f" writing {err.filename}" if err.filename else ""
    hint = {errno.ENOSPC: "free space on that filesystem", errno.EDQUOT: "your disk quota is full",
            errno.EROFS: "the filesystem is read-only"}.get(err.errno)
    return f"{what}{where}" + (f" ({hint})" if hint else "")


class RoleFailed(RuntimeError):
    """A role ended with a non-zero exit code; submitit records it as the task's error."""


def run_submitted(run_dir: str) -> str:
    """The task body under the submitit executor: run this task's role (srun sets RLTOOLS_ROLE)."""
    from rltools.runtime.preempt import EXIT_STOPPED, catch_early

    catch_early(os.environ.get("RLTOOLS_ROLE", "trainer"))  # before RoleEnv's imports: see run_role
    from rltools.runtime.role_env import RoleEnv

    # submitit's handlers would make SIGTERM a no-op (scancel then waits out KillWait) and requeue
    # the job from generator task 0 on the preemption signal, with no checkpoint: the role's own
    # handling (catch_early above, then the role's) applies instead.
    signal.signal(signal.SIGCONT, signal.SIG_DFL)
    logging.getLogger("submitit").propagate = False  # it has its own handler: no doubled lines
    env = RoleEnv.from_environ()
    code = run_role(env.role, [run_dir])
    if code in (EXIT_STOPPED, 2):  # stopped at a checkpoint, or bad input: the job script tells them from a crash
        raise SystemExit(code)
    if code and env.role == "generator":  # its supervisor said why, after the engine's own error: no traceback of ours
        raise SystemExit(code)
    if code:
        raise RoleFailed(f"{env.role} {env.rank} exited with code {code}; see its log in {run_dir}/slurm/logs")
    return f"{env.role} {env.rank} finished"
