"""The generator fleet's shared record and heartbeat.

`fleet.json` (trainer rank 0 alone writes it, atomically; every generator reads it at each step)
says which engines are live and which engine generates each slot of a step's prompts. Each
generator process bumps a counter in trainer rank 0's weight-sync store every BEAT_S (`Heartbeat`),
and trainer rank 0 declares an engine lost when its counter stops moving (`Heartbeats`).

Invariants: a step's prompts are cut into generator.slots slots (`roles.prompt_share`; default one
per configured engine), each delivered as one shard; what a slot holds (prompts, sampling seeds,
group ids) depends only on (seed, step, slot), never on which engine generates it, so a run that
lost or gained engines trains the same prompts in the same order as an uninterrupted one. Each slot of a step has one engine assigned: its
home engine (slot s belongs to configured engine s mod engines) while that is live and no engine
that joined needs a share, another live engine otherwise.
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
LEFT = "it left"
"""How a loss the engine announced (`Heartbeat.leave`) begins its reason."""


@dataclass
class FleetRecord:
    generation: int
    """The weight-sync group's generation (`weight_sync.SyncHost.open`) these engines formed."""
    live: list[int]
    assignments: list[list] = field(default_factory=list)
    """[[from_step, [engine of slot 0, engine of slot 1, ...]], ...] in increasing from_step."""
    events: list[dict] = field(default_factory=list)
    """{"time", "step", "event": "lost" | "joined", "engine", "why"} in the order they happened."""
    engines: int = 0
    """Engines configured (cluster.generators); those of `rltools join` are numbered from here."""
    delivered: dict = field(default_factory=dict)
    """Samples each engine generated for trained steps: {engine (str): samples}."""
    where: dict = field(default_factory=dict)
    """Where each engine that reported in runs: {engine (str): {"node", "job"}}."""

    @classmethod
    def start(cls, engines: int, slots: int | None = None) -> "FleetRecord":
        slots = slots or engines
        return cls(0, list(range(engines)), [[0, [slot % engines for slot in range(slots)]]], engines=engines)

    def home(self, slot: int) -> int:
        """The configured engine whose slot this is while it is live."""
        return slot % (self.engines or len(self.assignments[0][1]))

    def slots(self, step: int) -> list[int]:
        """The engine of each slot at `step`."""
        return next(engines for start, engines in reversed(self.assignments) if start <= step)

    def mine(self, engine: int, step: int) -> list[int]:
        return [slot for slot, owner in enumerate(self.slots(step)) if owner == engine]

    def covered(self, step: int) -> list[int]:
        """The slots of `step` generated for a lost engine: their home engine had none of that step."""
        owners = self.slots(step)
        return [slot for slot, owner in enumerate(owners) if self.home(slot) not in owners]

    def reassign(self, step: int) -> list[int]:
        """From `step` on, spread the slots evenly over the live engines: each slot stays with its home
        engine, else with its current one, while that engine has room; the rest go to those with room
        (in engine order). Returns the new assignment."""
        current = self.slots(step)
        live = sorted(self.live)
        room = {engine: len(current) // len(live) + (i < len(current) % len(live)) for i, engine in enumerate(live)}
        engines: list[int | None] = [None] * len(current)
        for choice in (self.home, lambda slot: current[slot]):
            for slot, owner in enumerate(engines):
                candidate = choice(slot)
                if owner is None and room.get(candidate, 0) > 0:
                    engines[slot] = candidate
                    room[candidate] -= 1
        spare = iter(engine for engine in live for _ in range(room[engine]))
        engines = [owner if owner is not None else next(spare) for owner in engines]
        self.assignments = [a for a in self.assignments if a[0] < step] + [[step, engines]]
        return engines

    def count(self, step: int, slot_sizes) -> None:
        """Credit each engine with the samples of its slots of trained step `step`."""
        for owner, size in zip(self.slots(step), slot_sizes):
            self.delivered[str(owner)] = self.delivered.get(str(owner), 0) + int(size)

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


def joined_engines(paths: RunPaths) -> dict[int, dict]:
    """Engines of the jobs `rltools join` submitted: {engine: that join's record}."""
    try:
        joins = json.loads(paths.joins.read_text())
    except FileNotFoundError:
        return {}
    return {engine: join for join in joins for engine in range(join["first_engine"], join["first_engine"] + join["engines"])}


def add_join(paths: RunPaths, configured: int, engines: int, **details) -> int:
    """Record a join of `engines` engines; returns the first engine number it takes (numbers are
    never reused: a join's engines are known to trainer rank 0 by them)."""
    def add(joins: list) -> int:
        first = max([configured] + [j["first_engine"] + j["engines"] for j in joins])
        joins.append({"id": len(joins), "first_engine": first, "engines": engines, **details})
        return first

    return _update_joins(paths, add)


def set_join_job(paths: RunPaths, first_engine: int, job_id: str) -> None:
    def update(joins: list) -> None:
        next(j for j in joins if j["first_engine"] == first_engine)["job_id"] = job_id

    _update_joins(paths, update)


def _update_joins(paths: RunPaths, change):
    """change(joins) under a lock (two `rltools join` at once number their engines apart), then written."""
    import fcntl

    with open(paths.root / ".joins.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            joins = json.loads(paths.joins.read_text())
        except FileNotFoundError:
            joins = []
        result = change(joins)
        atomic_write(paths.joins, json.dumps(joins, indent=1))
    return result


class Heartbeat:
    """In a generator process: a daemon thread bumping `beat/<engine>` in trainer rank 0's
    weight-sync store every BEAT_S until `stop`; `where/<engine>` says where it runs, and `leave`
    tells trainer rank 0 the engine is going (its job ends) before it goes.

    It beats no longer than the store can answer: the generator stops it once it holds the final
    weights (trainer rank 0 then closes its store whenever it is done), and the thread ends at the
    first beat that fails (a TCPStore client never reconnects: every later beat would fail too). Each
    failed call costs a c10d warning with a C++ stack trace in the log: TCPStore.cpp logs it through
    c10's LOG(WARNING) (TORCH_CPP_LOG_LEVEL), not Python's logging, before the error reaches Python.
    """

    def __init__(self, paths: RunPaths, attempt: int | str, engine: int, timeout_s: float, where: dict):
        import torch.distributed as dist  # here: `rltools status` reads this module on a login node

        host, port = wait_for_address(paths.sync_address, attempt, timeout_s, "trainer rank 0 (weight-sync store)")
        self.store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.engine, self.key = engine, f"beat/{engine}"
        self.store.set(f"where/{engine}", json.dumps(where))
        self.store.add(self.key, 1)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"rltools-heartbeat-{engine}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(BEAT_S):
            try:
                self.store.add(self.key, 1)
            except Exception as err:  # the trainer is gone or restarting: its own deadlines report that
                log.info("heartbeat to trainer rank 0 stopped: its store does not answer (%s)", _first_line(err))
                self._stopped.set()

    def stop(self) -> None:
        """Beat no more (idempotent); returns once no beat is in flight."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * BEAT_S)  # a beat to a live store takes a millisecond

    def leave(self) -> None:
        """Tell trainer rank 0 this engine is leaving: it reassigns its slots at once, not after the
        heartbeat timeout. Nothing to tell once the beats stopped (the final weights are in, or the
        trainer is gone)."""
        if self._stopped.is_set():
            return
        try:
            self.store.set(f"left/{self.engine}", "1")
        except Exception as err:  # the trainer is gone: nothing to tell
            log.debug("leave not delivered: %s", err)


def _first_line(err: Exception) -> str:
    """A c10d error's message without the C++ stack trace that follows it."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


class Heartbeats:
    """Trainer rank 0's view: seconds since each engine's counter last moved (by its own clock),
    which engines said they leave, and where each runs."""

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

    def left(self, engines) -> list[int]:
        """The engines among `engines` that said they leave (`Heartbeat.leave`)."""
        return [engine for engine in engines if self.store.check([f"left/{engine}"])]

    def where(self, engine: int) -> dict:
        key = f"where/{engine}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else {}

    def forget(self, engine: int) -> None:
        """A replacement starts with a fresh grace period (and has not left)."""
        self._seen.pop(engine, None)
        self.store.delete_key(f"left/{engine}")
