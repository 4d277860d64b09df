"""The weight-sync rendezvous's handshake: a process proves it holds the run's secret (an HMAC over
a per-session nonce) and learns the group key; trainer rank 0 proves it knows the secret too.

Both ends of steps 2 and 3 of the protocol in `rendezvous`: `_Admissions` answers each join entry
once and admits each worker id once while it is a member; `_unseal` checks the host's answer.
"""

import hashlib
import hmac
import logging
import secrets
import time
from datetime import timedelta

import torch.distributed as dist

from ..errors import UserError
from ..paths import RunPaths
from .store import WeightSyncError

log = logging.getLogger("rltools.weight_sync")

REFUSALS = {  # code written by the host -> (its log line, what the refused process must change)
    "secret": ("its proof does not match this run's secret",
               "the run secret in {secret} does not match trainer rank 0's: start this worker with the run directory of the running job"),
    "rank-range": ("sync rank {rank} is outside 1..{last} and of no `rltools join` job",
                   "sync rank {rank} is outside 1..{last} and of no `rltools join` job: the generator worker count "
                   "differs between the roles"),
    "rank-taken": ("sync rank {rank} was already admitted",
                   "another process already joined as sync rank {rank}: two workers were started with the same rank"),
}


class _Admissions:
    """Trainer rank 0's side of step 3: answers each join entry once, admits each sync rank once."""

    def __init__(self, store, secret: bytes, nonce: str, world_size: int, may_join=lambda worker: False):
        self.store, self.secret, self.nonce, self.world_size = store, secret, nonce, world_size
        self.may_join = may_join
        self.group_key = secrets.token_bytes(32)
        self.admitted: set[int] = set()
        self.answered: set[str] = set()  # a replayed entry must not overwrite its first answer
        self.refused = 0
        self._read = 0  # characters of `joins` already handled

    @property
    def complete(self) -> bool:
        return set(range(1, self.world_size)) <= self.admitted

    def poll(self) -> None:
        if not self.store.check(["joins"]):
            return
        text = self.store.get("joins").decode(errors="replace")
        end = text.rfind(";") + 1  # appends are atomic and end with ';': never a partial entry
        for entry in filter(None, text[self._read:end].split(";")):
            self._answer(entry)
        self._read = max(self._read, end)

    def _answer(self, entry: str) -> None:
        try:
            rank_text, token, proof = entry.split(":")
            rank, proof_bytes = int(rank_text), bytes.fromhex(proof)
        except ValueError:
            log.warning("weight-sync: ignored a malformed join entry %r (not written by rltools)", entry[:80])
            return
        if token in self.answered:
            return
        self.answered.add(token)
        if not hmac.compare_digest(_mac(self.secret, "join", self.nonce, rank, token), proof_bytes):
            code = "secret"  # checked first: a process without the secret learns nothing about ranks
        elif not (1 <= rank < self.world_size or rank >= self.world_size and self.may_join(rank)):
            code = "rank-range"
        elif rank in self.admitted:
            code = "rank-taken"
        else:
            self.admitted.add(rank)
            sealed = bytes(a ^ b for a, b in zip(self.group_key, _mac(self.secret, "admit", self.nonce, token))).hex()
            tag = _mac(self.secret, "host", self.nonce, token, sealed).hex()
            self.store.set(f"admit/{token}", f"ok:{sealed}:{tag}")
            return
        self.refused += 1
        self.store.set(f"admit/{token}", f"refused:{code}")
        log.warning("weight-sync: refused a process claiming generator worker sync rank %d: %s", rank,
                    REFUSALS[code][0].format(rank=rank, last=self.world_size - 1))


def _admit_all(admissions: _Admissions, deadline: float, timeout_s: float) -> None:
    delay = 0.01
    while True:
        admissions.poll()
        if admissions.complete:
            break
        if time.monotonic() >= deadline:
            missing = sorted(set(range(1, admissions.world_size)) - admissions.admitted)
            raise WeightSyncError(
                f"weight-sync: generator worker(s) with sync rank {missing} did not join trainer rank 0 within "
                f"{timeout_s:.0f} s (admitted {sorted(admissions.admitted)}, refused {admissions.refused} "
                "process(es)); check that every generator worker started and reads this run directory")
        time.sleep(delay)  # joins arrive once per worker: a gentle, capped poll costs nothing
        delay = min(delay * 2, 0.2)
    admissions.poll()  # a join that raced the last admission is refused now, not left to time out
    log.info("weight-sync: admitted generator worker(s) %s", sorted(admissions.admitted))


def _await_answer(store, token: str, deadline: float, what: str) -> str:
    try:
        store.wait([f"admit/{token}"], timedelta(seconds=_left(deadline)))
        return store.get(f"admit/{token}").decode()
    except dist.DistError as e:
        raise WeightSyncError(f"weight-sync: {what} before the join deadline: {_first_line(e)}") from e


def _unseal(answer: str, secret: bytes, nonce: str, token: str, where: str) -> bytes:
    try:
        _, sealed, tag = answer.split(":")
        valid = hmac.compare_digest(_mac(secret, "host", nonce, token, sealed), bytes.fromhex(tag))
    except ValueError:
        valid = False
    if not valid:  # mutual authentication: never take weights from a host without the secret
        raise WeightSyncError(f"weight-sync: the answer from {where} failed authentication: that process does not know this run's secret")
    return bytes(a ^ b for a, b in zip(bytes.fromhex(sealed), _mac(secret, "admit", nonce, token)))


def _read_secret(paths: RunPaths) -> bytes:
    try:
        mode = paths.secret.stat().st_mode
        secret = paths.read_secret()
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"weight-sync: cannot read the run secret {paths.secret} ({e}): {paths.root} is not a run "
                        "directory made by rltools; point the role at the run directory of the job") from None
    if mode & 0o077:
        log.warning("weight-sync: the run secret %s is readable by other users (mode %o); run `chmod 600 %s`",
                    paths.secret, mode & 0o777, paths.secret)
    return secret


def _mac(secret: bytes, *parts) -> bytes:
    return hmac.new(secret, "|".join(str(p) for p in parts).encode(), hashlib.sha256).digest()


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def _first_line(error: BaseException) -> str:
    """c10d errors carry a C++ backtrace after the first line; the first line is the message."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
