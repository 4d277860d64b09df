"""The first code inside a sandbox (run as `python -c`): set the limits, drop root, then run stdin.

Argument order: cpu_s memory_bytes processes uid. Soft and hard limits are set equal, so the program
cannot raise them again. uid >= 0 only when bwrap ran as root (no user namespace): the process then
becomes that unprivileged uid, because the kernel does not count processes against RLIMIT_NPROC for
root, so a fork bomb would not be contained. A warm sandbox waits here, on stdin, for its program.
This file runs in a bare interpreter: standard library only, no rltools.
"""

import os
import resource
import sys


def main() -> None:
    cpu_s, memory_bytes, processes, uid = (int(arg) for arg in sys.argv[1:5])
    # SIGXCPU at cpu_s (the default action ends the process), SIGKILL one second later if caught.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if uid >= 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    source = sys.stdin.buffer.read()
    sys.argv = ["main.py"]
    code = compile(source, "main.py", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
