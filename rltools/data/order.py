"""The order training problems are visited in: a seeded shuffle per epoch and a resumable cursor.

Invariants:
- The permutation of epoch e is a pure function of (seed, e, dataset size): blake2b-seeded, not
  Python's salted `hash`, so every rank and every restart sees the same order.
- A Cursor (epoch, index) is the position of the next problem; `take` from a cursor returns the
  same problems on any machine, and a batch that reaches the end of an epoch continues in the next
  epoch's permutation. Saving a Cursor (`to_dict`) and restoring it (`from_dict`) resumes exactly.
- With a fixed batch size, step k starts at cursor_at(k, count): the data order needs no state
  beyond the step counter, which is why any generator rank can regenerate its share of a step.
"""

import hashlib
import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    index: int = 0
    """Position in epoch `epoch`'s permutation of the next problem to visit."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict) -> "Cursor":
        return cls(epoch=int(state["epoch"]), index=int(state["index"]))


class DataOrder:
    def __init__(self, size: int, seed: int):
        if size < 1:
            raise ValueError(f"a data order needs at least one problem, got {size}")
        self.size, self.seed = size, seed
        self._cached: tuple[int, list[int]] | None = None

    def permutation(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            key = f"data-order/{self.seed}/{epoch}/{self.size}".encode()
            order = list(range(self.size))
            random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")).shuffle(order)
            self._cached = (epoch, order)
        return self._cached[1]

    def cursor_at(self, step: int, count: int) -> Cursor:
        """Where step `step` starts when every step takes `count` problems."""
        epoch, index = divmod(step * count, self.size)
        return Cursor(epoch, index)

    def take(self, cursor: Cursor, count: int) -> tuple[list[int], Cursor]:
        """Indices of the next `count` problems from `cursor`, and the cursor after them."""
        indices, epoch, index = [], cursor.epoch, cursor.index
        while len(indices) < count:
            if index == self.size:
                epoch, index = epoch + 1, 0
            indices.append(self.permutation(epoch)[index])
            index += 1
        if index == self.size:
            epoch, index = epoch + 1, 0
        return indices, Cursor(epoch, index)
