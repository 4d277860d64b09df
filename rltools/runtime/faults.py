"""Fault injection at named points of the roles, for the `faults` test tier (tests/faults/).

`RLTOOLS_FAULT` names where and what, comma-separated: `POINT[@STEP]=ACTION`, e.g.
`trainer.checkpoint@5=kill` (the trainer SIGKILLs itself while writing the checkpoint of step 5)
or `trainer.start=signal:USR2` (it sends itself the preemption warning while starting up, as
`scancel --signal=USR2` would). Actions: `kill` (SIGKILL), `signal:NAME` (the process signals
itself; its handler runs as for a signal from outside). Points: `<role>.start` (before any slow
import), `generator.sample@k`, `trainer.train@k`, `trainer.sync@k` (broadcasting version k),
`trainer.checkpoint@k` (the checkpoint's files written, its marker not yet).

Invariant: unset, as in every real run, a point costs one empty-dict test; each fault fires at most
once per process. Light: importable before torch.
"""

import os
import signal


def _parse(spec: str) -> dict[tuple[str, int | None], str]:
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        where, sep, action = item.partition("=")
        name, _, step = where.partition("@")
        if not sep or not name or not (action == "kill" or action.startswith("signal:")):
            raise ValueError(f"RLTOOLS_FAULT item {item!r}: expected POINT[@STEP]=kill|signal:NAME")
        faults[(name, int(step) if step else None)] = action
    return faults


_FAULTS = _parse(os.environ.get("RLTOOLS_FAULT", ""))


def point(name: str, step: int | None = None) -> None:
    """Run the fault planned for `name` (at `step`), if any."""
    if not _FAULTS:
        return
    action = _FAULTS.pop((name, step), None) or _FAULTS.pop((name, None), None)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action is not None:
        os.kill(os.getpid(), getattr(signal, f"SIG{action.removeprefix('signal:')}"))
