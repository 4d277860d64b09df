"""Weight-sync channel: trainer rank 0 broadcasts named tensors to every generator worker.

Invariant: a message is either delivered whole to every receiver's consumer, in increasing policy
version order, or the failure is reported on every side that is still alive. A receiver refuses a
version that is not newer than the last one it applied; the sender returns only after every receiver
acknowledged (applied, refused or failed). Every collective has a deadline, and an expired one names
the group, the operation, the elapsed time and the timeout. A collective is given up early when the
`abandon` hook has a reason (a peer's heartbeat stopped, the group was re-formed). On NCCL both are
kept by polling `Work.is_completed()`: torch's `Work.wait(timeout)` blocks the thread until the
collective completes or times out, deaf to either, and torch's own NCCL timeout is set past ours
(`weight_sync.nccl`), so the error a stalled or lost peer ends in is this one, named.

One message on the wire (header and ack are int64, everything else uint8):
  1. header    int64[4]: MAGIC, policy version, metadata length, piece count
  2. metadata  JSON: kind (the weight format's name, `weight_formats`), tensors [[name, dtype, shape]], pieces [[nbytes, [[tensor, offset]]]]
  3. pieces    a tensor of at least `alone_bytes` travels alone, zero-copy (its bytes viewed as uint8);
               smaller ones are packed 64-byte aligned into buckets of at most `bucket_bytes` (the
               sender's only copy). The sender packs bucket k+1 while piece k is on the wire.
  4. ack       all-reduce of int64[W, 2]: (status, last applied version) per sync rank
  5. probe     all-reduce of float64[W]: each receiver's logprob gap to the trainer under the version
               it just applied (`runtime.probe`), measured by its engine after the ack

Memory: a receiver holds two piece buffers (each max(bucket, largest tensor)), reused across
messages, and never the whole model; the consumer pulls views into them, each valid until it asks for
the next piece — it must copy what it keeps (e.g. into vLLM's parameters), and what it does before the
block ends (writing an adapter, say) happens before the acknowledgement. The sender holds every
tensor of a message when it is given a plain list or iterator (the metadata goes first); given a
`TensorStream` (the specs known before the tensors), it takes each tensor only when its piece is
due, so it holds at most the open bucket, the piece being packed and those in flight.
"""

import json
import time
from collections import deque
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple

import torch
import torch.distributed as dist

from .admission import _first_line
from .rendezvous import SyncGroup, WeightSyncError

MAGIC = 0x524C5753  # "RLWS": a peer speaking something else fails loudly, not with garbage tensors
ALIGN = 64  # a packed tensor starts 64-byte aligned, so a view of any dtype is valid
OK, STALE, FAILED = 0, 1, 2
MiB = 1 << 20
ABANDON_POLL_S = 0.1

Consumer = Callable[[list[tuple[str, torch.Tensor]]], None]


class TensorStream:
    """Named tensors produced on demand, with their (name, dtype, shape) known up front: what lets
    `WeightSender.broadcast` stream a model it never holds whole. Iterating it yields the tensors
    (once), in the order of `specs`."""

    def __init__(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 tensors: Iterable[tuple[str, torch.Tensor]]):
        self.specs, self._tensors = specs, tensors

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._tensors)


class StaleVersionError(WeightSyncError):
    """A policy version that is not newer than the last one applied was refused."""


class Transfer(NamedTuple):
    version: int
    kind: str
    tensors: int
    nbytes: int
    pieces: int
    waited_s: float = 0.0
    """Sender: seconds until every receiver took the header (busy receivers, e.g. evaluating)."""


class _Pending(NamedTuple):
    work: object | None  # None: a zero-byte piece, nothing on the wire
    what: str
    started: float
    limit: timedelta
    data: torch.Tensor  # the wire buffer, kept alive until `work` completes


class _Plan(NamedTuple):
    tensors: list  # [name, dtype name, shape] per tensor, in the caller's order
    pieces: list  # [nbytes, [[tensor index, byte offset], ...]] in wire order


def plan_pieces(specs: list[tuple[str, torch.dtype, tuple, int]], bucket_bytes: int, alone_bytes: int) -> _Plan:
    """Cut (name, dtype, shape, nbytes) into pieces: big tensors alone, small ones packed in buckets.

    A bucket is closed (and gets its wire position) when the next small tensor does not fit, so big
    tensors met meanwhile go first: receivers see pieces in wire order, not in the caller's order.
    """
    tensors, pieces, bucket, fill = [], [], [], 0
    for index, (name, dtype, shape, nbytes) in enumerate(specs):
        tensors.append([name, str(dtype).removeprefix("torch."), list(shape)])
        if nbytes >= alone_bytes:
            pieces.append([nbytes, [[index, 0]]])
            continue
        offset = -(-fill // ALIGN) * ALIGN
        if bucket and offset + nbytes > bucket_bytes:
            pieces.append([fill, bucket])
            bucket, offset = [], 0
        bucket.append([index, offset])
        fill = offset + nbytes
    if bucket:
        pieces.append([fill, bucket])
    return _Plan(tensors, pieces)


class _Collectives:
    """Issues and waits on the group's collectives; turns every failure into a named WeightSyncError.

    After a timeout or a dead peer the group is unusable (a collective may still be pending in the
    backend), so every later call fails at once with the first error.
    """

    def __init__(self, group: SyncGroup, abandon: Callable[[], str | None] | None = None):
        self.group = group
        self.broken: WeightSyncError | None = None
        self.abandon = abandon
        """Asked every ABANDON_POLL_S while a collective is pending: a reason to give it up now (a
        peer whose heartbeat stopped: on a dead node a send would otherwise wait out its timeout)."""

    def check_usable(self) -> None:
        if self.broken:
            raise WeightSyncError(f"{self.group.describe()} is unusable after an earlier failure "
                                  f"(re-form the group or restart the job): {self.broken}")

    def broadcast(self, tensor: torch.Tensor, what: str, timeout: float | None = None) -> _Pending:
        """Start a broadcast from sync rank 0 (`timeout` overrides the group's for this one)."""
        limit = self.group.timeout if timeout is None else timedelta(seconds=timeout)
        if self.group.backend == "nccl" and limit > self.group.timeout:
            raise ValueError(f"{self.group.describe()}: {what} may not wait {limit.total_seconds():g} s, longer than "
                             f"the group's collective timeout ({self.group.timeout.total_seconds():g} s), past which "
                             "torch's own NCCL watchdog ends it: raise SyncOptions.collective_timeout_s instead")
        started = time.monotonic()
        if tensor.numel() == 0:
            return _Pending(None, what, started, limit, tensor)
        try:
            work = self.group.pg.broadcast(tensor, 0, timeout=limit)
        except RuntimeError as e:
            self._fail(e, what, started, limit)
        return _Pending(work, what, started, limit, tensor)

    def gather(self, value: float, what: str) -> list[float]:
        """Every rank's `value` (float64); a collective of the whole group."""
        return self._table(torch.tensor(value, dtype=torch.float64), what)

    def acknowledge(self, status: int, last_version: int | None, what: str) -> list[list[int]]:
        """Every rank's (status, last applied version); the sender contributes (OK, -1)."""
        return self._table(torch.tensor([status, -1 if last_version is None else last_version]), what)

    def _table(self, row: torch.Tensor, what: str) -> list:
        """All-reduce of a [world, *row.shape] table in which each rank fills its own row."""
        table = torch.zeros(self.group.world_size, *row.shape, dtype=row.dtype, device=self.group.device)
        table[self.group.rank] = row
        options = dist.AllreduceOptions()
        options.timeout = limit = self.group.timeout
        started = time.monotonic()
        try:
            work = self.group.pg.allreduce([table], options)
        except RuntimeError as e:
            self._fail(e, what, started, limit)
        self.wait(_Pending(work, what, started, limit, table))
        return table.tolist()

    def wait(self, pending: _Pending) -> None:
        """Return once `pending` completed: the sender's in-flight bound and every deadline rest on it."""
        if pending.work is None:
            return
        try:
            if self.group.backend == "nccl":
                self._wait_nccl(pending)
            elif self.abandon is None:
                pending.work.wait(pending.limit)  # gloo enforces the limit too; this bounds our own wait
            else:
                self._poll(pending, self.abandon)
                pending.work.wait(pending.limit)  # completed: returns at once, or raises its error
        except RuntimeError as e:
            self._fail(e, pending.what, pending.started, pending.limit)

    def _wait_nccl(self, pending: _Pending) -> None:
        """`wait()` without a timeout only orders the current stream after the collective and returns;
        with one it would block this thread until the collective ends (torch's `WorkNCCL::wait`),
        deaf to our deadline and to `abandon`. So: order the stream, poll, then `wait()` once more,
        which returns at once or raises the error of a collective that ended by failing (an NCCL
        error, a communicator aborted by torch's watchdog)."""
        pending.work.wait()
        self._poll(pending, self.abandon)
        pending.work.wait()

    @staticmethod
    def _poll(pending: _Pending, abandon: Callable[[], str | None] | None = None) -> None:
        """Poll the work's completion (`is_completed()`, which never blocks: a CUDA event query on NCCL)
        against the deadline and `abandon`, asked every ABANDON_POLL_S. On NCCL this is the only wait
        that can keep them: `Work.wait(timeout)` blocks the CPU thread until the collective completes
        or times out, so a stale heartbeat could not end it, and torch's own timeout (set past ours)
        would end it in the watchdog rather than in our named error. It also keeps the sender from
        running ahead of the wire, holding every tensor it queued."""
        deadline = pending.started + pending.limit.total_seconds()
        began = asked = time.monotonic()
        pause = 20e-6
        while not pending.work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError("not completed by its deadline (work still pending)")
            if abandon is not None and now - asked >= ABANDON_POLL_S:
                asked = now
                if reason := abandon():
                    raise RuntimeError(f"given up: {reason}")
            time.sleep(pause)
            # fine-grained while a piece is on the wire; a long wait (the trainer training) polls gently
            pause = min(2 * pause, 1e-3 if now - began < ABANDON_POLL_S else 10e-3)

    def _fail(self, error: Exception, what: str, started: float, limit: timedelta) -> None:
        self.group.close()  # its pending collective must never be destroyed with it (SyncGroup.close)
        self.broken = WeightSyncError(
            f"{self.group.describe()}: {what} failed after {time.monotonic() - started:.1f} s "
            f"(timeout {limit.total_seconds():g} s): {_first_line(error)} — a peer died or stalled (see its log); "
            "this group cannot be used again")
        raise self.broken from error


def _nbytes(dtype: torch.dtype, shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def _in_order(tensors: Iterator[tuple[str, torch.Tensor]], specs: list) -> Callable[[int], torch.Tensor]:
    """`take(i)`: tensor i of a stream, checked against its spec. Pieces ask for tensors slightly out
    of order (a big tensor may go before the open bucket of earlier small ones): those are held
    until taken. `take(len(specs))` checks that the stream ends there."""
    held: dict[int, torch.Tensor] = {}
    produced = 0

    def take(index: int) -> torch.Tensor:
        nonlocal produced
        while produced <= index:
            item = next(tensors, None)
            if produced == len(specs):
                if item is not None:
                    raise ValueError(f"weight-sync: the stream yields {item[0]!r} after the {len(specs)} tensors "
                                     "its specs announce")
                return None
            if item is None:
                raise ValueError(f"weight-sync: the stream ended after {produced} of the {len(specs)} tensors its "
                                 f"specs announce (next: {specs[produced][0]!r})")
            name, tensor = item
            expected = specs[produced]
            if (name, tensor.dtype, tuple(tensor.shape)) != expected[:3]:
                raise ValueError(f"weight-sync: stream tensor {produced} is {name!r} {tensor.dtype} "
                                 f"{tuple(tensor.shape)}, its spec says {expected[0]!r} {expected[1]} {expected[2]}")
            held[produced] = tensor
            produced += 1
        return held.pop(index)

    return take


def _wire_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view: no copy when it is contiguous and on `device`."""
    tensor = tensor.detach().to(device).contiguous()
    return tensor.reshape(-1).view(torch.uint8)


class WeightSender:
    """Trainer rank 0's end: `broadcast` one policy version at a time, in increasing order."""

    # Defaults measured on loopback gloo (2 cores): one more piece costs ~0.3-0.5 ms (a worker-thread
    # hand-off and a receive-ready round trip per receiver), packing costs ~0.1 ms per MB (memcpy at
    # 10-20 GB/s), so tensors up to a few MB are cheaper packed; 16 MiB buckets keep the pipeline fine
    # grained. On GPUs packing is nearly free and per-call cost dominates even more.
    def __init__(self, group: SyncGroup, *, bucket_bytes: int = 16 * MiB, alone_bytes: int = 4 * MiB,
                 max_in_flight: int = 2, abandon: Callable[[], str | None] | None = None):
        if group.rank != 0:
            raise ValueError(f"WeightSender runs on sync rank 0 (trainer rank 0), not sync rank {group.rank}")
        if not 0 < alone_bytes <= bucket_bytes:
            raise ValueError(f"alone_bytes ({alone_bytes}) must be in 1..bucket_bytes ({bucket_bytes})")
        self.group, self.bucket_bytes, self.alone_bytes = group, bucket_bytes, alone_bytes
        self.max_in_flight = max(1, max_in_flight)
        self.last_version: int | None = None
        self._ops = _Collectives(group, abandon)
        self._pack_buffers: list[torch.Tensor] = []  # reused across messages: no page faults after the first

    def regroup(self, group: SyncGroup) -> None:
        """Go on with a new generation of the group (after a loss or a join): the versions sent so
        far stay sent; the one that failed may be sent again."""
        self.group = group
        self._ops = _Collectives(group, self._ops.abandon)

    def broadcast(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                  version: int, kind: str = "full", timeout_s: float | None = None) -> Transfer:
        """Send every tensor to every generator worker; returns once all of them acknowledged.

        Blocks until every receiver calls `receive`: `timeout_s` (default: the group's timeout)
        bounds that first wait, the group's timeout each later collective. Tensors must be whole
        (not sharded); ones on another device are copied to the group's device piece by piece.
        """
        self._ops.check_usable()
        if not kind.isidentifier():  # a format's name (rltools.weight_formats); receivers check it is theirs
            raise ValueError(f"weight-sync kind {kind!r}: expected a weight format's name")
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"weight-sync: version {version} is not newer than the last version sent "
                             f"({self.last_version}); policy versions must increase")
        if isinstance(named_tensors, TensorStream):
            specs = [(n, dtype, tuple(shape), _nbytes(dtype, shape)) for n, dtype, shape in named_tensors.specs]
            take = _in_order(iter(named_tensors), specs)
        else:
            items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
            specs = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in items]
            take = lambda index: items[index][1]  # noqa: E731
        plan = plan_pieces(specs, self.bucket_bytes, self.alone_bytes)
        meta = json.dumps({"kind": kind, "tensors": plan.tensors, "pieces": plan.pieces}).encode()
        device, ops = self.group.device, self._ops
        header = torch.tensor([MAGIC, version, len(meta), len(plan.pieces)], dtype=torch.int64, device=device)
        begin = time.perf_counter()
        ops.wait(ops.broadcast(header, f"header of version {version} (waiting for every generator worker to receive)", timeout_s))
        waited = time.perf_counter() - begin
        ops.wait(ops.broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device),
                               f"metadata of version {version}"))
        try:
            self._send_pieces(take, plan, version)
            if isinstance(named_tensors, TensorStream):
                take(len(specs))  # the stream must end here (and a collective producer finishes)
        except ValueError as e:  # the stream broke its specs mid-message: receivers wait for pieces
            self._ops.broken = WeightSyncError(f"{self.group.describe()}: version {version} stopped mid-message: {e}")
            raise self._ops.broken from e
        rows = ops.acknowledge(OK, None, f"acknowledgement of version {version} by the generator workers")
        self._raise_for_refusals(rows, version)
        self.last_version = version
        return Transfer(version, kind, len(specs), sum(s[3] for s in specs), len(plan.pieces), waited)

    def probe_gaps(self, version: int) -> dict[int, float]:
        """After `broadcast(version)`: each generator worker's logprob gap to the trainer, by sync rank
        (what every receiver's `report_gap` sends once its engine scored the probe)."""
        self._ops.check_usable()
        values = self._ops.gather(0.0, f"logprob probe of version {version} by the generator workers")
        return {rank: value for rank, value in enumerate(values) if rank > 0}

    def _send_pieces(self, take: Callable[[int], torch.Tensor], plan: _Plan, version: int) -> None:
        in_flight: deque = deque()
        buckets = 0
        for k, (nbytes, members) in enumerate(plan.pieces):
            # At most max_in_flight - 1 pieces stay in flight while we pack: the bucket that last used
            # this pack buffer was issued at least max_in_flight pieces ago, so it has completed.
            while len(in_flight) >= self.max_in_flight:
                self._ops.wait(in_flight.popleft())
            if len(members) == 1 and nbytes >= self.alone_bytes:
                data = _wire_bytes(take(members[0][0]), self.group.device)
            else:
                data = self._pack(buckets % self.max_in_flight, take, members, nbytes)
                buckets += 1
            what = f"broadcast of version {version} piece {k + 1}/{len(plan.pieces)} ({nbytes / MiB:.1f} MiB)"
            in_flight.append(self._ops.broadcast(data, what))
        while in_flight:
            self._ops.wait(in_flight.popleft())

    def _pack(self, slot: int, take: Callable[[int], torch.Tensor], members: list, nbytes: int) -> torch.Tensor:
        while len(self._pack_buffers) <= slot:
            self._pack_buffers.append(torch.empty(0, dtype=torch.uint8, device=self.group.device))
        if self._pack_buffers[slot].numel() < nbytes:
            self._pack_buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        buffer = self._pack_buffers[slot][:nbytes]
        for index, offset in members:
            data = _wire_bytes(take(index), self.group.device)
            buffer[offset:offset + data.numel()].copy_(data)
        return buffer

    def _raise_for_refusals(self, rows: list[list[int]], version: int) -> None:
        stale = [r for r, (status, _) in enumerate(rows) if status == STALE]
        failed = [r for r, (status, _) in enumerate(rows) if status == FAILED]
        if stale:
            newest = max(rows[r][1] for r in stale)
            raise StaleVersionError(
                f"weight-sync: generator worker(s) with sync rank {stale} refused version {version}: they already "
                f"applied version {newest}; policy versions must increase (was the trainer restarted from an "
                "older checkpoint? resume from the newest one)")
        if failed:
            raise WeightSyncError(f"weight-sync: generator worker(s) with sync rank {failed} failed to apply "
                                  f"version {version}: their consumer raised (see their logs)")
