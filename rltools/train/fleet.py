"""Trainer rank 0's generator fleet: the weight-sync group across engine losses and joins, and
which engine generates each slot of a step (`runtime.fleet`).

An engine is lost when its heartbeat stops for generator.heartbeat_timeout_s (noticed while the
trainer waits for rollouts, and during every weight-sync collective), or when a collective fails
and it does not come back to the next generation of the group before its heartbeat goes stale. Its
slots of every untrained step go to the survivors, the group is dropped (which fails the
collectives the survivors are in) and formed again with them. Below generator.min_engines live
engines the run stops at a checkpoint, and requeues itself as on preemption.

Invariant: every broadcast either reached every live engine, or the group was re-formed and
`send` returns None: the caller sends that version again.
"""

import logging
import time

from ..paths import RunPaths
from ..runtime.fleet import LEFT, FleetRecord, Heartbeats, joined_engines
from ..runtime.roles import slots, sync_workers
from ..weight_sync import SyncOptions, WeightSender, WeightSyncError
from ..weight_sync.rendezvous import SyncHost

log = logging.getLogger("rltools.fleet")


class FleetTooSmall(RuntimeError):
    """Fewer live engines than generator.min_engines: the run stops at a checkpoint."""


class Fleet:
    def __init__(self, paths: RunPaths, config, *, address: str, attempt: int | str, backend: str,
                 stopping=lambda: False):
        gen = config.generator
        self.paths, self.tp, self.min_engines = paths, gen.tensor_parallel_size, gen.min_engines
        self.engines = config.cluster.generators.ntasks
        self.timeout_s = gen.sync_timeout_s
        options = SyncOptions(backend=backend, join_timeout_s=gen.sync_timeout_s, collective_timeout_s=gen.sync_timeout_s)
        self.host = SyncHost(paths, workers=sync_workers(config), address=address, attempt=attempt, options=options,
                             may_join=lambda worker: (worker - 1) // self.tp in joined_engines(paths))
        self.beats = Heartbeats(self.host.store, gen.heartbeat_timeout_s)
        self.record = FleetRecord.start(self.engines, slots(config))
        self.record.write(paths)  # before any engine joins: none reads an earlier attempt's record
        group = self.host.first_group()
        self.sender = WeightSender(group, abandon=self._abandon)
        self._reform_due = False
        self.stopping = stopping
        """Whether the run is stopping on a signal: then a failed sync is the generators leaving, not a loss."""

    # -- what the trainer loop calls ------------------------------------------------------------
    def check(self, step: int) -> None:
        """While waiting for step `step`'s rollouts: lose the engines whose heartbeat stopped."""
        if self.stopping():  # the engines leave with the run
            return
        left = self.beats.left(self.record.live)
        if left:
            self._lose(left, step, f"{LEFT}: its job ends")
            self._drop_group()
        stale = self.beats.stale(self.record.live)
        if stale:
            self._lose(stale, step, "its heartbeat stopped")
            self._drop_group()

    def trained(self, step: int, slot_sizes) -> FleetRecord:
        """Step `step` is trained: credit each engine with its samples (`rltools status`)."""
        self.record.count(step, slot_sizes)
        self._locate([e for e in self.record.live if not self.record.where.get(str(e))])
        self.record.write(self.paths)
        return self.record

    def send(self, weights, *, version: int, kind: str, step: int):
        """Broadcast `version` to every live engine and gather their probe gaps: (Transfer, gaps by
        sync rank), or None when the group lost an engine meanwhile and was re-formed (send again)."""
        self._admit_replacements(step)
        if self._reform_due:
            self._reform(step)
        try:
            transfer = self.sender.broadcast(weights, version=version, kind=kind)
        except WeightSyncError as err:
            self._after_failure(step, err)
            return None
        try:
            gaps = self.sender.probe_gaps(version)
        except WeightSyncError as err:  # delivered: only the probe's figures are lost
            self._after_failure(step, err)
            gaps = {}
        return transfer, gaps

    def engine_of(self, sync_rank: int) -> int:
        """The engine of a sync rank of the current generation."""
        return (self.sender.group.members[sync_rank - 1] - 1) // self.tp

    # -- losses and joins ------------------------------------------------------------------------
    def _workers(self, engine: int) -> set[int]:
        return set(range(1 + engine * self.tp, 1 + (engine + 1) * self.tp))

    def _abandon(self) -> str | None:
        stale = self.beats.stale(self.record.live)
        gone = [f"generator {e} left" for e in self.beats.left(self.record.live)]
        return ", ".join(gone + [f"generator {e}'s heartbeat stopped {age:.0f} s ago" for e, age in stale.items()]) or None

    def _after_failure(self, step: int, err: WeightSyncError) -> None:
        if self.stopping():
            raise err
        log.warning("weight sync failed (%s): re-forming the group with the engines that come back", err)
        self._drop_group()
        self._reform(step)

    def _drop_group(self) -> None:
        if self._reform_due:
            return
        self.sender.group.close()  # fails the collectives the survivors are in: they come back at once
        self.host.open()
        self._reform_due = True

    def _lose(self, engines: dict[int, float] | set[int], step: int, why: str) -> None:
        for engine in sorted(engines):
            log.warning("generator %d lost at step %d (%s): its prompts go to the other engines", engine, step, why)
            self.record.live.remove(engine)
            self.record.note("lost", engine, step, why)
            self.host.release(self._workers(engine))
        if len(self.record.live) < self.min_engines:
            self.record.write(self.paths)
            raise FleetTooSmall(f"{len(self.record.live)} generator engine(s) live, fewer than generator.min_engines "
                                f"{self.min_engines}: stopping at a checkpoint")
        slots = self.record.reassign(step)
        log.warning("from step %d the slots go to generators %s (engines live: %s)", step, slots, self.record.live)
        self.record.write(self.paths)

    def _admit_replacements(self, step: int) -> None:
        """An engine restarted inside the allocation, or one of a job `rltools join` submitted (all its
        workers admitted), joins at this version."""
        admitted = self.host.admitted()
        joined = joined_engines(self.paths)
        known = [*range(self.engines), *joined]
        back = [e for e in known if e not in self.record.live and self._workers(e) <= admitted]
        if not back:
            return
        for engine in back:
            self.beats.forget(engine)
            self.record.where.pop(str(engine), None)  # it reports where it runs once it beats
            if engine in joined:
                log.info("generator %d (of `rltools join` job %s) joins the run at this weight sync", engine,
                         joined[engine].get("job_id", "?"))
            else:
                log.info("generator %d is back: it joins the group at this weight sync", engine)
            self.record.live.append(engine)
            self.record.live.sort()
            self.record.note("joined", engine, step)
        self._drop_group()

    def _locate(self, engines) -> None:
        for engine in engines:
            self.record.where[str(engine)] = self.beats.where(engine)

    def _reform(self, step: int) -> None:
        """Form the open generation with every live engine whose workers all come back; an engine
        whose heartbeat goes stale first (or that is not back by the deadline) is lost."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.stopping():  # the run stops on a signal: the engines are leaving, not lost
                raise WeightSyncError("weight-sync: the run is stopping; the group is not formed again")
            ready = self.host.ready()
            waiting = [e for e in self.record.live if not self._workers(e) <= ready]
            left = self.beats.left(waiting)
            if left:
                self._lose(left, step, f"{LEFT}: its job ends")
                continue
            stale = self.beats.stale(waiting)
            if time.monotonic() >= deadline:
                stale = {e: self.timeout_s for e in waiting}
            if stale:
                self._lose(stale, step, "it did not come back after a failed weight sync")
                continue
            if not waiting:
                break
            time.sleep(0.05)
        members = sorted(w for e in self.record.live for w in self._workers(e))
        group = self.host.form(members)
        self.sender.regroup(group)
        self._reform_due = False
        self.record.generation = group.generation
        self.record.reassign(step)
        self.record.write(self.paths)
        log.info("weight-sync group generation %d formed with generators %s", group.generation, self.record.live)
