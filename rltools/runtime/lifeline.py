"""Processes that die with the one that started them: vLLM's engine-core process and its workers
live and die with their generator.

vLLM's engine-core process (its default) does not notice when the generator that started it is
gone: killed with kill -9, or leaving on SIGTERM with `os._exit`. It kept running, and its worker
kept its place in the weight-sync group, so trainer rank 0's collective waited on a generator that
no longer existed (measured: >30 s, until a deadline). `die_with(pid)`, called in a vLLM worker,
watches the generator and then kills the processes between the two (the engine core) and the
worker itself; vLLM's own death pipe takes the other TP workers down with the engine core.

`children_of` and `wait_ended` serve the sandbox too, which waits for its processes to end.

Invariant: only the processes on the parent chain from the caller up to `pid` are killed, never
`pid` itself or anything outside that chain.
"""

import logging
import os
import signal
import threading
import time

log = logging.getLogger("rltools.lifeline")

POLL_S = 0.2


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses):
    [state, ppid, pgrp, session, ...]; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid`, None when it is gone."""
    fields = proc_stat(pid)
    return int(fields[1]) if fields else None


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid`: from /proc/PID/task/PID/children, or a scan of /proc on a
    kernel without that file."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(child) for child in listing.read().split()]
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            return []
    children = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and parent_of(int(entry.name)) == pid:
            children.append(int(entry.name))
    return children


def wait_ended(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until each of `pids` has exited (gone, or a zombie nobody reaps); returns those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [pid for pid in pids if (proc_stat(pid) or ["Z"])[0] not in ("Z", "X")]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.01)


def chain_to(ancestor: int) -> list[int] | None:
    """The pids from this process up to `ancestor`'s child ([] when this is `ancestor`); None when
    `ancestor` is not an ancestor (any more)."""
    chain, pid = [], os.getpid()
    while pid != ancestor:
        chain.append(pid)
        pid = parent_of(pid)
        if pid is None or pid <= 1:
            return None
    return chain


def die_with(ancestor: int) -> bool:
    """Kill this process, and those between it and `ancestor`, once `ancestor` is gone (a daemon
    thread polls every POLL_S: the topmost of them is re-parented when `ancestor` dies). Returns
    whether a watch was started (False: this process is `ancestor`)."""
    chain = chain_to(ancestor)
    if chain == []:
        return False
    if chain is None:  # gone before the watch began
        _die([os.getpid()], ancestor)
    top = chain[-1]

    def watch():
        while parent_of(top) == ancestor:
            time.sleep(POLL_S)
        _die(chain, ancestor)

    threading.Thread(target=watch, name=f"rltools-die-with-{ancestor}", daemon=True).start()
    return True


def _die(chain: list[int], ancestor: int) -> None:
    log.warning("process %d that started this one is gone: stopping %s", ancestor, chain)
    for pid in reversed(chain[1:]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)
