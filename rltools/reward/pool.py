"""TimeoutPool: call a 'module:function' in worker processes with a hard deadline per call.

Why processes, not threads: math-verify times itself out with SIGALRM, which works only in a
process's main thread, and a checker stuck in C code (sympy on \\boxed{9^{9^{9^{9}}}}) cannot be
interrupted from another thread anyway. A worker that misses its deadline is killed (SIGKILL) and
replaced; its call scores the pool's `fallback`.

Invariants:
- `map` returns one result per input, in order, within about timeout_s x ceil(calls / workers)
  (plus start-up), whatever the function does: hangs, raises, crashes its process, or returns a
  non-number (each of these is the fallback, and logged).
- Workers are started with "spawn": they never inherit the generator's threads or vLLM state.
- The pool owns its workers: `close` (also at exit) kills any that are left.
"""

import atexit
import importlib
import logging
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection, wait

log = logging.getLogger("rltools.reward")

START_TIMEOUT_S = 60.0  # a spawned worker imports the function's module before its first call


def load_function(reference: str):
    """The callable named by 'package.module:function'; ValueError naming what is missing."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {reference!r}")
    module = importlib.import_module(module_name)
    try:
        function = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(function):
        raise ValueError(f"{reference!r} is not callable")
    return function


def _worker(reference: str, conn: Connection) -> None:
    try:
        function = load_function(reference)
    except Exception as err:  # reported to the parent, which raises it with the reference named
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            result = function(*args)
            conn.send(("ok", float(result)))
        except Exception as err:
            conn.send(("raised", f"{type(err).__name__}: {err}"))


class TimeoutPool:
    def __init__(self, reference: str, timeout_s: float, workers: int, fallback: float = 0.0):
        self.reference, self.timeout_s, self.fallback = reference, timeout_s, fallback
        self._ctx = mp.get_context("spawn")
        self._workers = [self._start() for _ in range(workers)]
        self.timeouts = 0
        atexit.register(self.close)

    def _start(self) -> tuple:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker, args=(self.reference, child), daemon=True)
        process.start()
        child.close()
        if not parent.poll(START_TIMEOUT_S):
            process.kill()
            raise RuntimeError(f"reward worker for {self.reference!r} did not start within {START_TIMEOUT_S:.0f} s")
        status, detail = parent.recv()
        if status != "ready":
            process.join()
            raise ValueError(f"reward function {self.reference!r} cannot be loaded: {detail}")
        return process, parent

    def map(self, calls: list[tuple]) -> list[float]:
        """Results of function(*args) for each args in `calls`, in order (fallback on failure)."""
        results = [self.fallback] * len(calls)
        pending = list(enumerate(calls))[::-1]
        busy: dict[Connection, tuple[int, float, int]] = {}  # conn -> (call index, deadline, worker slot)
        idle = list(range(len(self._workers)))
        while pending or busy:
            while pending and idle:
                slot = idle.pop()
                index, args = pending.pop()
                self._workers[slot][1].send(args)
                busy[self._workers[slot][1]] = (index, time.monotonic() + self.timeout_s, slot)
            soonest = min(deadline for _, deadline, _ in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, soonest - time.monotonic())):
                index, _, slot = busy.pop(conn)
                results[index] = self._receive(conn, slot, index)
                idle.append(slot)
            now = time.monotonic()
            for conn, (index, deadline, slot) in list(busy.items()):
                if now >= deadline:
                    busy.pop(conn)
                    self.timeouts += 1
                    log.warning("reward call %d exceeded reward.timeout_s %.1f s: scored %s", index, self.timeout_s, self.fallback)
                    self._replace(slot)
                    idle.append(slot)
        return results

    def _receive(self, conn: Connection, slot: int, index: int) -> float:
        try:
            status, value = conn.recv()
        except (EOFError, OSError):  # the worker died (segfault, os._exit, OOM kill)
            log.warning("reward worker died on call %d: scored %s", index, self.fallback)
            self._replace(slot)
            return self.fallback
        if status != "ok" or value != value:  # NaN is not a reward
            log.warning("reward call %d failed (%s): scored %s", index, value, self.fallback)
            return self.fallback
        return value

    def _replace(self, slot: int) -> None:
        process, conn = self._workers[slot]
        process.kill()
        process.join()
        conn.close()
        self._workers[slot] = self._start()

    def close(self) -> None:
        for process, conn in self._workers:
            if process.is_alive():
                process.kill()
            process.join()
            conn.close()
        self._workers = []
        atexit.unregister(self.close)


def default_workers() -> int:
    return max(1, min(4, (os.cpu_count() or 1) - 1))
