"""The weight-sync channel on NCCL, where `Work.wait()` only orders streams and returns, and
`Work.wait(timeout)` blocks the thread until the work completes or times out (torch's docstring): the
sender's in-flight bound and every named deadline must still hold. A stand-in process group whose
works complete only after some polls (or never) plays NCCL; the real one runs in scripts/gpu-check.sh.
tests/unit/test_nccl_waits.py has the abandon hook and the forming of the communicator."""

import time
from datetime import timedelta

import pytest
import torch

from rltools.weight_sync.channel import WeightSender
from rltools.weight_sync.rendezvous import SyncGroup, WeightSyncError


class Work:
    """An NCCL-like work, complete after `polls` queries (None: never): `wait()` returns at once,
    `wait(timeout)` blocks until complete, or raises at the timeout."""

    def __init__(self, group: "StandInNCCL", polls: int | None):
        self.group, self.polls = group, polls

    def wait(self, timeout=timedelta(0)) -> bool:
        begin = time.monotonic()
        while timeout and not self.is_completed():
            if time.monotonic() - begin >= timeout.total_seconds():
                raise RuntimeError("stand-in work timed out in blocking wait")
            time.sleep(0.001)
        return True

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        done = self.polls < 0
        if done and self in self.group.pending:
            self.group.pending.remove(self)
        return done


class StandInNCCL:
    def __init__(self, polls: int | None = 3, stall_at: int | None = None):
        self.polls, self.stall_at = polls, stall_at
        self.pending: list[Work] = []
        self.most_pending = 0
        self.calls = 0

    def _work(self) -> Work:
        self.calls += 1
        work = Work(self, None if self.calls == self.stall_at else self.polls)
        self.pending.append(work)
        self.most_pending = max(self.most_pending, len(self.pending))
        return work

    def broadcast(self, tensor, root, timeout=None):
        return self._work()

    def allreduce(self, tensors, options):
        return self._work()


def group(pg, timeout_s: float = 5.0) -> SyncGroup:
    return SyncGroup(pg, 0, 3, "nccl", torch.device("cpu"), timedelta(seconds=timeout_s), None)


def model(tensors: int = 12, numel: int = 1 << 16) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.full((numel,), float(i)) for i in range(tensors)}


def test_the_sender_keeps_its_in_flight_bound_when_wait_does_not_block():
    """12 tensors of 256 KiB, each alone on the wire: at most max_in_flight pieces pending at once
    (without polling, all 12 were queued at once and each held its tensor)."""
    pg = StandInNCCL(polls=3)
    sender = WeightSender(group(pg), bucket_bytes=1 << 18, alone_bytes=1 << 18, max_in_flight=2)
    transfer = sender.broadcast(model(), version=1)
    assert transfer.pieces == 12
    assert pg.most_pending <= 2 + 1, pg.most_pending  # + the one just issued before the oldest is waited on


def test_a_stalled_nccl_peer_ends_in_the_named_deadline_not_a_watchdog_abort():
    pg = StandInNCCL(polls=1, stall_at=4)  # header, metadata, piece 1, then piece 2 never completes
    sender = WeightSender(group(pg, timeout_s=0.3), bucket_bytes=1 << 18, alone_bytes=1 << 18)
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as stalled:
        sender.broadcast(model(), version=1)
    elapsed = time.monotonic() - started
    message = str(stalled.value)
    assert "backend nccl" in message and "piece 2/12" in message and "timeout 0.3 s" in message, message
    assert "a peer died or stalled" in message
    assert 0.25 < elapsed < 5, elapsed
    with pytest.raises(WeightSyncError, match="unusable after an earlier failure"):
        sender.broadcast(model(), version=2)
