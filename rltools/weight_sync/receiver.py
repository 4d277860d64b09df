"""The receiving end of the weight-sync channel (`channel` has the wire format and the sender).

Invariant: a receiver holds two piece buffers, reused across messages, never the whole model; what
its consumer does with a message happens before it acknowledges, and a version that failed on any
worker is served by none.
"""

import json
from collections import deque
from typing import Iterator

import torch

from .channel import (FAILED, MAGIC, OK, STALE, Consumer, MiB, StaleVersionError, Transfer, _Collectives, _nbytes,
                      _Pending)
from .rendezvous import SyncGroup, WeightSyncError


class WeightReceiver:
    """A generator worker's end: take the next message, as a `message()` context or with `receive`."""

    def __init__(self, group: SyncGroup, *, last_version: int | None = None):
        if group.rank == 0:
            raise ValueError("WeightReceiver runs on a generator worker (sync rank >= 1), not on sync rank 0")
        self.group = group
        self.last_version = last_version
        # A member of a fleet gives a collective up as soon as trainer rank 0 re-forms the group.
        self._ops = _Collectives(group, abandon=group.superseded if group.control is not None else None)
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=group.device) for _ in range(2)]

    @property
    def usable(self) -> bool:
        """False once a collective failed (a peer lost or stalled): the group must be formed again."""
        return self._ops.broken is None

    @property
    def buffer_bytes(self) -> int:
        """Bytes this receiver holds for pieces (two buffers): its memory bound, whatever the model size."""
        return sum(b.numel() for b in self._buffers)

    def message(self, timeout_s: float | None = None) -> "Message":
        """Wait up to `timeout_s` (default: the group's timeout) for the next message's header; use as
        `with receiver.message() as m: apply(m.tensors())`. Leaving the block drains what was not read
        and acknowledges: OK, or FAILED when the block raised (the sender is told, and the error is
        raised here as WeightSyncError). A stale version is drained and refused on entry
        (StaleVersionError). A timeout or a dead peer leaves the group unusable."""
        self._ops.check_usable()
        header = torch.empty(4, dtype=torch.int64, device=self.group.device)
        self._ops.wait(self._ops.broadcast(header, "waiting for the next weight update from trainer rank 0", timeout_s))
        magic, version, meta_len, n_pieces = header.tolist()
        if magic != MAGIC:
            raise WeightSyncError(f"{self.group.describe()}: received a header with magic {magic:#x}, expected "
                                  f"{MAGIC:#x}: trainer and generators run different rltools versions")
        meta_bytes = torch.empty(meta_len, dtype=torch.uint8, device=self.group.device)
        self._ops.wait(self._ops.broadcast(meta_bytes, f"metadata of version {version}"))
        meta = json.loads(bytes(meta_bytes.cpu().numpy()))
        assert len(meta["pieces"]) == n_pieces, "header and metadata disagree on the piece count"
        return Message(self, version, meta)

    def receive(self, consumer: Consumer, timeout_s: float | None = None) -> Transfer:
        """The next message, each piece handed to `consumer(pairs)` as (name, tensor) views valid only
        during the call (see `message` for stale versions, failures and deadlines)."""
        with self.message(timeout_s) as message:
            for pairs in message.pieces():
                consumer(pairs)
        return message.transfer

    def report_gap(self, gap: float, version: int) -> None:
        """After applying `version`: this worker's engine's logprob gap to the trainer (`probe_gaps`)."""
        self._ops.check_usable()
        self._ops.gather(gap, f"logprob probe of version {version}")

    def _pieces(self, meta: dict, version: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        pieces, specs = meta["pieces"], meta["tensors"]
        largest = max((nbytes for nbytes, _ in pieces), default=0)
        for i, buffer in enumerate(self._buffers):
            if buffer.numel() < largest:  # grown once, then reused: no page faults on later messages
                self._buffers[i] = torch.empty(largest, dtype=torch.uint8, device=self.group.device)
        # Two receives posted ahead: piece k+1 is on the wire while the consumer handles piece k, and
        # the sender never waits for a receive to be posted; piece k+2 reuses piece k's buffer, so it
        # is posted only when the consumer asks for the piece after k.
        pending = deque(self._start(pieces, k, version) for k in range(min(2, len(pieces))))
        for k, (_, members) in enumerate(pieces):
            current = pending.popleft()
            self._ops.wait(current)
            yield [_view(current.data, specs[index], offset) for index, offset in members]
            if k + 2 < len(pieces):
                pending.append(self._start(pieces, k + 2, version))

    def _start(self, pieces: list, k: int, version: int) -> _Pending:
        data = self._buffers[k % 2][:pieces[k][0]]
        what = f"receiving version {version} piece {k + 1}/{len(pieces)} ({pieces[k][0] / MiB:.1f} MiB) from trainer rank 0"
        return self._ops.broadcast(data, what)


class Message:
    """One weight message being received: `pieces()` or `tensors()` pull it off the wire as read."""

    def __init__(self, receiver: WeightReceiver, version: int, meta: dict):
        self.receiver, self.version, self.kind = receiver, version, meta["kind"]
        self.transfer = Transfer(version, meta["kind"], len(meta["tensors"]), sum(p[0] for p in meta["pieces"]),
                                 len(meta["pieces"]))
        self._stream = receiver._pieces(meta, version)

    def pieces(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each piece's (name, tensor) views, valid until the next piece is asked for."""
        return self._stream

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The message's (name, tensor) views in wire order, each valid until the next piece arrives:
        a consumer that keeps a tensor (vLLM's layer-wise reload buffers a layer's) copies it."""
        for pairs in self._stream:
            yield from pairs

    def __enter__(self) -> "Message":
        receiver = self.receiver
        if receiver.last_version is not None and self.version <= receiver.last_version:
            self._finish(STALE)
            raise StaleVersionError(
                f"weight-sync: refused version {self.version} from trainer rank 0: this generator worker already "
                f"applied version {receiver.last_version}; policy versions must increase")
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None and not isinstance(error, Exception):
            return False  # KeyboardInterrupt and the like: no acknowledgement, the group is left behind
        rows = self._finish(OK if error is None else FAILED)
        if error is not None:
            raise WeightSyncError(f"weight-sync: applying version {self.version} failed: {error!r}") from error
        failed = [rank for rank, (status, _) in enumerate(rows) if status == FAILED]
        if failed:  # another worker could not apply it (e.g. the adapter's writer): this one must not serve it
            raise WeightSyncError(f"weight-sync: version {self.version} failed on generator worker(s) with sync rank "
                                  f"{failed} (see their logs); it is not served")
        self.receiver.last_version = self.version
        return False

    def _finish(self, status: int) -> list[list[int]]:
        """Drain the pieces nobody read (the group stays in step), then acknowledge."""
        for _ in self._stream:
            pass
        receiver = self.receiver
        return receiver._ops.acknowledge(status, receiver.last_version, f"acknowledgement of version {self.version}")


def _view(data: torch.Tensor, spec: list, offset: int) -> tuple[str, torch.Tensor]:
    name, dtype_name, shape = spec
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"weight-sync: tensor {name!r} has unknown dtype {dtype_name!r}: trainer and generators run different torch versions")
    return name, data[offset:offset + _nbytes(dtype, shape)].view(dtype).reshape(shape)
