"""One job at a time per run directory: an flock on `RUN_DIR/run.lock`, naming its holder.

Invariants:
- Whatever runs a run directory's job holds the lock for the job's whole life: the local launcher
  (its role processes inherit the locked descriptor, so the lock outlives a killed launcher until
  its last role has stopped), or the Slurm job script (`flock` on the batch host). A second
  `submit`/`resume`/`render` of the same directory is refused with the holder named, before it
  changes anything in the directory.
- The kernel drops an flock when its last holder dies, so a lock is never stale: a crashed holder's
  leftover host/pid record is simply overwritten by the next holder (and reported as taken over).
- A clean release empties the record first, so a record found on acquiring means its holder ended
  without releasing (killed, or the node died).
"""

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time

from ..errors import UserError
from ..paths import RunPaths

log = logging.getLogger("rltools.lock")

ACQUIRE_WAIT_S = 0.5  # rides out a `rltools status` probing the lock at the same moment (microseconds)
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunInUse(UserError):
    """The run directory's lock is held by another job; the message names the holder."""


class RunLock:
    def __init__(self, paths: RunPaths, fd: int, previous: dict | None = None):
        self.paths, self.fd = paths, fd
        self.previous = previous
        """The record of a holder that ended without releasing (killed), if there was one."""

    @classmethod
    def acquire(cls, paths: RunPaths, by: str, wait_s: float = ACQUIRE_WAIT_S) -> "RunLock":
        """Take the lock of `paths` (an existing run directory) for `by`, e.g. "rltools submit
        (local launcher)"; RunInUse when another job still holds it after `wait_s`."""
        fd = os.open(paths.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not _flock(fd, fcntl.LOCK_EX, wait_s=wait_s):
                raise RunInUse(in_use_message(paths, _await_holder(paths)))
            previous = read_holder(paths)
            record = {"by": by, "host": socket.gethostname(), "pid": os.getpid(),
                      "since": datetime.datetime.now().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(paths, fd, previous)

    def release(self) -> None:
        if self.fd < 0:
            return
        os.ftruncate(self.fd, 0)  # a clean end: the next holder finds no record to report
        os.close(self.fd)  # closing our descriptor unlocks unless role processes still hold it
        self.fd = -1

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def is_held(paths: RunPaths) -> bool:
    """Whether a job holds the run directory's lock now (a shared probe, released at once)."""
    try:
        fd = os.open(paths.lock_file, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        free = _flock(fd, fcntl.LOCK_SH, wait_s=0.0)
    finally:
        os.close(fd)  # releases the probe
    return not free


def read_holder(paths: RunPaths) -> dict | None:
    try:
        text = paths.lock_file.read_text().strip()
        return json.loads(text) if text else None
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _await_holder(paths: RunPaths, wait_s: float = 2.0) -> dict | None:
    """The holder's record; a holder writes it just after taking the lock, so give it a moment."""
    deadline = time.monotonic() + wait_s
    while (holder := read_holder(paths)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return holder


def describe(holder: dict) -> str:
    return f"{holder.get('by', 'a job')} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')})"


def in_use_message(paths: RunPaths, holder: dict | None) -> str:
    who = describe(holder) if holder else "another process (it left no record: a job starting or ending)"
    message = (f"run directory {paths.root} is in use by {who}. A second job on it would train the same "
               f"steps twice and delete the first one's rollouts. Follow it with `rltools status {paths.root}`")
    if holder and holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
        return (message + f"; pid {holder['pid']} has ended but its role processes still hold the lock while they "
                "stop (a trainer writes its checkpoint): wait a few seconds and try again")
    if holder and "job" in str(holder.get("by", "")).lower():
        return message + f"; stop it with `rltools cancel {paths.root}`, or choose another run.dir"
    return message + "; stop it first (Ctrl-C in its terminal, or kill -INT its pid), or choose another run.dir"


def _flock(fd: int, kind: int, wait_s: float) -> bool:
    """Try to flock `fd` for up to `wait_s`; True once held. On a filesystem without locks (some
    Lustre mounts) warn and carry on: the lock is a guard, not a requirement of the job."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        except OSError as err:
            if err.errno not in _UNSUPPORTED:
                raise
            log.warning("the filesystem of the run directory does not support flock (%s): two launches on one "
                        "run directory cannot be detected there", err.strerror)
            return True


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
