"""The generator fleet's shared record and heartbeat.

`fleet.json` (trainer rank 0 alone writes it, atomically; every generator reads it at each step)
says which engines are live and which engine generates each slot of a step's prompts. Each
generator process bumps a counter in trainer rank 0's weight-sync store every BEAT_S (`Heartbeat`),
and trainer rank 0 declares an engine lost when its counter stops moving (`Heartbeats`).

Invariants: a step's prompts are cut into one slot per configured engine (`roles.prompt_share`),
each delivered as one shard; what a slot holds (prompts, sampling seeds, group ids) depends only on
(seed, step, slot), never on which engine generates it, so a run that lost engines trains the same
prompts in the same order as an uninterrupted one. Each slot of a step has one engine assigned: its
own engine (slot r belongs to engine r) while that is live, a survivor otherwise.
"""

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from ..durable import atomic_write
from ..paths import RunPaths
from .address import wait_for_address

log = logging.getLogger("rltools.fleet")

BEAT_S = 1.0


@dataclass
class FleetRecord:
    generation: int
    """The weight-sync group's generation (`weight_sync.SyncHost.open`) these engines formed."""
    live: list[int]
    assignments: list[list] = field(default_factory=list)
    """[[from_step, [engine of slot 0, engine of slot 1, ...]], ...] in increasing from_step."""
    events: list[dict] = field(default_factory=list)
    """{"time", "step", "event": "lost" | "joined", "engine", "why"} in the order they happened."""

    @classmethod
    def start(cls, engines: int) -> "FleetRecord":
        return cls(0, list(range(engines)), [[0, list(range(engines))]])

    def slots(self, step: int) -> list[int]:
        """The engine of each slot at `step`."""
        return next(engines for start, engines in reversed(self.assignments) if start <= step)

    def mine(self, engine: int, step: int) -> list[int]:
        return [slot for slot, owner in enumerate(self.slots(step)) if owner == engine]

    def reassign(self, step: int) -> list[int]:
        """From `step` on: each slot to its own engine when that is live, else to a survivor (in turn);
        returns the new assignment."""
        survivors, turn, engines = sorted(self.live), 0, []
        for slot, owner in enumerate(self.slots(step)):
            if slot in self.live:
                engines.append(slot)
            elif owner in self.live:
                engines.append(owner)
            else:
                engines.append(survivors[turn % len(survivors)])
                turn += 1
        self.assignments = [a for a in self.assignments if a[0] < step] + [[step, engines]]
        return engines

    def note(self, event: str, engine: int, step: int, why: str = "") -> None:
        self.events.append({"time": round(time.time(), 3), "step": step, "event": event, "engine": engine,
                            **({"why": why} if why else {})})

    def write(self, paths: RunPaths) -> None:
        atomic_write(paths.fleet, json.dumps(asdict(self)))

    @classmethod
    def read(cls, paths: RunPaths) -> "FleetRecord | None":
        try:
            fields = json.loads(paths.fleet.read_text())
        except FileNotFoundError:
            return None
        return cls(**{key: value for key, value in fields.items() if key in cls.__dataclass_fields__})


class Heartbeat:
    """In a generator process: a daemon thread bumping `beat/<engine>` in trainer rank 0's
    weight-sync store every BEAT_S, for as long as the process lives."""

    def __init__(self, paths: RunPaths, attempt: int | str, engine: int, timeout_s: float):
        import torch.distributed as dist  # here: `rltools status` reads this module on a login node

        host, port = wait_for_address(paths.sync_address, attempt, timeout_s, "trainer rank 0 (weight-sync store)")
        self.store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.key = f"beat/{engine}"
        self.store.add(self.key, 1)
        threading.Thread(target=self._beat, name=f"rltools-heartbeat-{engine}", daemon=True).start()

    def _beat(self) -> None:
        while True:
            time.sleep(BEAT_S)
            try:
                self.store.add(self.key, 1)
            except Exception as err:  # the trainer is gone or restarting: its own deadlines report that
                log.debug("heartbeat not delivered: %s", err)


class Heartbeats:
    """Trainer rank 0's view: seconds since each engine's counter last moved (by its own clock)."""

    def __init__(self, store, timeout_s: float):
        self.store, self.timeout_s = store, timeout_s
        self._seen: dict[int, tuple[int, float]] = {}

    def age(self, engine: int) -> float:
        count, now = self.store.add(f"beat/{engine}", 0), time.monotonic()
        last = self._seen.get(engine)
        if last is None or last[0] != count:
            self._seen[engine] = (count, now)
            return 0.0
        return now - last[1]

    def stale(self, engines) -> dict[int, float]:
        """The engines among `engines` silent for longer than timeout_s, with their silence."""
        ages = {engine: self.age(engine) for engine in engines}
        return {engine: age for engine, age in ages.items() if age > self.timeout_s}

    def forget(self, engine: int) -> None:
        """A replacement starts with a fresh grace period."""
        self._seen.pop(engine, None)
