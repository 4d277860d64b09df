"""What the node must provide for a sandbox: bubblewrap, and (for an ordinary user) user namespaces.

Checked once per process by starting the smallest sandbox there is; a failure is a `UserError`
that names the package to install or the sysctl to change, with bwrap's own words.
"""

import contextlib
import functools
import os
import shutil
import subprocess
from pathlib import Path

from rltools.errors import UserError

# sysctl -> (its file, the value that blocks unprivileged user namespaces, the fix)
USERNS_SYSCTLS = {
    "user.max_user_namespaces": ("/proc/sys/user/max_user_namespaces", "0",
                                 "sysctl -w user.max_user_namespaces=15000"),
    "kernel.unprivileged_userns_clone": ("/proc/sys/kernel/unprivileged_userns_clone", "0",
                                         "sysctl -w kernel.unprivileged_userns_clone=1  (Debian kernels)"),
    "kernel.apparmor_restrict_unprivileged_userns": (
        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
        "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile allowing "
        "userns for /usr/bin/bwrap  (Ubuntu 23.10+)"),
}


def is_root() -> bool:
    """Root of the host runs bwrap without a user namespace and drops to an unprivileged uid inside
    (see boot.py). Root of a container's user namespace cannot take another uid: it counts as a user."""
    try:
        host_ns = Path("/proc/self/uid_map").read_text().split() == ["0", "0", "4294967295"]
    except OSError:
        host_ns = False
    return os.geteuid() == 0 and host_ns


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise UserError("the sandbox needs bubblewrap, and `bwrap` is not on PATH: install the package "
                        "`bubblewrap` (apt-get install bubblewrap; dnf install bubblewrap)")
    return path


def read_sysctls() -> dict[str, str]:
    """The user-namespace sysctls this kernel has, by name."""
    values = {}
    for name, (path, _, _) in USERNS_SYSCTLS.items():
        with contextlib.suppress(OSError):  # a kernel without this knob (the AppArmor one is Ubuntu's)
            values[name] = Path(path).read_text().strip()
    return values


def userns_message(bwrap_stderr: str, sysctls: dict[str, str]) -> str:
    """Why bwrap could not build a sandbox, and which sysctl to change (a pure function: tested as text)."""
    lines = [f"the sandbox cannot start: bwrap failed to create its namespaces ({bwrap_stderr.strip()})",
             "an ordinary user needs unprivileged user namespaces, which this node does not allow"]
    blocking = [name for name, value in sysctls.items() if value == USERNS_SYSCTLS[name][1]]
    for name in blocking:
        lines.append(f"  {name} = {sysctls[name]}; fix (as root): {USERNS_SYSCTLS[name][2]}")
    if not blocking:
        seen = ", ".join(f"{name} = {value}" for name, value in sysctls.items()) or "none of them exist"
        lines.append(f"  the usual sysctls look open ({seen}); check seccomp or the container runtime, "
                     "which may block unshare(CLONE_NEWUSER)")
    lines.append("ask the cluster admins, or run where `bwrap --unshare-all --ro-bind / / true` works")
    return "\n".join(lines)


@functools.cache
def check_host() -> str:
    """bwrap's path, once it has shown it can create the namespaces a sandbox uses."""
    bwrap = bwrap_path()
    probe = [bwrap, *namespace_flags(), "--ro-bind", "/", "/", "true"]
    result = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        if is_root():
            raise UserError(f"the sandbox cannot start: `{' '.join(probe)}` failed as root: {result.stderr.strip()}")
        raise UserError(userns_message(result.stderr, read_sysctls()))
    return bwrap


def namespace_flags() -> list[str]:
    """Every namespace bwrap unshares; root keeps the host's user namespace (it drops its uid instead)."""
    flags = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if not is_root():
        flags += ["--unshare-user", "--disable-userns"]
    return flags
