"""The local launcher: the same job as the Slurm one, as processes on this machine.

Invariant: the children are started exactly as `srun` would start them (same entry modules, same
run directory, RoleEnv's local variables instead of SLURM_*), and they never outlive the launcher:
a failing child, Ctrl-C, SIGTERM, SIGHUP (unless started under `nohup`), an error in the launcher
itself or a finished run stops them all; if the launcher is killed outright (SIGKILL), the kernel sends each child SIGTERM
(PR_SET_PDEATHSIG), which a trainer answers with a checkpoint. The children inherit the run
directory's lock, so no second launch starts until the last of them has stopped.
"""

import ctypes
import errno
import os
import signal
import subprocess
import sys
import time
from typing import Protocol

from ..config.schema import RLConfig
from ..paths import RunPaths
from ..runtime.preempt import EXIT_STOPPED
from ..runtime.role_env import RoleEnv
from .plan import plan
from .run_lock import RunLock

STOP_GRACE_S = 30.0  # a trainer stopping on SIGTERM writes its checkpoint first
LOW_DISK_BYTES = 1 << 20
_PR_SET_PDEATHSIG = 1
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}


class Terminated(Exception):
    """SIGTERM or SIGHUP reached the launcher (`timeout`, `kill`, a closed terminal)."""


class Display(Protocol):
    """What the launcher shows while it supervises (rltools.monitor.progress.Progress). The caller
    builds it, so that launch never imports monitor (which reads what launch writes), and builds it
    before `run_local` starts the children: what they write afterwards is new."""

    def update(self) -> None:
        """Show what the run wrote since the last call; called on each poll."""

    def finish(self) -> None:
        """The closing lines, after the last update of a run that completed."""


def run_local(config: RLConfig, paths: RunPaths, lock: RunLock, progress: Display) -> int:
    attempt = len(paths.attempts())  # 0 for a fresh run, +1 for each resume (as the Slurm script counts)
    previous = trap_stop_signals()
    children: list[dict] = []  # filled as they start: a signal during start-up stops those already running
    try:
        start_children(config, paths, attempt, lock, children)
        return _supervise(children, paths, progress)
    except (KeyboardInterrupt, Terminated) as interruption:
        name = str(interruption) or "SIGINT"
        for signum in (signal.SIGINT, *previous):  # a second signal must not cut the shutdown short
            previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, signal.SIG_IGN)
        _say(f"\ninterrupted by {name}: stopping the generator and trainer processes (the trainer checkpoints first)")
        stop(children)
        done = paths.latest_checkpoint()
        _say(f"checkpoint after {done} steps; continue with: rltools resume {paths.root}" if done else
             f"no checkpoint yet; start again with: rltools resume {paths.root}")
        return EXIT_CODES[name]
    finally:
        stop(children)  # a no-op after a normal end; after an error in the launcher itself, the safety net
        record_exits(children, paths, attempt)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def trap_stop_signals() -> dict:
    """SIGTERM and SIGHUP raise Terminated; returns the handlers they had. A signal this process was
    started ignoring stays ignored: `nohup` (SIGHUP) and `cmd &` in a script (SIGINT) mean to keep
    the run going."""
    watched = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN]
    return {signum: signal.signal(signum, _terminate) for signum in watched}


def _terminate(signum, frame) -> None:
    raise Terminated(signal.Signals(signum).name)


def _supervise(children: list[dict], paths: RunPaths, progress: Display) -> int:
    """Until the trainer ends. A generator that fails while another one runs is the trainer's to
    handle (it goes on with the other engines: `train.fleet`); the last one failing stops the run.
    A judge engine that fails is the generators' to handle (they send its share to the other judge
    engines; with none left they fail, and so the run); the judges serve until the run ends."""
    trainers = [c for c in children if c["role"] == "trainer"]
    generators = [c for c in children if c["role"] == "generator"]
    lost: set[str] = set()
    while True:
        progress.update()
        running = [g for g in generators if g["proc"].poll() is None]
        for child in children:
            if child["role"] != "trainer" and child["proc"].poll() not in (None, 0) and child["name"] not in lost:
                lost.add(child["name"])
                peers = [c for c in children if c["role"] == child["role"] and c["proc"].poll() is None]
                if peers:
                    _say(f"\n{child['name']} failed (exit {child['proc'].returncode}); the run goes on with the "
                         f"other {'engines' if child['role'] == 'generator' else 'judge engines'}. The end of its "
                         f"log {child['log']}:")
                    _say(_tail(child["log"], lines=8))
        ended = [t for t in trainers if t["proc"].poll() not in (None, 0)]
        if not ended and not running and any(t["proc"].poll() is None for t in trainers):
            ended = [g for g in generators if g["name"] in lost]  # every engine is gone
        if ended:
            stop(children)
            child = ended[0]
            if child["role"] == "trainer" and child["proc"].returncode == EXIT_STOPPED:
                progress.update()
                done = paths.latest_checkpoint()
                when = f"with a checkpoint of {done} steps" if done else "before its first step"
                _say(f"\nthe trainer stopped {when} (its log says why); continue with: rltools resume {paths.root}")
                return EXIT_STOPPED
            _say(f"\n{child['name']} failed (exit {child['proc'].returncode}); its log {child['log']}:")
            tail = _tail(child["log"])
            _say(tail)
            _say(_disk_note(paths, tail))
            return 1
        if all(t["proc"].poll() == 0 for t in trainers) and not running:
            progress.update()
            progress.finish()
            return 0
        time.sleep(0.5)


def record_exits(children: list[dict], paths: RunPaths, attempt: int) -> None:
    """Each role's exit status, as the Slurm job script writes it (the first failure of its tasks)."""
    for role in {child["role"] for child in children}:
        codes = [child["proc"].returncode for child in children if child["role"] == role]
        code = next((c for c in codes if c), 0) if None not in codes else 1
        try:
            paths.component_exit(attempt, role).write_text(f"{code}\n")
        except OSError as err:  # a full disk: `status` then knows less, the run itself lost nothing
            _say(f"could not record the {role}s' exit status ({err.strerror}): `rltools status` may say UNKNOWN")


def start_children(config: RLConfig, paths: RunPaths, attempt: int, lock: RunLock, children: list[dict]) -> None:
    parent = os.getpid()
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
                    pass_fds=(lock.fd,),  # the run stays locked until its last process has ended
                    preexec_fn=lambda: _die_with(parent),
                )
            children.append({"name": f"{component.role} {rank}", "role": component.role, "proc": proc, "log": log})


def _die_with(parent: int) -> None:
    """In the child before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def stop(children: list[dict]) -> None:
    """SIGTERM every running child (its whole process group), SIGKILL those still alive after the grace."""
    for child in children:
        if child["proc"].poll() is None:
            _signal_group(child["proc"], signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child["proc"].wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(child["proc"], signal.SIGKILL)
            child["proc"].wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def _say(text: str) -> None:
    """A line for the user on stderr; a closed terminal (SIGHUP) must not stop the shutdown."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


def _disk_note(paths: RunPaths, tail: str) -> str:
    """A full run directory also cuts the roles' own logs short: say so, whatever the log shows; and
    when the role's log says so, though the space is back (the role removed what it was writing)."""
    try:
        stat = os.statvfs(paths.root)
    except OSError:
        return ""
    free = stat.f_bavail * stat.f_frsize
    if free >= LOW_DISK_BYTES and os.strerror(errno.ENOSPC) not in tail:
        return ""
    return (f"the filesystem of {paths.root} is full ({free // 1024} KiB free): free space there, then "
            f"`rltools resume {paths.root}` continues from the last checkpoint")


def _tail(path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
