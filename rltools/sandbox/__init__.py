"""A sandbox for untrusted code (reward functions, code-execution tools): bubblewrap, no network,
a read-only system, a private writable /tmp, and limits on CPU, memory, processes, output and time.

Invariant: a program runs in a sandbox of its own that is killed when it ends, with everything it
started; a limit it hits shows in its `Result`, never as an exception in the caller. What the node
must provide (bubblewrap, user namespaces) is checked on first use and named in a `UserError`.
See docs/sandbox.md.
"""

from .pool import SandboxPool
from .sandbox import Limits, Result, Sandbox, run_code

__all__ = ["Limits", "Result", "Sandbox", "SandboxPool", "run_code"]
