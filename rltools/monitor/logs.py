"""The task logs of a run's attempts: listing, printing, following, and the tail that explains a failure.

Invariant: logs are found from the run directory's layout alone (RunPaths), one file per task of
an attempt; following them prints only complete lines, each once, and ends with the run.
"""

import time
from pathlib import Path

from ..errors import UserError
from ..launch.run_lock import is_held
from ..launch.slurm import ACTIVE, job_state
from ..paths import ROLES, RunPaths

TAIL_LINES = 20


def task_logs(paths: RunPaths, attempt: int, role: str | None = None, rank: int | None = None) -> list[Path]:
    roles = [role] if role else list(ROLES)
    found = []
    for r in roles:
        if rank is not None:
            found.append(paths.task_log(attempt, r, rank))
        else:
            found += sorted(paths.attempt_log_dir(attempt).glob(f"{r}_*.log"), key=lambda p: int(p.stem.split("_")[1]))
    return found


def failing_log_tail(paths: RunPaths, attempt: int, role: str) -> str:
    """The end of the failed role's task log that shows an error (rank 0's when none does)."""
    logs = [log for log in task_logs(paths, attempt, role) if log.exists()]
    if not logs:  # no task started (a bad srun line, a missing interpreter): the job script's own log
        logs = [log for log in (paths.component_log("generators", "err"),) if log.exists()]
    if not logs:
        return f"(no {role} log in {paths.attempt_log_dir(attempt)})"
    texts = {log: log.read_text(errors="replace") for log in logs}
    chosen = next((log for log, text in texts.items() if "Traceback" in text or "error" in text.lower()), logs[0])
    tail = "\n".join(texts[chosen].splitlines()[-TAIL_LINES:])
    return f"==> {chosen} <==\n{tail}"


def show_logs(paths: RunPaths, role: str | None, rank: int | None, follow: bool, attempt: int | None = None) -> None:
    """Print the task logs of an attempt (default: the latest), each under a header; with `follow`,
    keep printing new lines, prefixed by their task, until the job stops or Ctrl-C."""
    attempts = paths.attempts()
    if not attempts:
        raise UserError(f"no logs yet in {paths.log_dir}: the job has not started (check `rltools status {paths.root}`)")
    attempt = attempts[-1] if attempt is None else attempt
    logs = task_logs(paths, attempt, role, rank)
    missing = [log for log in logs if not log.exists()]
    if rank is not None and missing:
        raise UserError(f"no log {missing[0]}: is rank {rank} within the {role or 'roles'}' task count?")
    offsets = {}
    for log in logs:
        text = log.read_text(errors="replace")
        print(f"==> {log} <==\n{text}", end="" if text.endswith("\n") or not text else "\n")
        offsets[log] = len(text.encode())
    while follow:
        time.sleep(1.0)
        for log in task_logs(paths, attempt, role, rank):
            offsets.setdefault(log, 0)
            with open(log, "rb") as f:
                f.seek(offsets[log])
                new = f.read()
            complete = new[: new.rfind(b"\n") + 1]
            offsets[log] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                print(f"[{log.stem}] {line}", flush=True)
        if not _still_running(paths):
            return


def _still_running(paths: RunPaths) -> bool:
    if paths.job_id_file.exists():
        return job_state(paths.job_id_file.read_text().strip())["state"] in ACTIVE
    return is_held(paths)
