"""SandboxPool: sandboxes started ahead, so a call does not wait for bwrap and an interpreter to start.

Invariant: each sandbox runs one program and is then killed; the pool starts its replacement as it
hands one out, so the replacement boots while the program runs. Nothing is ever reused.
"""

import collections
import sys
import threading

from .sandbox import Limits, Result, Sandbox


class SandboxPool:
    """`size` warm sandboxes with the same limits; `run` is safe to call from several threads.

    A warm sandbox is a few idle processes (about 15 MB). bwrap ends a sandbox when the thread that
    started it exits (--die-with-parent), so call `run` from long-lived threads (a thread pool's
    workers are); a sandbox found dead is replaced by a fresh one, which then starts cold.
    """

    def __init__(self, size: int = 4, limits: Limits = Limits(), python: str = sys.executable):
        if size < 1:
            raise ValueError(f"a SandboxPool needs size >= 1, got {size}")
        self.limits, self.python = limits, python
        self._lock = threading.Lock()
        self._warm = collections.deque(Sandbox(limits, python) for _ in range(size))
        self._closed = False

    def run(self, source: str) -> Result:
        """Run one program in a warm sandbox, which is killed afterwards."""
        sandbox = self._take()
        try:
            return sandbox.run(source)
        finally:
            sandbox.kill()

    def _take(self) -> Sandbox:
        with self._lock:
            if self._closed:
                raise RuntimeError("this SandboxPool is closed")
            sandbox = self._warm.popleft()
            self._warm.append(Sandbox(self.limits, self.python))
        if not sandbox.alive():
            sandbox.kill()
            sandbox = Sandbox(self.limits, self.python)
        return sandbox

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._warm:
                self._warm.popleft().kill()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
