"""The faults tier: the demo job under the local launcher, broken on purpose while it runs.

Each test kills, signals, corrupts, truncates, fills or doubles something and then checks what a
user would: a clear message, no process left behind, and on resume every step exactly once.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rltools.runtime.lifeline import proc_stat

# Short and cheap: 16 held-out problems, evaluated only before and after training.
FAST = ["eval.problems=16", "schedule.eval_every=0", "schedule.checkpoint_every=5"]


class Launch:
    """One `rltools submit|resume` of the demo in a subprocess, its stderr kept in a file."""

    log_dir: Path | None = None
    """Where launchers' stderr goes (default: beside the run directory)."""

    def __init__(self, repo: Path, run_dir: Path, *args: str, env: dict | None = None):
        self.run_dir = run_dir
        logs = self.log_dir or run_dir.parent
        self.log = logs / f"{run_dir.name}.launch{len(list(logs.glob('*.launch*')))}.err"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "rltools", *map(str, args)], cwd=repo, stderr=err,
                                         stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                         preexec_fn=_as_from_a_terminal)

    @classmethod
    def submit(cls, repo, run_dir, *overrides, env=None) -> "Launch":
        sets = [word for o in [f"run.dir={run_dir}", *FAST, *overrides] for word in ("--set", o)]
        return cls(repo, run_dir, "submit", repo / "configs" / "demo.yaml", *sets, env=env)

    @classmethod
    def resume(cls, repo, run_dir, env=None) -> "Launch":
        return cls(repo, run_dir, "resume", run_dir, env=env)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the launcher did not end in {timeout:.0f} s:\n{self.stderr[-3000:]}") from None

    @property
    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_output(self, text: str, timeout: float = 180) -> None:
        """Until the launcher has printed `text` (e.g. a step line of its own)."""
        deadline = time.monotonic() + timeout
        while text not in self.stderr:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} (launcher exit {self.proc.poll()}):\n{self.stderr[-3000:]}")
            time.sleep(0.1)

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        """Until metrics.jsonl records `step` steps done (a line per step)."""
        deadline = time.monotonic() + timeout
        while len(steps(self.run_dir)) < step or max(steps(self.run_dir)) < step - 1:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no step {step} (launcher exit {self.proc.poll()}):\n{self.stderr[-3000:]}")
            time.sleep(0.1)


def _as_from_a_terminal() -> None:
    """Ctrl-C as at a terminal: a pytest started in the background (`cmd &` in scripts/test.sh)
    passes SIGINT on ignored, and the launcher rightly keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]


def role_pids(run_dir: Path) -> dict[str, int]:
    """The running role processes of a run directory, by role."""
    found = {}
    for role in ("generator", "trainer"):
        out = subprocess.run(["pgrep", "-f", f"rltools.jobs.{role} {run_dir}$"], capture_output=True, text=True).stdout.split()
        tasks = [pid for pid in out if not _is_engine(pid)]  # a generator task is its supervisor
        if out:
            found[role] = int((tasks or out)[0])
    return found


def _is_engine(pid: str) -> bool:
    """Whether `pid` is the engine a generator task's supervisor runs (`generate/supervisor.py`)."""
    try:
        return b"RLTOOLS_ENGINE_RESTART=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def wait_gone(run_dir: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while role_pids(run_dir):
        assert time.monotonic() < deadline, f"role processes outlived the launcher: {role_pids(run_dir)}"
        time.sleep(0.2)


def session_members(sessions: set[int]) -> list[str]:
    """'pid command' of each live process in one of `sessions`: a role is started as a session
    leader, and vLLM's engine-core process and workers stay in the generator's session."""
    found = []
    for proc in Path("/proc").iterdir():
        fields = proc_stat(int(proc.name)) if proc.name.isdigit() else None
        if fields and fields[0] != "Z" and int(fields[3]) in sessions:
            try:
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # it ended meanwhile
                continue
            found.append(f"{proc.name} {command.strip()}")
    return found


def wait_session_gone(sessions: set[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while left := session_members(sessions):
        assert time.monotonic() < deadline, f"processes outlived their role by {timeout:.0f} s: {left}"
        time.sleep(0.2)


def kill(pid: int, signum=signal.SIGKILL) -> None:
    os.kill(pid, signum)
