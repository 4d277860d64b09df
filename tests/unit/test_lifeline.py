"""runtime.lifeline: a process chain (as vLLM's engine core and worker under a generator) dies with
the process that started it, and nothing else is touched."""

import os
import signal
import subprocess
import sys
import time

from rltools.runtime.lifeline import chain_to, children_of, die_with, proc_stat, wait_ended

# A process that starts a child that starts a grandchild; the grandchild dies with the first process
# (the generator -> engine core -> worker of vLLM). Each prints its pid.
CHAIN = """
import os, subprocess, sys, time
depth = int(sys.argv[1])
print(os.getpid(), flush=True)
if depth < 2:
    subprocess.Popen([sys.executable, "-c", sys.argv[2], str(depth + 1), sys.argv[2], sys.argv[3] or str(os.getpid())])
else:
    from rltools.runtime.lifeline import die_with
    assert die_with(int(sys.argv[3]))
    print("watching", flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"  # a zombie has exited


def test_the_processes_between_a_killed_ancestor_and_the_watcher_die_within_a_second():
    top = subprocess.Popen([sys.executable, "-c", CHAIN, "0", CHAIN, ""], stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        lines += [top.stdout.readline().strip() for _ in range(4)]
        assert lines[3] == "watching", lines
        middle, watcher = int(lines[1]), int(lines[2])
        assert alive(middle) and alive(watcher)
        time.sleep(0.5)
        assert alive(middle) and alive(watcher), "nothing happens while the ancestor lives"
        top.kill()
        top.wait()
        deadline = time.monotonic() + 5
        while (alive(middle) or alive(watcher)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(middle) and not alive(watcher)
    finally:
        top.kill()
        for pid in lines[1:3]:  # whatever a failure left behind
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def test_the_chain_runs_from_this_process_up_to_the_ancestor():
    assert chain_to(os.getpid()) == []
    assert chain_to(os.getppid()) == [os.getpid()]
    assert chain_to(2**22 + 7) is None  # not an ancestor
    assert die_with(os.getpid()) is False  # the one-process engine: nothing to watch


def test_children_are_listed_and_their_end_is_awaited():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "kids = [subprocess.Popen(['sleep', '60']) for _ in range(2)]\n"
                               "print(*[k.pid for k in kids], flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        kids = [int(pid) for pid in parent.stdout.readline().split()]
        assert sorted(children_of(parent.pid)) == sorted(kids)
        assert wait_ended(kids, timeout_s=0.1) == kids  # still running at the deadline
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
        assert wait_ended(kids, timeout_s=5) == []  # ended (zombies: their parent has not reaped them)
    finally:
        parent.kill()
        parent.wait()
    assert children_of(parent.pid) == []  # gone
