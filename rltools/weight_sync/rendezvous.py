"""Weight-sync rendezvous: trainer rank 0 admits only generator workers that know the run's secret.

Invariant: a process becomes a member of the weight-sync group only after proving, with an HMAC
over a fresh per-session nonce, that it holds the run's secret (`RunPaths.secret`, mode 0600), and
every key the group's own rendezvous writes to the store is named and authenticated with a key that
only admitted members hold. The group is a standalone process-group object, never the default group,
so it cannot collide with the trainers' own group.

Protocol (steps 2 and 3, the secret handshake, are `admission`'s), all through a TCPStore hosted by trainer rank 0 (the "host") for the whole run attempt:
 1. host: start the store, set `nonce`, THEN publish {"host", "port", "attempt"} in
    `paths.sync_address` (tmp file + os.replace), so a joiner that sees the file can read the nonce.
 2. joiner (worker id w: 1..W-1, its fixed sync rank, or past W-1 for an engine of a `rltools join`
    job, which the host's `may_join` knows), at any time: wait for a file of its own
    attempt (an earlier start's file is ignored), then append ";w:token:HMAC(secret, join|nonce|w|token);"
    to `joins`.
 3. host: check each proof. Admitted: `admit/<token>` = the random group key XOR HMAC(secret,
    admit|nonce|token), plus a tag proving the host knows the secret too. Refused: "refused:<code>"
    and a warning on the `rltools.weight_sync` logger. A worker id is admitted once while it is a
    member; the host releases the id of a member it lost, so a replacement can take it.
 4. group generations: the host opens generation g (the store counter `generation` becomes g + 1);
    each member marks itself ready under g; the host writes g's roster (the worker ids in rank
    order) and all form the process group of g (ranks 1.. in roster order) on a `SealedStore` of g.
    A member that missed g's roster was dropped (one arriving mid-run, at its first join, waits for a
    later generation instead: the host takes it in at its next weight sync). When a member is lost the host drops the group
    (which fails every collective the others are in) and opens g + 1; the others join it.

Why a sealed store and not a PrefixStore with a secret prefix: TCPStore.list_keys() answers any
client, so a prefix hides nothing; with sealed keys a process without the secret can still delete
keys (deny service, which ends in a named timeout) but cannot forge a peer address the group accepts.
The data path itself (gloo/NCCL sockets) is unauthenticated and unencrypted, as in any
torch.distributed job: the secret guards who may join, not the wire.

On NCCL every wait of forming a group has a deadline too: the exchange of the NCCL id goes through
the sealed store (its timeout), and ncclCommInitRank, which waits for every member, runs in a thread
whose deadline this process keeps (`nccl.connect`). torch's own NCCL timeout and error handling are set
so that our named WeightSyncError, not torch's watchdog, ends a stalled or failed collective
(`weight_sync.nccl`).
"""

import contextlib
import dataclasses
import json
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..paths import RunPaths
from ..runtime.address import AddressTimeout, publish_address, wait_for_address
from .admission import (
    REFUSALS,
    _Admissions,
    _admit_all,
    _await_answer,
    _first_line,
    _left,
    _mac,
    _read_secret,
    _unseal,
)
from .nccl import connect, forming, nccl_group
from .store import SealedStore, WeightSyncError, bound_store

log = logging.getLogger("rltools.weight_sync")

BACKENDS = ("gloo", "nccl")

@dataclass(frozen=True)
class SyncOptions:
    backend: str = "gloo"
    """gloo (CPU tensors; also across nodes) or nccl (CUDA tensors, one GPU per process)."""
    join_timeout_s: float = 300.0
    """Deadline for publishing/finding the store address, admission and forming the group."""
    collective_timeout_s: float = 300.0
    """Deadline of every collective once the group exists (each piece, the acknowledgement)."""


@dataclass(frozen=True)
class SyncGroup:
    """Membership in the weight-sync group: sync rank 0 is trainer rank 0, 1..W-1 generator workers."""

    pg: Any
    """The standalone torch process-group backend (ProcessGroupGloo or ProcessGroupNCCL)."""
    rank: int
    world_size: int
    backend: str
    device: torch.device
    """Where this member's wire tensors live: cpu for gloo, its CUDA device for nccl."""
    timeout: timedelta
    store: Any
    """The group's SealedStore, kept alive with it; on trainer rank 0 it holds the TCPStore server."""
    generation: int = 0
    """Which formation of the group this is (`SyncHost.open`); a new one follows each loss or join."""
    members: tuple[int, ...] = ()
    """The worker ids (fixed sync ranks) of ranks 1..W-1, in rank order."""
    control: Any = None
    """A member's raw store client: its generation counter says when this group is superseded."""

    def describe(self) -> str:
        again = f", generation {self.generation}" if self.generation else ""
        return f"weight-sync group (trainer rank 0 + {self.world_size - 1} generator worker(s), backend {self.backend}{again})"

    def superseded(self) -> str | None:
        """Why this generation is over (trainer rank 0 opened a newer one), or None."""
        if self.control is None:
            return None
        latest = self.control.add(GENERATION, 0) - 1
        return f"trainer rank 0 re-forms the group (generation {latest})" if latest > self.generation else None

    def close(self) -> None:
        """Give this process group up. It is aborted but kept (`_GIVEN_UP`): destroying a gloo group
        with a collective still pending joins its worker thread, which waits out the collective's
        timeout, even after an abort (measured: the whole timeout, in whichever thread drops the last
        reference: a vLLM worker stalled 300 s in execute_model when the garbage collector ran); the
        peers learn of the end from the store's generation counter (`superseded`)."""
        if any(pg is self.pg for pg in _GIVEN_UP):
            return
        abort = getattr(self.pg, "abort", None)
        if abort is not None:
            with contextlib.suppress(RuntimeError):  # a group already broken needs no abort
                abort()
        _GIVEN_UP.append(self.pg)


_GIVEN_UP: list = []  # process groups given up, alive until the process ends


class Dropped(WeightSyncError):
    """This worker was not in the roster of the generation it joined: the trainer formed the group without it."""


GENERATION = "generation"  # the store counter: generations opened so far (the open one is the count - 1)


def host_group(paths: RunPaths, *, world_size: int, address: str, attempt: int | str = 0,
               options: SyncOptions = SyncOptions()) -> SyncGroup:
    """Trainer rank 0: host the store at `address` (a name generator nodes resolve, e.g. RoleEnv's
    trainer_host), admit W-1 generator workers, form the group. Blocks up to options.join_timeout_s."""
    host = SyncHost(paths, workers=world_size - 1, address=address, attempt=attempt, options=options)
    return host.first_group()


def join_group(paths: RunPaths, *, rank: int, world_size: int, attempt: int | str = 0,
               options: SyncOptions = SyncOptions(), device: torch.device | None = None) -> SyncGroup:
    """Generator worker with sync rank 1..W-1 (its global generator-worker index + 1): find trainer
    rank 0 of `attempt`, prove the secret, join. Blocks up to options.join_timeout_s. For nccl,
    `device` defaults to the current CUDA device."""
    return SyncMember(paths, worker=rank, workers=world_size - 1, attempt=attempt, options=options,
                      device=device).join()


class SyncHost:
    """Trainer rank 0's end for a whole run attempt: the store, admissions (at any time: a
    replacement worker), and the group's generations."""

    def __init__(self, paths: RunPaths, *, workers: int, address: str, attempt: int | str = 0,
                 options: SyncOptions = SyncOptions(), may_join=lambda worker: False):
        """`workers`: the configured workers (ids 1..workers); `may_join(worker id)`: whether an id past
        them belongs to an engine added from outside the job (`rltools join`)."""
        _check(options, workers + 1)
        self.options, self.workers = options, workers
        secret = _read_secret(paths)
        self.store = bound_store(address, timedelta(seconds=options.join_timeout_s))
        nonce = secrets.token_hex(16)
        self.store.set("nonce", nonce)  # before the address is published: joiners read it straight away
        publish_address(paths.sync_address, address, self.store.port, attempt)
        log.info("weight-sync: store at %s:%d (attempt %s), waiting for %d generator worker(s)",
                 address, self.store.port, attempt, workers)
        self.admissions = _Admissions(self.store, secret, nonce, workers + 1, may_join)
        self.generation = -1

    def first_group(self) -> SyncGroup:
        """Admit every worker, open generation 0 and form it with all of them (the start of a run)."""
        deadline = time.monotonic() + self.options.join_timeout_s
        _admit_all(self.admissions, deadline, self.options.join_timeout_s)
        self.open()
        everyone = set(range(1, self.workers + 1))
        while not everyone <= self.ready():  # a worker joining from outside (`rltools join`) may be ready too
            if time.monotonic() >= deadline:
                missing = sorted(everyone - self.ready())
                raise WeightSyncError(f"weight-sync: generator worker(s) with sync rank {missing} were admitted "
                                      f"but did not join the group within {self.options.join_timeout_s:.0f} s")
            time.sleep(0.01)
        return self.form(sorted(everyone))

    def admitted(self) -> set[int]:
        """The worker ids admitted so far (new joins are answered first)."""
        self.admissions.poll()
        return set(self.admissions.admitted)

    def release(self, workers) -> None:
        """Lost workers: their ids may be admitted again (a replacement process)."""
        self.admissions.admitted -= set(workers)

    def open(self) -> int:
        """Open the next generation; members waiting for one (after a loss) mark themselves ready."""
        self.generation = self.store.add(GENERATION, 1) - 1
        return self.generation

    def ready(self) -> set[int]:
        """The admitted workers that marked themselves ready for the open generation."""
        sealed = self._sealed(self.generation)
        return {w for w in self.admitted() if sealed.check([f"ready/{w}"])}

    def form(self, members: list[int]) -> SyncGroup:
        """Form the open generation with `members` (ready worker ids), in that rank order."""
        deadline = time.monotonic() + self.options.join_timeout_s
        sealed = self._sealed(self.generation)
        sealed.set("roster", json.dumps(list(members)))
        return _form(sealed, 0, len(members) + 1, self.options, deadline, None, self.generation, tuple(members))

    def _sealed(self, generation: int) -> "SealedStore":
        return SealedStore(self.store, self.admissions.group_key, timedelta(seconds=self.options.join_timeout_s),
                           label=f"g{generation}")


class SyncMember:
    """A generator worker's end: admitted once (the run secret), then joins each generation it is
    asked to (`join`), as worker id `worker`."""

    def __init__(self, paths: RunPaths, *, worker: int, workers: int, attempt: int | str = 0,
                 options: SyncOptions = SyncOptions(), device: torch.device | None = None,
                 arriving: bool = False):
        """`arriving`: this process joins a run under way, a lost one's replacement (of the same worker
        id: until trainer rank 0 has declared that one lost, and released its id, it is refused, and
        asks again) or an engine added from outside (`rltools join`)."""
        _check(options, workers + 1)
        if worker < 1:
            raise ValueError(f"weight-sync: sync rank {worker} must be 1 or more (0 is trainer rank 0)")
        self.worker, self.options, self.device = worker, options, device
        self.arriving, self.joined = arriving, False
        deadline = time.monotonic() + options.join_timeout_s
        secret = _read_secret(paths)
        try:
            host, port = wait_for_address(paths.sync_address, attempt, options.join_timeout_s, "trainer rank 0 (weight-sync store)")
        except AddressTimeout as e:
            raise WeightSyncError(f"weight-sync: {e}") from None
        self.where = where = f"trainer rank 0's weight-sync store at {host}:{port}"
        try:
            self.store = store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                               timeout=timedelta(seconds=_left(deadline)))
            nonce = store.get("nonce").decode()
        except dist.DistError as e:
            raise WeightSyncError(f"weight-sync: could not reach {where} (from {paths.sync_address}): {_first_line(e)}") from e
        while True:
            token = secrets.token_hex(16)
            try:
                store.append("joins", f";{worker}:{token}:{_mac(secret, 'join', nonce, worker, token).hex()};")
            except dist.DistError as e:
                raise WeightSyncError(f"weight-sync: could not reach {where}: {_first_line(e)}") from e
            answer = _await_answer(store, token, deadline, f"{where} did not answer the join of sync rank {worker}")
            if not (arriving and answer == "refused:rank-taken" and time.monotonic() < deadline):
                break
            time.sleep(1.0)  # the lost process still holds the id: its heartbeat has not run out yet
        if answer.startswith("refused:"):
            code = answer.removeprefix("refused:")
            why = REFUSALS[code][1] if code in REFUSALS else f"unknown reason {code!r}"
            why = why.format(secret=paths.secret, rank=worker, last=workers)
            raise WeightSyncError(f"weight-sync: trainer rank 0 refused this process (sync rank {worker}): {why}")
        self.group_key = _unseal(answer, secret, nonce, token, where)

    def join(self, after: int | None = None) -> SyncGroup:
        """Join the first generation opened after generation `after` (None: the open one, or the next
        if the open one is formed already); Dropped when the trainer formed it without this worker,
        except for a process arriving mid-run (`arriving`) on its first join: it waits for the
        generation trainer rank 0 forms with it."""
        deadline = time.monotonic() + self.options.join_timeout_s
        while True:
            generation, sealed, roster = self._roster(after, deadline)
            if self.worker in roster:
                break
            if not (self.arriving and not self.joined and time.monotonic() < deadline):
                raise Dropped(f"weight-sync: trainer rank 0 formed generation {generation} of the group without sync "
                              f"rank {self.worker} (it was lost to the trainer: too late, or its heartbeat stopped)")
            after = generation  # formed before trainer rank 0 had taken this worker in: the next one has it
        self.joined = True
        group = _form(sealed, roster.index(self.worker) + 1, len(roster) + 1, self.options, deadline, self.device,
                      generation, tuple(roster))
        return dataclasses.replace(group, control=self.store)

    def _roster(self, after: int | None, deadline: float) -> tuple[int, "SealedStore", list[int]]:
        """(generation, its sealed store, its roster) of the first generation opened after `after`."""
        try:
            if after is None:
                latest = self.store.add(GENERATION, 0) - 1  # -1: none opened yet
                formed = latest >= 0 and self._sealed(latest, deadline).check(["roster"])
                after = latest if formed or latest < 0 else latest - 1
            delay = 0.01
            while (generation := self.store.add(GENERATION, 0) - 1) <= after:
                if time.monotonic() >= deadline:
                    raise WeightSyncError(f"weight-sync: {self.where} opened no generation after {after} within "
                                          f"{self.options.join_timeout_s:.0f} s (sync rank {self.worker})")
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
            sealed = self._sealed(generation, deadline)
            sealed.set(f"ready/{self.worker}", "1")
            return generation, sealed, json.loads(sealed.get("roster"))
        except dist.DistError as e:
            raise WeightSyncError(f"weight-sync: joining generation {after + 1}+ at {self.where} failed as sync rank "
                                  f"{self.worker}: {_first_line(e)}") from e

    def _sealed(self, generation: int, deadline: float) -> "SealedStore":
        return SealedStore(self.store, self.group_key, timedelta(seconds=_left(deadline)), label=f"g{generation}")


# -- both sides ---------------------------------------------------------------------------------
def _form(sealed: "SealedStore", rank: int, world_size: int, options: SyncOptions, deadline: float,
          device: torch.device | None, generation: int = 0, members: tuple[int, ...] = ()) -> SyncGroup:
    timeout = timedelta(seconds=options.collective_timeout_s)
    sealed.set_timeout(timedelta(seconds=max(_left(deadline), 1.0)))
    describe = f"trainer rank 0 + {world_size - 1} generator worker(s), backend {options.backend}"
    started = time.monotonic()
    try:
        if options.backend == "gloo":
            pg, device = dist.ProcessGroupGloo(sealed, rank, world_size, timeout), torch.device("cpu")
        else:
            device = device or torch.device("cuda", torch.cuda.current_device())
            pg = nccl_group(sealed, rank, world_size, timeout)
            try:  # fail here, named and within the join deadline, not at the first broadcast
                connect(pg, device, _left(deadline), forming(rank, world_size, generation, members))
            except WeightSyncError:
                _GIVEN_UP.append(pg)  # its init thread still blocks in NCCL: never destroyed
                raise
    except WeightSyncError:
        raise
    except (dist.DistError, RuntimeError) as e:
        raise WeightSyncError(f"weight-sync: forming the group ({describe}) failed as sync rank {rank} after "
                              f"{time.monotonic() - started:.1f} s: {_first_line(e)}") from e
    return SyncGroup(pg, rank, world_size, options.backend, device, timeout, sealed, generation, members)


def _check(options: SyncOptions, world_size: int) -> None:
    if options.backend not in BACKENDS:
        raise ValueError(f"weight-sync backend {options.backend!r}: expected one of {', '.join(BACKENDS)}")
    if options.backend == "nccl" and not dist.is_nccl_available():
        raise ValueError("weight-sync backend nccl needs a CUDA build of torch; this one has no NCCL: use gloo")
    if world_size < 2:
        raise ValueError(f"weight-sync world size {world_size}: needs trainer rank 0 and at least one generator worker")
