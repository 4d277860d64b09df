"""Fault injection at named points of the roles, for the `faults` test tier (tests/faults/).

`RLTOOLS_FAULT` names where and what, comma-separated: `POINT[@STEP][/RANK]=ACTION`, e.g.
`trainer.checkpoint@5=kill` (the trainer SIGKILLs itself while writing the checkpoint of step 5),
`generator.sample@3/1=kill` (only generator rank 1 dies, as it starts a slot of step 3)
or `trainer.start=signal:USR2` (it sends itself the preemption warning while starting up, as
`scancel --signal=USR2` would). Actions: `kill` (SIGKILL), `signal:NAME` (the process signals
itself; its handler runs as for a signal from outside), `sleep:SECONDS` (it pauses there, as a slow
model would). Points: `<role>.start` (before any slow
import), `generator.sample@k` (starting a slot of step k), `generator.receive@k` (in a vLLM
worker: version k's metadata received, its tensors not), `generator.eval@v` (starting the evaluation
of policy version v), `trainer.train@k`, `trainer.sync@k` (broadcasting version k),
`trainer.checkpoint@k` (the checkpoint's files written, its marker not yet).

Invariant: unset, as in every real run, a point costs one empty-dict test; each fault fires at most
once per process. Light: importable before torch.
"""

import os
import signal
import time


def _parse(spec: str, rank: str | None) -> dict[tuple[str, int | None], str]:
    """The faults planned for the task of rank `rank` (its role's RLTOOLS_RANK or SLURM_PROCID)."""
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        where, sep, action = item.partition("=")
        where, _, only = where.partition("/")
        name, _, step = where.partition("@")
        if not sep or not name or not (action == "kill" or action.startswith(("signal:", "sleep:"))):
            raise ValueError(f"RLTOOLS_FAULT item {item!r}: expected POINT[@STEP][/RANK]=kill|signal:NAME|sleep:SECONDS")
        if not only or only == rank:
            faults[(name, int(step) if step else None)] = action
    return faults


_FAULTS = _parse(os.environ.get("RLTOOLS_FAULT", ""), os.environ.get("RLTOOLS_RANK", os.environ.get("SLURM_PROCID")))


def point(name: str, step: int | None = None) -> None:
    """Run the fault planned for `name` (at `step`), if any."""
    if not _FAULTS:
        return
    action = _FAULTS.pop((name, step), None) or _FAULTS.pop((name, None), None)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action is not None and action.startswith("sleep:"):
        time.sleep(float(action.removeprefix("sleep:")))
    elif action is not None:
        os.kill(os.getpid(), getattr(signal, f"SIG{action.removeprefix('signal:')}"))
