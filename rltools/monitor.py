"""Reading a run directory: its state, progress and logs (`rltools status`, `logs`, `cancel`).

Invariant: everything here works from the run directory alone, whether the job was submitted by
`rltools submit`, by hand with `sbatch` of the rendered script, or ran under the local launcher,
and it needs no accounting database: Slurm's state comes from `launch.slurm.job_state`, progress
from metrics.jsonl and eval/, and which component failed from the exit files the job script writes.
"""

import datetime
import json
import os
import sys
import time
from pathlib import Path

from .config import load_config
from .config.schema import RLConfig
from .errors import UserError
from .launch.run_lock import is_held
from .launch.slurm import ACTIVE, job_state
from .paths import ROLES, RunPaths
from .preempt import EXIT_STOPPED

COMPONENT_OF = {"generator": "generators", "trainer": "trainers"}
TAIL_LINES = 20
UNSEEN_S = 120.0  # a submitted job squeue has not shown by then is not going to appear


def open_run(run_dir: str | Path) -> RunPaths:
    paths = RunPaths(Path(run_dir).resolve())
    if not paths.config.is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml): pass the run.dir of a submitted run")
    return paths


def run_status(paths: RunPaths) -> dict:
    """Where a run stands; the keys of `rltools status --json`."""
    config = load_config(paths.config)
    job_id = paths.job_id_file.read_text().strip() if paths.job_id_file.exists() else None
    attempts = paths.attempts()
    metrics = read_metrics(paths)
    status = {
        "run_dir": str(paths.root),
        "name": config.run.name,
        "launcher": config.cluster.launcher,
        "job_id": job_id,
        "state": "UNKNOWN",
        "components": {},
        "restarts": attempts[-1] if attempts else 0,
        "step": metrics[-1]["step"] + 1 if metrics else 0,
        "total_steps": config.schedule.steps,
        "last_metrics": metrics[-1] if metrics else None,
        "eta_s": _eta(metrics, config.schedule.steps),
        "eval_k": config.eval.k,
        "evals": {step: result["avg_at_k"] for step, result in read_evals(paths).items()},
        "checkpoint": paths.latest_checkpoint(),
        "failed_component": None,
        "log_tail": None,
    }
    if job_id:
        status.update(job_state(job_id))
    elif is_held(paths):  # the local launcher (and its roles) hold the run's lock while they run
        status["state"] = "RUNNING"
    exits = _exit_codes(paths, attempts[-1]) if attempts else {}
    if status["state"] == "UNKNOWN" and exits:  # the job left the queue and there is no accounting
        status["state"] = "COMPLETED" if set(exits.values()) == {0} and len(exits) == len(ROLES) else "FAILED"
    if status["state"] not in ACTIVE and exits.get("trainer") == EXIT_STOPPED:
        status["state"] = "STOPPED"  # on a signal, at a checkpoint: resumable
    if status["state"] not in ACTIVE and status["state"] not in ("COMPLETED", "STOPPED"):
        failed = [role for role, code in sorted(exits.items(), key=lambda item: _mtime(paths, attempts[-1], item[0]))
                  if code != 0]
        if failed:
            status["failed_component"] = COMPONENT_OF[failed[0]]
            status["log_tail"] = failing_log_tail(paths, attempts[-1], failed[0])
    return status


def format_status(status: dict) -> str:
    job = f"job {status['job_id']}" if status["job_id"] else f"{status['launcher']} launcher"
    lines = [f"{status['name']}  {job}  {status['state']}  restarts {status['restarts']}  ({status['run_dir']})"]
    for name, component in status["components"].items():
        where = component["nodes"] or component["reason"]
        lines.append(f"  {name:<11} {component['state']:<11} {where}")
    done, total = status["step"], status["total_steps"]
    bar = ("=" * int(20 * done / total)).ljust(20)
    line = f"step {done}/{total} [{bar}]"
    m = status["last_metrics"]
    if m:
        line += f" reward {m['reward_mean']:.3f} acc {m['accuracy']:.3f} kl {m.get('kl', 0):.4f}"
    if status["eta_s"] is not None and status["state"] in ACTIVE:
        line += f" | eta {datetime.timedelta(seconds=round(status['eta_s']))}"
    lines.append(line)
    if status["checkpoint"]:
        lines.append(f"checkpoint after {status['checkpoint']} steps")
    if status["state"] not in ACTIVE | {"UNKNOWN", "COMPLETED"}:
        lines.append(f"continue with: rltools resume {status['run_dir']}")
    if status["evals"]:
        lines.append(f"held-out avg@{status['eval_k']}: " + ", ".join(f"step {s} {v:.3f}" for s, v in sorted(status["evals"].items())))
    if status["failed_component"]:
        lines.append(f"the {status['failed_component']} component failed first; the end of its log:")
        lines.append(status["log_tail"])
    return "\n".join(lines)


def read_metrics(paths: RunPaths) -> list[dict]:
    """The complete, readable records of metrics.jsonl (a line cut by a crash is not one)."""
    try:
        text = paths.metrics.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return _parse_records(text[: text.rfind("\n") + 1])


def _parse_records(text: str) -> list[dict]:
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_evals(paths: RunPaths) -> dict[int, dict]:
    """Held-out results by step, oldest first."""
    found = {step: _read_json(paths.eval_result(step)) for step in sorted(_eval_files(paths))}
    return {step: result for step, result in found.items() if result is not None}


def _eta(metrics: list[dict], total: int) -> float | None:
    recent = [m["time"] for m in metrics[-20:] if "time" in m]
    if len(recent) < 2:
        return None
    per_step = (recent[-1] - recent[0]) / (len(recent) - 1)
    return max(0.0, (total - metrics[-1]["step"] - 1) * per_step)


def _exit_codes(paths: RunPaths, attempt: int) -> dict[str, int]:
    codes = {}
    for role in ROLES:
        path = paths.component_exit(attempt, role)
        if path.exists():
            codes[role] = int(path.read_text().strip() or 1)
    return codes


def _mtime(paths: RunPaths, attempt: int, role: str) -> float:
    return paths.component_exit(attempt, role).stat().st_mtime


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


def task_logs(paths: RunPaths, attempt: int, role: str | None = None, rank: int | None = None) -> list[Path]:
    roles = [role] if role else list(ROLES)
    found = []
    for r in roles:
        if rank is not None:
            found.append(paths.task_log(attempt, r, rank))
        else:
            found += sorted(paths.attempt_log_dir(attempt).glob(f"{r}_*.log"), key=lambda p: int(p.stem.split("_")[1]))
    return found


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


def wait_for_end(paths: RunPaths, timeout_s: float | None = None, progress=None) -> dict:
    """Poll the run until its job is no longer active; `progress.update()` on each poll.

    Without `timeout_s` it still ends: a job that squeue forgets before its end is known (UNKNOWN after
    it was seen, or never seen within UNSEEN_S of the first poll) is reported as it stands."""
    start = time.monotonic()
    seen = False
    while True:
        if progress is not None:
            progress.update()
        status = run_status(paths)
        if status["state"] not in ACTIVE and status["state"] != "UNKNOWN":
            return status
        seen = seen or status["state"] in ACTIVE
        waited = time.monotonic() - start
        if status["state"] == "UNKNOWN" and (seen or waited > UNSEEN_S):
            return status
        if timeout_s is not None and waited > timeout_s:
            return status
        time.sleep(2.0)


class Progress:
    """One line per step (a redrawn bar on a terminal): step, reward, accuracy, tokens/s, timings.

    Invariant: it shows what the job it follows writes, each step and evaluation once. What the run
    directory held when it was created is history and is not shown again; a metrics.jsonl that a
    resume rewrites (a new, shorter file) is read again from its start, skipping lines already
    known, so a resume never replays the steps it discards. A line it cannot parse is skipped: the
    display must never stop the run it follows.
    """

    def __init__(self, config: RLConfig, paths: RunPaths, quiet: bool = False):
        self.paths, self.steps, self.k, self.quiet = paths, config.schedule.steps, config.eval.k, quiet
        self.tty = sys.stderr.isatty()
        self.inode, self.offset, self.printed = None, 0, False
        self.known = {_record_key(m) for m in self._new_records()}  # history
        self.shown_evals = dict(_eval_files(paths))  # step -> mtime of the result file, history too

    def update(self) -> None:
        lines = []  # (steps done, is an eval, text): an eval after k steps prints right after step k
        for m in self._new_records():
            if _record_key(m) in self.known:
                continue
            self.known.add(_record_key(m))
            lines.append((m["step"] + 1, False, step_line(m, self.steps)))
        for step, mtime in _eval_files(self.paths).items():
            if self.shown_evals.get(step) != mtime:
                self.shown_evals[step] = mtime
                result = _read_json(self.paths.eval_result(step))
                if result:
                    lines.append((step, True, eval_line(step, result)))
        if self.quiet:
            return
        for _, is_eval, text in sorted(lines, key=lambda item: item[:2]):
            if is_eval:
                _print(("\n" if self.tty else "") + text)
            else:
                _print(("\r" + text) if self.tty else text, end="" if self.tty else "\n")
            self.printed = True

    def finish(self) -> None:
        if self.quiet:
            return
        evals = read_evals(self.paths)
        if 0 in evals and self.steps in evals:
            before, after = evals[0]["avg_at_k"], evals[self.steps]["avg_at_k"]
            _print(f"\nheld-out avg@{self.k}: {before:.3f} before -> {after:.3f} after {self.steps} steps "
                   f"({100 * (after - before):+.1f} points)")
        _print(f"run directory: {self.paths.root}")

    def _new_records(self) -> list[dict]:
        """Records appended since the last poll; all of them again after the file was replaced."""
        try:
            with open(self.paths.metrics, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self.inode or stat.st_size < self.offset:  # new, or a resume rewrote it
                    if self.printed and self.inode is not None:
                        _print(f"\n(the job restarted from its checkpoint after {self.paths.latest_checkpoint()} steps)")
                    self.inode, self.offset = stat.st_ino, 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        records = []
        return _parse_records(complete.decode(errors="replace"))


def _record_key(record: dict) -> tuple:
    return record["step"], record.get("time")


def _eval_files(paths: RunPaths) -> dict[int, int]:
    """Evaluation result files by step, with their modification times (a rewrite is a new result)."""
    found = {}
    for path in paths.eval_dir.glob("step_*.json") if paths.eval_dir.is_dir() else ():
        try:
            found[int(path.stem.split("_")[1])] = path.stat().st_mtime_ns
        except (ValueError, FileNotFoundError):
            continue
    return found


def step_line(m: dict, total: int) -> str:
    done = m["step"] + 1
    bar = ("=" * int(20 * done / total)).ljust(20)
    return (f"step {done}/{total} [{bar}] reward {m['reward_mean']:.3f} acc {m['accuracy']:.3f} "
            f"kl {m.get('kl', 0):.4f} | {m['gen_tokens_per_s']:.0f} tok/s | gen {m['generation_s']:.2f}s "
            f"train {m['training_s']:.2f}s sync {m['sync_s']:.2f}s")


def eval_line(step: int, result: dict) -> str:
    return (f"eval after {step} steps: avg@{result['k']} {result['avg_at_k']:.3f} "
            f"(+- {result['stderr']:.3f}, {result['n_problems']} problems)")


def _print(text: str, end: str = "\n") -> None:
    try:
        print(text, end=end, file=sys.stderr, flush=True)
    except OSError:  # a closed terminal: the run goes on
        pass
