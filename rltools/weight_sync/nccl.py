"""The weight-sync group on NCCL: what torch must be told so that our deadlines, not its watchdog,
end a stalled or failed collective, and a deadline on forming the communicator.

Invariant: every wait of forming an NCCL group has a deadline (the NCCL id goes through the sealed
store, with its timeout; ncclCommInitRank runs in a thread whose deadline the caller keeps), and
torch's own NCCL timeout lies past ours, with error handling that leaves the error on the work
(`channel._Collectives` polls it and names it) rather than ending the process.
"""

import contextlib
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .store import SealedStore, WeightSyncError

NCCL_WATCHDOG_MARGIN_S = 60.0
"""torch's own NCCL timeout is the group's collective timeout plus this: our poll checks the deadline
every few milliseconds (`channel._Collectives._poll`), so it fires first even on a host that was busy
between two checks (packing a bucket, a garbage-collector pause)."""

# What torch reads when a ProcessGroupNCCL is constructed (the getCvar* calls of its constructor,
# torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp): set around the weight-sync group's construction
# only, so the trainers' own group keeps whatever the job chose.
_NCCL_ENV = {
    # 2 = CleanUpOnly: on an NCCL error, or at torch's own timeout, the watchdog aborts the communicator
    # and leaves the error on the work, where our poll finds it and names it. The default, 3 =
    # SkipCleanUp, rethrows it in the watchdog thread (std::terminate: the whole process ends), even
    # after we gave the group up; trainer rank 0 must outlive a lost generator and re-form the group.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # 1 would make `Work.wait()` block this thread like `wait(timeout)`, and start no watchdog: our
    # poll of `is_completed()` is the wait that keeps the deadline and the abandon hook.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
}


def nccl_group(store: "SealedStore", rank: int, world_size: int, timeout: timedelta):
    """A ProcessGroupNCCL whose own timeout and error handling leave the last word to our deadline."""
    options = dist.ProcessGroupNCCL.Options()
    # torch's watchdog ends every collective of the group at this timeout (each work's opTimeout_ is
    # the group's; a per-call timeout does not reach it). Ours must fire first, so torch's is later.
    options._timeout = timeout + timedelta(seconds=NCCL_WATCHDOG_MARGIN_S)
    # A blocking communicator init, torch's own default for an eager connect since 2.7.1: `_connect`
    # keeps its deadline. A non-blocking one (TORCH_NCCL_USE_COMM_NONBLOCKING) would move the wait into
    # the first collective, bounded only by TORCH_NCCL_NONBLOCKING_TIMEOUT (30 min, process-wide),
    # inside the broadcast call itself, where no poll of ours runs.
    options.config.blocking = 1
    with _environment(_NCCL_ENV):
        return dist.ProcessGroupNCCL(store, rank, world_size, options)


def connect(pg, device: torch.device, seconds: float, what: str) -> None:
    """Form `pg`'s NCCL communicator on `device` within `seconds`, or raise a WeightSyncError.

    torch's eager connect blocks in ncclCommInitRank until every member has called it, with no
    deadline (only the exchange of the NCCL id through the store has one), and a blocking init cannot
    be aborted: the communicator is registered with the group only once it returns. So it runs in a
    daemon thread (the binding releases the GIL) while this one keeps the deadline. Past it, the
    thread is left blocked, and the caller gives the group up, kept alive and never destroyed
    (`rendezvous.SyncGroup.close`).
    """
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            pg.eager_connect_single_device(device)
            outcome.append(None)
        except BaseException as e:  # handed to the waiting thread, which names it
            outcome.append(e)

    started = time.monotonic()
    thread = threading.Thread(target=connect, name="rltools-nccl-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise WeightSyncError(f"weight-sync: {what} did not finish within {time.monotonic() - started:.1f} s "
                              "(the join deadline, SyncOptions.join_timeout_s): ncclCommInitRank waits for every "
                              "member, and one of them never called it (it died after the roster was written, or "
                              "is stuck: see its log)")
    if outcome[0] is not None:
        raise outcome[0]


def forming(rank: int, world_size: int, generation: int, members: tuple[int, ...]) -> str:
    """What `_connect` waits for, naming every member it waits on."""
    workers = f"generator worker(s) with sync rank {list(members)}" if members else \
        f"{world_size - 1} generator worker(s)"
    return (f"forming the NCCL communicator of the weight-sync group, generation {generation}, as sync rank {rank} "
            f"(members: trainer rank 0 and {workers})")


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """`values` set in os.environ for the block (torch reads them with getenv), then restored."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
