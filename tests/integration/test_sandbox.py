"""The sandbox under real bubblewrap: each limit holds against the program it exists for.

Without bwrap these tests skip for an ordinary user and fail for root, since scripts/setup.sh
installs bubblewrap when run as root (as CI does).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rltools.errors import UserError
from rltools.sandbox import Limits, Sandbox, SandboxPool, run_code
from rltools.sandbox.host import check_host, userns_message

BOMB = """
import ctypes, os
ctypes.CDLL(None).prctl(15, b"rltools-bomb", 0, 0, 0)  # PR_SET_NAME: every fork is findable in /proc
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
FORKS = """
import os, time
forked = 0
for _ in range(100):
    try:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
    except OSError:
        break
    forked += 1
print(forked)
"""


@pytest.fixture(scope="module", autouse=True)
def bwrap():
    try:
        return check_host()
    except UserError as err:
        if os.geteuid() == 0:
            pytest.fail(f"root runs scripts/setup.sh, which installs bubblewrap, so this is a failure: {err}")
        pytest.skip(str(err))


def test_runs_a_program_and_reports_how_it_ended(repo, tmp_path):
    result = run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
    assert not result.timed_out and not result.truncated
    program = tmp_path / "hello.py"
    program.write_text("print(6 * 7)")
    cli = subprocess.run([sys.executable, "-m", "rltools.sandbox", str(program)], cwd=repo,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    line, = cli.stdout.splitlines()
    assert json.loads(line) | {"wall_s": 0} == {"stdout": "42\n", "stderr": "", "exit_code": 0,
                                                 "timed_out": False, "truncated": False, "wall_s": 0}


def test_an_interpreter_installed_under_tmp_runs_though_tmp_is_the_sandboxs_own(tmp_path):
    """A venv in a clone under /tmp (as CI's may be): the sandbox's private /tmp must not hide it."""
    assert str(tmp_path).startswith("/tmp/"), "pytest's tmp_path lies under /tmp here"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=60)
    result = run_code("import sys; print(sys.prefix)", python=str(tmp_path / "venv" / "bin" / "python"))
    assert (result.stdout, result.exit_code) == (f"{tmp_path / 'venv'}\n", 0), result


def test_no_network():
    with socket.socket() as server:  # a server on the host's loopback: the sandbox has its own
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        program = f"""
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=2)
        print("connected", address)
    except OSError as err:
        print("failed", address, err.errno)
print(socket.if_nameindex())
"""
        result = run_code(program)
    assert result.stdout.splitlines() == [f"failed ('127.0.0.1', {port}) 111",  # refused
                                          "failed ('1.1.1.1', 53) 101",  # unreachable
                                          "[(1, 'lo')]"], result


def test_writes_outside_the_work_dir_fail(repo, tmp_path):
    targets = [tmp_path / "escaped", repo / "escaped", Path.home() / "escaped", Path("/usr/escaped"),
               Path(sys.prefix) / "escaped", Path("/escaped"), Path("/dev/shm/escaped")]
    program = f"""
for path in {[str(t) for t in targets]!r} + ["/tmp/inside"]:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as err:
        print("failed", path, type(err).__name__)
"""
    result = run_code(program)
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["failed"] * len(targets) + ["wrote"], result
    assert not any(t.exists() for t in targets) and not Path("/tmp/inside").exists()


def test_a_fork_bomb_is_contained():
    limits = Limits(processes=32, timeout_s=2.0)
    counts, result = [], []
    thread = threading.Thread(target=lambda: result.append(run_code(BOMB, limits)))
    thread.start()
    while thread.is_alive():
        counts.append(len(_bomb_processes()))
        time.sleep(0.02)
    thread.join()
    assert result[0].timed_out and result[0].wall_s < 4, result
    assert 10 < max(counts) <= limits.processes, counts  # it did fork, and only up to the limit
    # run_code returns once the sandbox is empty: no grace period (a slow CI host had all 32 left 0.2 s on)
    assert _bomb_processes() == [], "bomb processes outlived the sandbox"


def _bomb_processes() -> list[int]:
    pids = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "rltools-bomb":
                pids.append(int(comm.parent.name))
        except OSError:
            pass  # ended while we looked
    return pids


def test_the_process_limit_is_what_stops_forks():
    assert int(run_code(FORKS, Limits(processes=16)).stdout) < 16
    assert int(run_code(FORKS, Limits(processes=128)).stdout) == 100


def test_a_memory_hog_is_contained():
    hog = run_code("b = bytearray(4 << 30)\nprint('allocated')")
    assert hog.exit_code == 1 and "MemoryError" in hog.stderr and hog.stdout == "", hog
    program = "b = bytearray(300 << 20)\nprint('allocated')"
    assert run_code(program, Limits(memory_mb=200)).exit_code == 1
    assert run_code(program, Limits(memory_mb=1024)).stdout == "allocated\n"


@pytest.mark.parametrize("program", ["while True: pass", "import time\ntime.sleep(60)"])
def test_an_endless_program_is_killed_at_the_wall_clock(program):
    result = run_code(program, Limits(timeout_s=1.0))
    assert result.timed_out and result.exit_code == -9 and 1.0 <= result.wall_s < 3.0, result


def test_an_endless_loop_is_killed_at_the_cpu_limit():
    result = run_code("print('start')\nwhile True: pass", Limits(cpu_s=1, timeout_s=30.0))
    assert result.timed_out and result.exit_code == 128 + 24 and result.wall_s < 10, result  # SIGXCPU
    assert result.stdout == "start\n"


def test_a_100_mb_print_is_truncated():
    limits = Limits(output_bytes=1 << 20)
    result = run_code("print('x' * (100 << 20))", limits)
    assert result.truncated and not result.timed_out and result.exit_code == -9, result.exit_code
    assert result.stdout == "x" * limits.output_bytes and result.wall_s < 5


def test_the_pool_hands_out_each_sandbox_once():
    program = """
import os
print(os.path.exists("/tmp/mark"))
open("/tmp/mark", "w")
"""
    with SandboxPool(size=2) as pool:
        results = [pool.run(program) for _ in range(5)]
        warm = list(pool._warm)
        assert len(warm) == 2 and all(s.alive() and not s.used for s in warm)
    assert [r.stdout for r in results] == ["False\n"] * 5  # no sandbox saw another's file
    assert not any(s.alive() for s in warm)  # close() killed the warm ones
    sandbox = Sandbox()
    sandbox.run("pass")
    with pytest.raises(RuntimeError, match="one program only"):
        sandbox.run("pass")


def test_bench_prints_cold_and_warm_latency():
    from rltools.sandbox.__main__ import bench

    summary = bench(Limits(), sys.executable, calls=3)
    print(summary)  # pytest -s shows it; `python -m rltools.sandbox --bench` prints the same
    assert summary["warm_median_ms"] > 0 and summary["cold_median_ms"] > 0


def test_an_ordinary_user_gets_the_process_limit_from_its_user_namespace(repo):
    """As a compute-node user: bwrap makes a user namespace, and RLIMIT_NPROC counts inside it."""
    if os.geteuid() != 0 or not shutil.which("setpriv") or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root, setpriv and /usr/bin/python3 (the venv's python may not be readable by nobody)")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "env", "-i",
                 f"PYTHONPATH={repo}", "/usr/bin/python3", "-m", "rltools.sandbox", "--python", "/usr/bin/python3"]
    def run(program: str, processes: int) -> str:
        cli = subprocess.run(as_nobody + ["--processes", str(processes), "-"], cwd="/", input=program,
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        return json.loads(cli.stdout)["stdout"]

    assert int(run(FORKS, 16)) < 16 and int(run(FORKS, 128)) == 100
    writes = """
for path in ["/escaped", "/dev/escaped", "/usr/escaped", "/tmp/inside"]:
    try:
        open(path, "w")
        print("wrote", path)
    except OSError as err:
        print("failed", path)
"""
    assert run(writes, 32).split() == ["failed", "/escaped", "failed", "/dev/escaped", "failed", "/usr/escaped",
                                       "wrote", "/tmp/inside"]


def test_without_user_namespaces_the_error_names_the_sysctl(repo, tmp_path):
    program = tmp_path / "hello.py"
    program.write_text("print(1)")
    # A user namespace of our own in which no further one may be made: the node a user would meet.
    no_userns = ["unshare", "--user", "--map-root-user", "sh", "-c",
                 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh"]
    cli = subprocess.run(no_userns + [sys.executable, "-m", "rltools.sandbox", str(program)], cwd=repo,
                         capture_output=True, text=True, timeout=60)
    if "unshare" in cli.stderr and cli.returncode != 2:
        pytest.skip(f"cannot make a user namespace here: {cli.stderr.strip()}")
    assert cli.returncode == 2 and cli.stdout == "", cli.stderr
    assert "user.max_user_namespaces = 0; fix (as root): sysctl -w user.max_user_namespaces=" in cli.stderr


def test_the_userns_message_names_each_blocking_sysctl():
    text = userns_message("bwrap: setting up uid map: Permission denied",
                          {"user.max_user_namespaces": "15000", "kernel.apparmor_restrict_unprivileged_userns": "1",
                           "kernel.unprivileged_userns_clone": "0"})
    assert "setting up uid map: Permission denied" in text
    assert "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0" in text
    assert "sysctl -w kernel.unprivileged_userns_clone=1" in text
    assert "max_user_namespaces" not in text
