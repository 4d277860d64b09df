"""Several training sources mixed by weight (`data.train_mix`): the source and problem of each position
of the training stream.

Invariants:
- Position p of the stream (step k's i-th problem: p = k x prompts_per_step + i) draws its source with
  probability weight / total, from a blake2b-seeded uniform of (seed, p): a pure function of them, the
  same on every rank and after every restart, whatever positions were asked before.
- The problem is the n-th of that source's own DataOrder (seeded shuffled epochs), n = how many earlier
  positions drew that source: each source is visited in whole epochs, at its own pace, and no problem
  repeats within one of its epochs.
- One source: position p is its p-th problem, exactly the order of a single data.train_path.
"""

import bisect
import hashlib
import itertools

from .order import DataOrder


def _uniform(key: str) -> float:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2**64


class Mixture:
    def __init__(self, sizes: list[int], weights: list[float], seed: int):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"a mixture needs one weight per source, got {len(sizes)} sizes, {len(weights)} weights")
        self.seed = seed
        self.orders = [DataOrder(size, seed if i == 0 else int(_uniform(f"mix-order/{seed}/{i}") * 2**62))
                       for i, size in enumerate(sizes)]
        total = sum(weights)
        self._bounds = list(itertools.accumulate(w / total for w in weights))[:-1]
        self._picks: list[tuple[int, int]] = []  # position -> (source, its n-th problem), computed in order
        self._counts = [0] * len(sizes)

    def source_at(self, position: int) -> int:
        if not self._bounds:
            return 0
        return bisect.bisect_right(self._bounds, _uniform(f"mix/{self.seed}/{position}"))

    def take(self, step: int, count: int) -> list[tuple[int, int]]:
        """(source, index into that source's problems) of step `step`'s `count` positions."""
        end = (step + 1) * count
        while len(self._picks) < end:
            source = self.source_at(len(self._picks))
            self._picks.append((source, self._counts[source]))
            self._counts[source] += 1
        picks = []
        for source, n in self._picks[step * count:end]:
            order = self.orders[source]
            picks.append((source, order.permutation(n // order.size)[n % order.size]))
        return picks
