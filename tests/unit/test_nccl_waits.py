"""NCCL waits that keep their deadlines, against stand-ins that behave as torch documents them.

torch's `Work.wait` docstring (torch/_C/_distributed_c10d, and `WorkNCCL::wait` in ProcessGroupNCCL.hpp):
"calling wait() is the same as calling synchronize(): Letting the current stream block on the
completion of the NCCL work. However, if timeout is set, it will block the CPU thread until the NCCL
work is completed or timed out. If timeout, exception will be thrown." `is_completed()` never blocks.
Forming a communicator (`eager_connect_single_device`) blocks in ncclCommInitRank until every member
called it. No GPU here: the real ones run in tests/gpu/test_gpu_path.py.
"""

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rltools.weight_sync.channel import WeightSender, _Collectives
from rltools.weight_sync.receiver import WeightReceiver
from rltools.weight_sync.nccl import NCCL_WATCHDOG_MARGIN_S
from rltools.weight_sync.rendezvous import GENERATION, SyncGroup, SyncOptions, WeightSyncError, _form

STAND_IN_TIMEOUT = "stand-in WorkNCCL timed out in blocking wait"


class Work:
    """A WorkNCCL as documented: completes at `done_at` (monotonic seconds; None: never), then raises
    `error` from `wait` if it failed. `wait()` returns at once; `wait(timeout)` blocks until done."""

    def __init__(self, group: "StandInNCCL", done_at: float | None, error: str | None = None):
        self.group, self.done_at, self.error = group, done_at, error

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if timeout:  # timedelta(0) is torch's kNoTimeout: order the stream, return
            self.group.blocking_waits += 1
            begin = time.monotonic()
            while not self.is_completed():
                if time.monotonic() - begin >= timeout.total_seconds():
                    raise RuntimeError(f"{STAND_IN_TIMEOUT} after {timeout.total_seconds():g} s")
                time.sleep(0.002)
        if self.error and self.is_completed():
            raise RuntimeError(self.error)
        return True


class StandInNCCL:
    """A ProcessGroupNCCL stand-in: collective number `stall_at` (from 1) never completes, number
    `fail_at` completes 20 ms late with an NCCL error, the others complete at once."""

    def __init__(self, stall_at: int | None = None, fail_at: int | None = None):
        self.stall_at, self.fail_at = stall_at, fail_at
        self.calls = self.blocking_waits = 0
        self.aborted = False

    def _work(self) -> Work:
        self.calls += 1
        if self.calls == self.stall_at:
            return Work(self, None)
        if self.calls == self.fail_at:
            return Work(self, time.monotonic() + 0.02, "NCCL error: remote process exited or there was a network error")
        return Work(self, time.monotonic())

    def broadcast(self, tensor, root, timeout=None) -> Work:
        return self._work()

    def allreduce(self, tensors, options) -> Work:
        return self._work()

    def abort(self) -> None:
        self.aborted = True


class Generations:
    """A member's store client (`SyncGroup.control`): trainer rank 0 opens generation 1 at `at`."""

    def __init__(self, at: float):
        self.at = at

    def add(self, key: str, amount: int) -> int:
        assert key == GENERATION and amount == 0
        return 2 if time.monotonic() >= self.at else 1


def nccl_group(pg, limit_s: float, rank: int = 0, control=None) -> SyncGroup:
    return SyncGroup(pg, rank, 3, "nccl", torch.device("cpu"), timedelta(seconds=limit_s), None,
                     members=(1, 2), control=control)


def model(tensors: int = 4, numel: int = 1 << 16) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.full((numel,), float(i)) for i in range(tensors)}


def sender(pg, limit_s: float, abandon=None) -> WeightSender:
    return WeightSender(nccl_group(pg, limit_s), bucket_bytes=1 << 18, alone_bytes=1 << 18, abandon=abandon)


def test_a_stale_heartbeat_ends_a_pending_nccl_broadcast_well_before_its_limit():
    """The sender's `abandon` hook (the fleet's heartbeats) must run while a piece is pending: on a
    dead node nothing else ends it. wait(limit) would hold the thread for the whole limit."""
    pg = StandInNCCL(stall_at=3)  # header, metadata, then piece 1 never completes
    stale_from = time.monotonic() + 0.2

    def abandon() -> str | None:
        return "generator 1's heartbeat stopped 61 s ago" if time.monotonic() >= stale_from else None

    started = time.monotonic()
    with pytest.raises(WeightSyncError) as lost:
        sender(pg, limit_s=1.5, abandon=abandon).broadcast(model(), version=1)
    elapsed = time.monotonic() - started
    message = str(lost.value)
    assert "given up: generator 1's heartbeat stopped 61 s ago" in message, message
    assert "piece 1/4" in message and "backend nccl" in message, message
    assert 0.15 < elapsed < 0.75, elapsed  # the limit is 1.5 s
    assert pg.aborted  # the group is given up at once: its peers learn it from the generation counter


def test_a_receiver_gives_up_a_pending_nccl_header_when_the_group_is_re_formed():
    """A generator worker waiting for the next version leaves the collective as soon as trainer rank 0
    opens a new generation (`SyncGroup.superseded`), not at the end of its limit."""
    pg = StandInNCCL(stall_at=1)
    receiver = WeightReceiver(nccl_group(pg, limit_s=1.5, rank=1, control=Generations(time.monotonic() + 0.2)))
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"given up: trainer rank 0 re-forms the group \(generation 1\)"):
        receiver.receive(lambda pairs: None)
    assert time.monotonic() - started < 0.75
    assert not receiver.usable


def test_a_stalled_nccl_collective_ends_in_our_named_deadline_not_the_works_own():
    """Without an abandon hook the limit still ends it, through our poll: the message is ours."""
    pg = StandInNCCL(stall_at=4)  # piece 2 of 4
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as stalled:
        sender(pg, limit_s=0.3).broadcast(model(), version=1)
    elapsed = time.monotonic() - started
    message = str(stalled.value)
    assert "piece 2/4" in message and "timeout 0.3 s" in message, message
    assert "not completed by its deadline" in message and STAND_IN_TIMEOUT not in message, message
    assert 0.25 < elapsed < 1.5, elapsed


def test_the_channel_never_blocks_in_a_timed_wait_on_nccl():
    """A whole message (header, metadata, 4 pieces, acknowledgement) goes through with only untimed
    waits: ordering the stream, then polling."""
    pg = StandInNCCL()
    transfer = sender(pg, limit_s=5.0).broadcast(model(), version=1)
    assert transfer.pieces == 4 and pg.calls == 7
    assert pg.blocking_waits == 0


def test_a_failed_nccl_collective_is_an_error_not_a_completion():
    """`is_completed()` is also true for a work that failed (an NCCL error torch's watchdog found):
    the wait after the poll raises it, named."""
    pg = StandInNCCL(fail_at=3)
    with pytest.raises(WeightSyncError, match="piece 1/4.*remote process exited"):
        sender(pg, limit_s=5.0).broadcast(model(), version=1)


def test_on_nccl_a_wait_longer_than_the_groups_timeout_is_refused():
    """torch's watchdog ends every collective of the group at the group's timeout plus a margin: a
    longer wait for one collective could not be ours."""
    ops = _Collectives(nccl_group(StandInNCCL(), limit_s=5.0, rank=1))
    with pytest.raises(ValueError, match="raise SyncOptions.collective_timeout_s"):
        ops.broadcast(torch.empty(4, dtype=torch.int64), "waiting for the next weight update", timeout=10.0)


# -- forming the communicator ---------------------------------------------------------------------
class Sealed:
    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout


TORCH_READS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")


@pytest.fixture
def nccl_class(monkeypatch):
    """dist.ProcessGroupNCCL replaced by a stand-in (none on a CPU build of torch) that records what
    torch reads when constructed; its eager connect blocks, as ncclCommInitRank does while a member
    is missing, for `connect_s` seconds, or raises `connect_error`."""

    class StandInProcessGroupNCCL:
        class Options:
            def __init__(self):
                self._timeout = None
                self.config = type("NCCLConfig", (), {"blocking": -2147483648})()  # NCCL_CONFIG_UNDEF_INT

        connect_s = 0.0
        connect_error: Exception | None = None
        built: list = []

        def __init__(self, store, rank, size, options):
            self.options = options
            self.env = {name: os.environ.get(name) for name in TORCH_READS}
            self.released = threading.Event()
            self.built.append(self)

        def eager_connect_single_device(self, device) -> None:
            if self.connect_error:
                raise self.connect_error
            self.released.wait(self.connect_s)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandInProcessGroupNCCL, raising=False)
    yield StandInProcessGroupNCCL
    for pg in StandInProcessGroupNCCL.built:
        pg.released.set()  # a connect left blocked ends with the test


def form(join_s: float = 0.3, generation: int = 2) -> SyncGroup:
    options = SyncOptions(backend="nccl", join_timeout_s=join_s, collective_timeout_s=5.0)
    return _form(Sealed(), 0, 3, options, time.monotonic() + join_s, torch.device("cpu"), generation, (1, 2))


def test_forming_the_nccl_communicator_has_a_deadline_that_names_the_members(nccl_class):
    nccl_class.connect_s = 3.0  # a member never calls ncclCommInitRank (3 s stands in for ever)
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as stuck:
        form(join_s=0.3)
    elapsed = time.monotonic() - started
    message = str(stuck.value)
    assert "forming the NCCL communicator of the weight-sync group, generation 2, as sync rank 0" in message, message
    assert "trainer rank 0 and generator worker(s) with sync rank [1, 2]" in message, message
    assert "ncclCommInitRank" in message and "did not finish within 0.3 s" in message, message
    assert 0.25 < elapsed < 1.5, elapsed


def test_torchs_nccl_settings_let_our_named_error_come_first(nccl_class, monkeypatch):
    """torch's own timeout is past ours; its watchdog does not take the process down on an error
    (CleanUpOnly) and `wait()` does not block; set for this group's construction only."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the job's own choice, for its other groups
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    group = form(join_s=2.0)
    pg = group.pg
    assert group.timeout == timedelta(seconds=5.0)
    assert pg.options._timeout == group.timeout + timedelta(seconds=NCCL_WATCHDOG_MARGIN_S) > group.timeout
    assert pg.options.config.blocking == 1
    assert pg.env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0"}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ


def test_an_error_forming_the_nccl_communicator_is_named(nccl_class):
    nccl_class.connect_error = dist.DistStoreError("Timeout waiting for key: 0 after 300000 ms\nC++ frames")
    with pytest.raises(WeightSyncError, match=r"forming the group \(.*backend nccl\) failed as sync rank 0 .*"
                                              r"Timeout waiting for key: 0 after 300000 ms$"):
        form()
