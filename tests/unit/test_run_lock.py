"""The run directory's lock: one job at a time, its holder named, never stale."""

import json
import os
import subprocess
import sys

import pytest

from rltools.launch.run_lock import RunInUse, RunLock, is_held, read_holder
from rltools.paths import RunPaths


@pytest.fixture
def paths(tmp_path) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.create()
    return paths


def test_a_second_holder_is_refused_with_the_first_named(paths):
    with RunLock.acquire(paths, by="rltools submit (local launcher)"):
        assert is_held(paths)
        with pytest.raises(RunInUse, match=rf"in use by rltools submit \(local launcher\) \(pid {os.getpid()} on "):
            RunLock.acquire(paths, by="rltools resume (local launcher)", wait_s=0)
    assert not is_held(paths)
    assert read_holder(paths) is None  # a clean release leaves no record to report
    RunLock.acquire(paths, by="again").release()


def test_probing_does_not_hold_the_lock(paths):
    assert not is_held(paths)  # no lock file yet
    RunLock.acquire(paths, by="first").release()
    assert not is_held(paths) and not is_held(paths)
    RunLock.acquire(paths, by="second").release()


def test_the_lock_of_a_killed_holder_is_taken_over_and_reported(paths):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom rltools.launch.run_lock import RunLock\nfrom rltools.paths import RunPaths\n"
         f"RunLock.acquire(RunPaths({str(paths.root)!r}), by='a launcher')\nprint('held', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunInUse, match=f"pid {holder.pid}"):
        RunLock.acquire(paths, by="second", wait_s=0)
    holder.kill()  # SIGKILL: no release, the record stays behind
    holder.wait()
    lock = RunLock.acquire(paths, by="after the crash")
    assert lock.previous["pid"] == holder.pid and lock.previous["by"] == "a launcher"
    assert json.loads(paths.lock_file.read_text())["by"] == "after the crash"
    lock.release()


def test_processes_that_inherit_the_lock_keep_it_after_their_parent_lets_go(paths):
    """The local launcher's roles inherit its locked descriptor: a killed launcher whose trainer is
    still writing its checkpoint keeps the run locked until the trainer has gone too."""
    lock = RunLock.acquire(paths, by="launcher")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             pass_fds=(lock.fd,))
    os.close(lock.fd)  # the launcher is gone (without emptying the record, as after kill -9)
    lock.fd = -1
    try:
        assert is_held(paths)
        with pytest.raises(RunInUse, match="in use by launcher"):
            RunLock.acquire(paths, by="resume", wait_s=0)
    finally:
        child.communicate(b"")
    RunLock.acquire(paths, by="resume").release()


def test_the_launcher_keeps_a_signal_it_was_started_ignoring_ignored():
    """`nohup rltools submit ...` must survive the terminal closing (SIGHUP), while SIGTERM still stops it."""
    import signal

    from rltools.launch.local import _terminate, trap_stop_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it
    try:
        previous = trap_stop_signals()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == _terminate
        assert list(previous) == [signal.SIGTERM]
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
