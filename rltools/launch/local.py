"""The local launcher: the same job as the Slurm one, as processes on this machine.

Invariant: the children are started exactly as `srun` would start them (same entry modules, same
run directory, RoleEnv's local variables instead of SLURM_*), and they never outlive the launcher:
a failing child, Ctrl-C or a finished run stops them all.
"""

import os
import signal
import subprocess
import sys
import time

from ..config.schema import RLConfig
from ..paths import RunPaths
from ..monitor import Progress
from .plan import plan
from .role_env import RoleEnv

STOP_GRACE_S = 10.0


def run_local(config: RLConfig, paths: RunPaths, quiet: bool = False) -> int:
    attempt = len(paths.attempts())  # 0 for a fresh run, +1 for each resume (as the Slurm script counts)
    children = start_children(config, paths, attempt)
    progress = Progress(config, paths, quiet)
    paths.local_pid_file.write_text(f"{os.getpid()}\n")  # `rltools status`: the run is alive while this is
    try:
        return _supervise(children, paths, progress)
    finally:
        record_exits(children, paths, attempt)
        paths.local_pid_file.unlink(missing_ok=True)


def _supervise(children: list[dict], paths: RunPaths, progress: Progress) -> int:
    try:
        while True:
            progress.update()
            failed = [c for c in children if c["proc"].poll() not in (None, 0)]
            if failed:
                stop(children)
                child = failed[0]
                print(f"\n{child['name']} failed (exit {child['proc'].returncode}); its log {child['log']}:", file=sys.stderr)
                print(_tail(child["log"]), file=sys.stderr)
                return 1
            if all(c["proc"].poll() == 0 for c in children):
                progress.update()
                progress.finish()
                return 0
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping generator and trainer processes", file=sys.stderr)
        stop(children)
        if paths.latest_checkpoint():
            print(f"checkpoint after {paths.latest_checkpoint()} steps; continue with: rltools resume {paths.root}",
                  file=sys.stderr)
        return 130


def record_exits(children: list[dict], paths: RunPaths, attempt: int) -> None:
    """Each role's exit status, as the Slurm job script writes it (the first failure of its tasks)."""
    for role in {child["role"] for child in children}:
        codes = [child["proc"].returncode for child in children if child["role"] == role]
        code = next((c for c in codes if c), 0) if None not in codes else 1
        paths.component_exit(attempt, role).write_text(f"{code}\n")


def start_children(config: RLConfig, paths: RunPaths, attempt: int) -> list[dict]:
    children = []
    for component in plan(config):
        ntasks = component.resources.ntasks
        for rank in range(ntasks):
            log = paths.task_log(attempt, component.role, rank)
            log.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **config.cluster.environment, **RoleEnv.local_environ(component.role, rank, ntasks, attempt)}
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    [config.cluster.python, "-m", component.entry, str(paths.root)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C reaches the launcher only; it stops the children
                )
            children.append({"name": f"{component.role} {rank}", "role": component.role, "proc": proc, "log": log})
    return children


def stop(children: list[dict]) -> None:
    for child in children:
        if child["proc"].poll() is None:
            os.killpg(child["proc"].pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child["proc"].wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(child["proc"].pid, signal.SIGKILL)
            child["proc"].wait()


def _tail(path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
