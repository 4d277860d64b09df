"""Publishing a service address in the run directory, and finding it from another process.

Invariant: a reader never sees a half-written record (tmp + fsync + rename), and never trusts a
record left by an earlier start of the job (it carries the attempt it belongs to, e.g. RoleEnv.attempt).
Readers poll with back-off until a deadline: a shared filesystem is not a message bus.
"""

import json
import time
from pathlib import Path

from ..durable import atomic_write


class AddressTimeout(TimeoutError):
    """The record did not appear in time; the message names the file, the attempt and who publishes it."""


def publish_address(path: Path, host: str, port: int, attempt: int | str) -> None:
    atomic_write(path, json.dumps({"host": host, "port": port, "attempt": attempt}))


def wait_for_address(path: Path, attempt: int | str, timeout_s: float, publisher: str) -> tuple[str, int]:
    """(host, port) from `path` once it holds `attempt`; AddressTimeout after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay, found = 0.05, None
    while True:
        found = _read(path)
        if found and found.get("attempt") == attempt:
            return found["host"], int(found["port"])
        left = deadline - time.monotonic()
        if left <= 0:
            seen = f"it holds attempt {found.get('attempt')}, an earlier start" if found else "it does not exist"
            raise AddressTimeout(
                f"{publisher} did not publish its address for attempt {attempt} in {path} within "
                f"{timeout_s:.0f} s ({seen}); check that {publisher} is running"
            )
        time.sleep(min(delay, left))
        delay = min(delay * 2, 1.0)


def read_address(path: Path, attempt: int | str) -> tuple[str, int] | None:
    """(host, port) from `path` if it holds `attempt` now; None otherwise (no waiting)."""
    found = _read(path)
    return (found["host"], int(found["port"])) if found and found.get("attempt") == attempt else None


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def published_attempt(path: Path) -> str | None:
    """The attempt whose address `path` holds now (None: none published): an engine that joins a
    running run from a job of its own (`rltools join`) joins whatever start of the run is running."""
    found = _read(path)
    return found.get("attempt") if found else None
