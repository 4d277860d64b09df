"""TimeoutPool: call a 'module:function' in worker processes with a hard deadline per call.

Why processes, not threads: math-verify times itself out with SIGALRM, which works only in a
process's main thread, and a checker stuck in C code (sympy on \\boxed{9^{9^{9^{9}}}}) cannot be
interrupted from another thread anyway. A worker that misses its deadline is killed (SIGKILL) and
replaced; its call scores the pool's `fallback`.

Invariants:
- `map` returns one result per input, in order, within about timeout_s x ceil(calls / workers)
  (plus start-up), whatever the function does: hangs, raises, crashes its process, or returns a
  non-number (each of these is the fallback, and logged).
- Workers are fresh interpreters (rltools/reward/worker.py), not forks: they never inherit the
  generator's threads or vLLM state, nor re-run the caller's __main__ (multiprocessing's "spawn" would).
- The pool owns its workers: `close` (also at exit) kills any that are left.
"""

import atexit
import logging
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait

log = logging.getLogger("rltools.reward")

START_TIMEOUT_S = 60.0  # a fresh worker imports the function's module before its first call


class TimeoutPool:
    def __init__(self, reference: str, timeout_s: float, workers: int, fallback: float = 0.0):
        self.reference, self.timeout_s, self.fallback = reference, timeout_s, fallback
        self._workers: list[tuple[subprocess.Popen, Connection, Connection]] = []
        atexit.register(self.close)
        try:
            for _ in range(workers):
                self._workers.append(self._start())
        except BaseException:
            self.close()
            raise
        self.timeouts = 0

    def _start(self) -> tuple[subprocess.Popen, Connection, Connection]:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what this process imports
        process = subprocess.Popen(
            [sys.executable, "-m", "rltools.reward.worker", self.reference, str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        requests, replies = Connection(to_child_w, readable=False), Connection(from_child_r, writable=False)
        try:
            if not replies.poll(START_TIMEOUT_S):
                raise RuntimeError(f"reward worker for {self.reference!r} did not start within {START_TIMEOUT_S:.0f} s")
            status, detail = replies.recv()
        except EOFError:
            status, detail = "error", f"the worker exited with code {process.wait()}"
        except BaseException:
            _stop(process, requests, replies)
            raise
        if status != "ready":
            _stop(process, requests, replies)
            raise ValueError(f"reward function {self.reference!r} cannot be loaded: {detail}")
        return process, requests, replies

    def map(self, calls: list[tuple]) -> list[float]:
        """Results of function(*args) for each args in `calls`, in order (fallback on failure)."""
        results = [self.fallback] * len(calls)
        pending = list(enumerate(calls))[::-1]
        busy: dict[Connection, tuple[int, float, int]] = {}  # replies -> (call index, deadline, worker slot)
        idle = list(range(len(self._workers)))
        while pending or busy:
            while pending and idle:
                slot = idle.pop()
                index, args = pending.pop()
                _, requests, replies = self._workers[slot]
                requests.send(args)
                busy[replies] = (index, time.monotonic() + self.timeout_s, slot)
            soonest = min(deadline for _, deadline, _ in busy.values())
            for replies in wait(list(busy), timeout=max(0.0, soonest - time.monotonic())):
                index, _, slot = busy.pop(replies)
                results[index] = self._receive(replies, slot, index)
                idle.append(slot)
            now = time.monotonic()
            for replies, (index, deadline, slot) in list(busy.items()):
                if now >= deadline:
                    busy.pop(replies)
                    self.timeouts += 1
                    log.warning("reward call %d exceeded reward.timeout_s %.1f s: scored %s", index, self.timeout_s, self.fallback)
                    self._replace(slot)
                    idle.append(slot)
        return results

    def _receive(self, replies: Connection, slot: int, index: int) -> float:
        try:
            status, value = replies.recv()
        except (EOFError, OSError):  # the worker died (segfault, os._exit, OOM kill)
            log.warning("reward worker died on call %d: scored %s", index, self.fallback)
            self._replace(slot)
            return self.fallback
        if status != "ok" or value != value:  # NaN is not a reward
            log.warning("reward call %d failed (%s): scored %s", index, value, self.fallback)
            return self.fallback
        return value

    def _replace(self, slot: int) -> None:
        _stop(*self._workers[slot])
        self._workers[slot] = self._start()

    def close(self) -> None:
        for worker in self._workers:
            _stop(*worker)
        self._workers = []
        atexit.unregister(self.close)


def _stop(process: subprocess.Popen, requests: Connection, replies: Connection) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
    requests.close()
    replies.close()


def default_workers() -> int:
    return max(1, min(4, (os.cpu_count() or 1) - 1))
