"""TimeoutPool: call a 'module:function' in worker processes with a hard deadline per call.

Why processes, not threads: math-verify times itself out with SIGALRM, which works only in a
process's main thread, and a checker stuck in C code (sympy on \\boxed{9^{9^{9^{9}}}}) cannot be
interrupted from another thread anyway. A worker that misses its deadline is killed (SIGKILL) and
replaced; its call scores the pool's `fallback`.

Invariants:
- `map` returns one result per input, in order, within about timeout_s x ceil(calls / workers)
  (plus start-up), whatever the function does: hangs, raises, crashes its process, or returns
  something that is not a finite number (each of these is the fallback, and counted by kind in the
  result's `failures`: rltools/reward/failures.py). Given `max_failures`, it sends no further call
  once more have failed, and returns when those in flight are answered.
- Workers are fresh interpreters (rltools/reward/worker.py), not forks: they never inherit the
  generator's threads or vLLM state, nor re-run the caller's __main__ (multiprocessing's "spawn" would).
- A worker gets real calls only once it is ready: it has imported the function's module and, when
  the pool has a `warmup`, answered that call with the expected value, all within START_TIMEOUT_S
  (replacements too). Lazy imports and first-call set-up thus never count against timeout_s.
- The pool owns its workers: `close` (also at exit) kills any that are left.
"""

import atexit
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from .failures import ERROR, NOT_A_NUMBER, TIMEOUT, RewardFailures, Scores

log = logging.getLogger("rltools.reward")

START_TIMEOUT_S = 60.0  # a fresh worker imports the function's module and runs the warm-up


@dataclass(frozen=True)
class Warmup:
    """A call every worker makes before its first real one: function(*args) must return `expected`.

    It proves the function works (a broken checker would otherwise score 0 forever) and pays for
    what the function does lazily on its first call (math-verify imports and builds its parser).
    """

    args: tuple
    expected: float


Worker = tuple[subprocess.Popen, Connection, Connection]


class TimeoutPool:
    """Workers that call `reference` ('module:function') with a deadline of timeout_s per call.

    Before a worker takes a call it has imported the function's module and, if `warmup` is given,
    made that call; without a warm-up anything the function does on its first call (a lazy import,
    a cache) counts against that call's deadline. ValueError if the function cannot be loaded or
    fails its warm-up; RuntimeError if a worker is not ready within START_TIMEOUT_S.
    """

    def __init__(self, reference: str, timeout_s: float, workers: int, fallback: float = 0.0,
                 warmup: Warmup | None = None, batched: bool = False):
        self.reference, self.timeout_s, self.fallback, self.warmup = reference, timeout_s, fallback, warmup
        self.batched = batched
        """Each call is a batch: its result is the worker's list of (status, value) replies, one per item."""
        self._workers: list[Worker] = []
        atexit.register(self.close)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            for _ in range(workers):  # all start at once: their imports and warm-ups overlap
                self._workers.append(self._spawn())
            for worker in self._workers:
                self._await_ready(worker, deadline)
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> Worker:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what this process imports
        process = subprocess.Popen(
            [sys.executable, "-m", "rltools.reward.worker", self.reference, str(to_child_r), str(from_child_w),
             *(["batched"] if self.batched else [])],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        return process, Connection(to_child_w, readable=False), Connection(from_child_r, writable=False)

    def _await_ready(self, worker: Worker, deadline: float) -> None:
        """Return once `worker` has loaded the function and passed the warm-up, else raise naming it."""
        status, detail = self._reply(worker, deadline)
        if status != "ready":
            raise ValueError(f"reward function {self.reference!r} cannot be loaded: {detail}")
        if self.warmup is None:
            return
        _, requests, _ = worker
        try:
            requests.send((self.warmup.args, {}))
        except OSError:  # it died after reporting ready: _reply says with which exit code
            pass
        status, value = self._reply(worker, deadline)
        if status != "ok" or value != self.warmup.expected:
            outcome = {"ok": f"it returned {value!r}, expected {self.warmup.expected!r}",
                       "raised": f"it raised {value}", "not a number": f"it {value}"}
            raise ValueError(
                f"reward function {self.reference!r} failed its warm-up call {self.warmup.args!r}: "
                f"{outcome.get(status, value)}"
            )

    def _reply(self, worker: Worker, deadline: float) -> tuple[str, object]:
        """The worker's next message during start-up; ("error", why) if it exited."""
        process, _, replies = worker
        try:
            if not replies.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(
                    f"reward worker for {self.reference!r} was not ready within START_TIMEOUT_S "
                    f"{START_TIMEOUT_S:.0f} s (import{' and warm-up' if self.warmup else ''})"
                )
            return replies.recv()
        except (EOFError, OSError):
            return "error", f"the worker exited with code {process.wait()}"

    def map(self, calls: list[tuple[tuple, dict]], max_failures: int | None = None) -> Scores:
        """Results of function(*args, **kwargs) for each (args, kwargs) in `calls`, in order (fallback on
        failure; a float, a dict of named floats, or a batched call's list of replies), and which calls
        failed; past `max_failures` failures the calls not yet sent are not made (their results stay
        the fallback, and `failures.calls` counts only those made)."""
        results = [self.fallback] * len(calls)
        failures = RewardFailures()
        pending = list(enumerate(calls))[::-1]
        busy: dict[Connection, tuple[int, float, int]] = {}  # replies -> (call index, deadline, worker slot)
        idle = list(range(len(self._workers)))

        def more() -> bool:
            return bool(pending) and (max_failures is None or failures.count <= max_failures)

        while busy or more():
            while idle and more():
                slot = idle.pop()
                index, call = pending.pop()
                _, requests, replies = self._workers[slot]
                requests.send(call)
                failures.calls += 1
                busy[replies] = (index, time.monotonic() + self.timeout_s, slot)
            soonest = min(deadline for _, deadline, _ in busy.values())
            for replies in wait(list(busy), timeout=max(0.0, soonest - time.monotonic())):
                index, _, slot = busy.pop(replies)
                results[index] = self._receive(replies, slot, index, failures)
                idle.append(slot)
            now = time.monotonic()
            for replies, (index, deadline, slot) in list(busy.items()):
                if now >= deadline:
                    busy.pop(replies)
                    failures.add(index, TIMEOUT, f"a call exceeded reward.timeout_s {self.timeout_s:g} s")
                    log.debug("reward call %d exceeded reward.timeout_s %.1f s: scored %s", index, self.timeout_s,
                              self.fallback)
                    self._replace(slot)
                    idle.append(slot)
        return Scores(results, failures)

    def _receive(self, replies: Connection, slot: int, index: int, failures: RewardFailures) -> float:
        try:
            status, value = replies.recv()
        except (EOFError, OSError):  # the worker died (segfault, os._exit, OOM kill)
            code = self._replace(slot)
            failures.add(index, ERROR, f"its worker process died (exit code {code})")
            log.debug("reward worker died on call %d (exit code %d): scored %s", index, code, self.fallback)
            return self.fallback
        if status in ("ok", "batch"):
            return value
        if status == "raised":
            failures.add(index, ERROR, value)
        else:  # "not a number": `value` says what it returned
            failures.add(index, NOT_A_NUMBER, f"it {value}")
        log.debug("reward call %d failed (%s): scored %s", index, value, self.fallback)
        return self.fallback

    def _replace(self, slot: int) -> int:
        """A fresh worker in `slot`, ready and warm before map sends it the next call; returns the exit
        code of the one it replaces."""
        code = _stop(*self._workers[slot])
        self._workers[slot] = self._spawn()  # owned by the pool from here: close stops it if it fails
        self._await_ready(self._workers[slot], time.monotonic() + START_TIMEOUT_S)
        return code

    def close(self) -> None:
        for worker in self._workers:
            _stop(*worker)
        self._workers = []
        atexit.unregister(self.close)


def _stop(process: subprocess.Popen, requests: Connection, replies: Connection) -> int:
    """Kill the worker unless it has ended; its exit code."""
    if process.poll() is None:
        process.kill()
    code = process.wait()
    requests.close()
    replies.close()
    return code


def default_workers() -> int:
    return max(1, min(4, (os.cpu_count() or 1) - 1))
