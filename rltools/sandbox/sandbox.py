"""One sandbox: a bubblewrap container with a Python interpreter that runs one program, then is gone.

Invariants: a `Sandbox` runs at most one program (a second `run` is a programmer error), so nothing a
program leaves behind (files, processes, imported modules) reaches the next one; every run ends by
the wall-clock deadline, and ending it kills every process inside (bwrap is PID 1 of the sandbox's
PID namespace, and dies with its parent); `kill` returns only once they are all gone.
"""

import contextlib
import functools
import logging
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rltools.runtime.lifeline import children_of, wait_ended

from .host import check_host, is_root, namespace_flags

log = logging.getLogger("rltools.sandbox")

BOOT = (Path(__file__).with_name("boot.py")).read_text()
# The read-only system: enough of /usr and /etc for an interpreter, nothing of /home, /root or /work.
SYSTEM_DIRS = ("/usr", "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
               "/etc/localtime", "/etc/ssl")
MERGED_USR = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
WORK_DIR = "/tmp"
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "TMPDIR": WORK_DIR, "LANG": "C.UTF-8",
       "OMP_NUM_THREADS": "1"}
# Root drops to a uid of its own per sandbox, so RLIMIT_NPROC counts only that sandbox's processes.
SANDBOX_UIDS = (1_000_000_000, 2_000_000_000)


@dataclass(frozen=True)
class Limits:
    """What one program may use; the defaults suit a reward function or a short tool call."""

    timeout_s: float = 10.0
    """Wall clock from handing over the program to its end; then every process inside is killed."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU ends it (timed out); SIGKILL a second later if caught."""
    memory_mb: int = 1024
    """Address space per process (RLIMIT_AS): allocations beyond it fail (Python: MemoryError)."""
    processes: int = 32
    """Processes and threads inside the sandbox (RLIMIT_NPROC): fork beyond it fails with EAGAIN."""
    output_bytes: int = 1 << 20
    """Bytes kept from each of stdout and stderr; a program printing more is killed, `truncated` set."""
    disk_mb: int = 64
    """Size of the writable work dir /tmp (a private tmpfs; it counts toward the node's memory)."""


@dataclass
class Result:
    """What a program did: its output (decoded as UTF-8, bad bytes replaced) and how it ended."""

    stdout: str
    stderr: str
    exit_code: int
    """The program's exit code; 128+N when signal N ended it; -9 when the sandbox killed it (timeout, output)."""
    timed_out: bool
    """The wall clock or the CPU limit ended it."""
    truncated: bool
    """stdout or stderr went past Limits.output_bytes: the program was killed and the output cut there."""
    wall_s: float
    """From handing over the program to its end."""

    def to_json(self) -> dict:
        return asdict(self)


@functools.cache
def python_roots(python: str) -> tuple[str, ...]:
    """The directories an interpreter needs besides /usr: its venv and its installation."""
    query = "import sys; print(sys.prefix); print(sys.base_prefix)"
    out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, check=True).stdout
    roots = {os.path.realpath(p) for p in out.split()} | {os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    return tuple(sorted(r for r in roots if not r.startswith("/usr/") and r != "/usr"))


def bwrap_argv(bwrap: str, python: str, limits: Limits, uid: int) -> list[str]:
    """The whole sandbox command line: namespaces, mounts, environment, then the boot interpreter."""
    argv = [bwrap, *namespace_flags(), "--die-with-parent", "--new-session", "--clearenv"]
    # The work dir's tmpfs comes first: an interpreter installed under /tmp (a venv in a clone there)
    # is then bound on top of it, not hidden by it.
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_mb << 20), "--perms", "1777",
             "--tmpfs", WORK_DIR]
    binds = SYSTEM_DIRS + python_roots(python)
    # A parent bwrap creates is not enterable by the sandbox's uid (/root, and even /etc, came out 0700).
    for parent in sorted({str(parent) for path in binds for parent in Path(path).parents} - {"/", WORK_DIR}):
        argv += ["--perms", "0755", "--dir", parent]
    for path in binds:
        argv += ["--ro-bind-try", path, path]
    for path in MERGED_USR:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        else:
            argv += ["--ro-bind-try", path, path]
    for name, value in ENV.items():
        argv += ["--setenv", name, value]
    # /dev is a tmpfs the user owns (in its user namespace), of no set size: read-only, like /, so
    # /tmp is the one place to write (its device files, /dev/null and the like, stay writable).
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR]
    boot_args = [str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.processes), str(uid)]
    return argv + [python, "-I", "-B", "-u", "-c", BOOT, *boot_args]


class Sandbox:
    """A started sandbox whose interpreter waits for one program on stdin."""

    def __init__(self, limits: Limits = Limits(), python: str = sys.executable):
        self.limits = limits
        uid = SANDBOX_UIDS[0] + secrets.randbelow(SANDBOX_UIDS[1] - SANDBOX_UIDS[0]) if is_root() else -1
        argv = bwrap_argv(check_host(), python, limits, uid)
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
        self.used = False

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, source: str) -> Result:
        """Hand the program over, collect its output until it ends or a limit ends it."""
        if self.used:
            raise RuntimeError("a sandbox runs one program only; take a fresh one")
        self.used = True
        start = time.monotonic()
        out, err, killed = self._communicate(source.encode(), start + self.limits.timeout_s)
        exit_code = self.process.wait()
        wall_s = time.monotonic() - start
        cap = self.limits.output_bytes
        cpu_hit = exit_code == 128 + signal.SIGXCPU  # bwrap exits with 128+N when signal N ended the program
        return Result(stdout=out[:cap].decode(errors="replace"), stderr=err[:cap].decode(errors="replace"),
                      exit_code=exit_code, timed_out=killed == "timeout" or cpu_hit, truncated=killed == "output",
                      wall_s=round(wall_s, 4))

    def kill(self) -> None:
        """End the sandbox and everything in it (idempotent); returns once no process of it is left."""
        # The inner bwrap is PID 1 of the sandbox: the kernel kills every process of its namespace
        # when it dies, and it exits only after they are all gone. Killed with the outer bwrap it goes
        # anyway (--die-with-parent), but later: a slow host still had 32 processes 0.2 s on.
        inner = children_of(self.process.pid) if self.alive() else []
        for pid in inner:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.kill()
        self.process.wait(timeout=10)  # SIGKILL cannot be caught: this is the reaping, not a real wait
        if running := wait_ended(inner, timeout_s=10):
            log.warning("sandbox process(es) %s still running 10 s after being killed", running)
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe and not pipe.closed:
                pipe.close()

    def _communicate(self, source: bytes, deadline: float) -> tuple[bytes, bytes, str | None]:
        """(stdout, stderr, why the sandbox was killed: None, "timeout" or "output")."""
        proc, cap = self.process, self.limits.output_bytes
        chunks = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        with selectors.DefaultSelector() as selector:
            for pipe in chunks:
                selector.register(pipe, selectors.EVENT_READ)
            if source:
                selector.register(proc.stdin, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.kill()
                    return bytes(chunks[proc.stdout]), bytes(chunks[proc.stderr]), "timeout"
                for key, _ in selector.select(remaining):
                    if key.fileobj is proc.stdin:
                        source = self._feed(selector, source)
                        continue
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        selector.unregister(key.fileobj)
                        continue
                    chunks[key.fileobj] += data
                    if len(chunks[key.fileobj]) > cap:
                        self.kill()
                        return bytes(chunks[proc.stdout]), bytes(chunks[proc.stderr]), "output"
        return bytes(chunks[proc.stdout]), bytes(chunks[proc.stderr]), None

    def _feed(self, selector: selectors.BaseSelector, source: bytes) -> bytes:
        """Write what stdin takes without blocking; close it once the program is handed over."""
        stdin = self.process.stdin
        try:
            source = source[os.write(stdin.fileno(), source[:1 << 16]):]
        except BrokenPipeError:
            source = b""  # the interpreter is gone; its exit status tells why
        if not source:
            selector.unregister(stdin)
            stdin.close()
        return source


def run_code(source: str, limits: Limits = Limits(), python: str = sys.executable) -> Result:
    """Run one Python program in a fresh sandbox (cold: pays bwrap's and the interpreter's start-up)."""
    sandbox = Sandbox(limits, python)
    try:
        return sandbox.run(source)
    finally:
        sandbox.kill()
