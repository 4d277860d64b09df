"""RoleEnv: what a running task needs to know about itself — the one reader of `SLURM_*`.

Invariant: no other module reads Slurm's or the local launcher's environment variables. Under
Slurm the task's role comes from `RLTOOLS_ROLE` (set by the `srun --export` line of the rendered
script), its rank from `SLURM_PROCID` within its component's step, and trainer rank 0's host from
the trainer component's node list. The local launcher sets the `RLTOOLS_*` equivalents.
"""

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

from ..errors import UserError

ROLE = "RLTOOLS_ROLE"
FIRST_ENGINE = "RLTOOLS_FIRST_ENGINE"
"""Set in the tasks of a job `rltools join` submitted: the first engine number that job took."""
# Hetjob component indices, for the Slurm and the local launcher alike (launch.plan lays the job out so)
GENERATOR_GROUP = 0
TRAINER_GROUP = 1
JUDGE_GROUP = 2
"""Only in a job with a judge (reward.judge)."""


@dataclass(frozen=True)
class RoleEnv:
    launcher: str
    """slurm or local."""
    role: str
    """generator, trainer or judge."""
    rank: int
    """Rank within the role (0..world_size-1)."""
    world_size: int
    """Tasks in the role."""
    local_rank: int
    """Rank among the role's tasks on this node (selects the GPU)."""
    node: str
    """This task's node name."""
    trainer_host: str
    """Host of trainer rank 0, where the weight-sync store listens."""
    restart_count: int
    """0 on the first start, +1 per requeue or resume."""
    job_id: str | None
    """Slurm job id of the hetjob leader (None under the local launcher)."""
    joined: bool = False
    """A generator of a job `rltools join` submitted: its rank is an engine number past the run's own."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "RoleEnv":
        env = os.environ if environ is None else environ
        role = _require(env, ROLE)
        if role not in ("generator", "trainer", "judge"):
            raise UserError(f"{ROLE}={role!r}: expected generator, trainer or judge")
        if env.get("RLTOOLS_LAUNCHER") == "local" or "SLURM_JOB_ID" not in env:
            return cls._local(env, role)
        if FIRST_ENGINE in env:
            return cls._joined(env)
        return cls._slurm(env, role)

    @classmethod
    def _joined(cls, env: Mapping[str, str]) -> "RoleEnv":
        """A task of a join job (a plain Slurm job of generators): engine RLTOOLS_FIRST_ENGINE + its task."""
        return cls(
            launcher="slurm",
            role="generator",
            rank=int(env[FIRST_ENGINE]) + int(_require(env, "SLURM_PROCID")),
            world_size=int(_require(env, "SLURM_NTASKS")),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            node=env.get("SLURMD_NODENAME") or socket.gethostname(),
            trainer_host="",  # the run's trainer rank 0 is found through the run directory
            restart_count=0,
            job_id=env["SLURM_JOB_ID"],
            joined=True,
        )

    @classmethod
    def _slurm(cls, env: Mapping[str, str], role: str) -> "RoleEnv":
        if "SLURM_HET_SIZE" not in env:
            raise UserError("this Slurm job is not heterogeneous (SLURM_HET_SIZE unset): submit the script rltools rendered")
        trainer_nodes = _require(env, f"SLURM_JOB_NODELIST_HET_GROUP_{TRAINER_GROUP}")
        return cls(
            launcher="slurm",
            role=role,
            rank=int(_require(env, "SLURM_PROCID")),
            world_size=int(_require(env, "SLURM_NTASKS")),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            node=env.get("SLURMD_NODENAME") or socket.gethostname(),
            trainer_host=expand_hostlist(trainer_nodes)[0],
            restart_count=int(env.get("SLURM_RESTART_COUNT", "0")),
            job_id=env["SLURM_JOB_ID"],  # the leader's id in every component's tasks
        )

    @classmethod
    def _local(cls, env: Mapping[str, str], role: str) -> "RoleEnv":
        return cls(
            launcher="local",
            role=role,
            rank=int(env.get("RLTOOLS_RANK", "0")),
            world_size=int(env.get("RLTOOLS_WORLD_SIZE", "1")),
            local_rank=int(env.get("RLTOOLS_LOCAL_RANK", env.get("RLTOOLS_RANK", "0"))),
            node=socket.gethostname(),
            trainer_host=env.get("RLTOOLS_TRAINER_HOST", "127.0.0.1"),
            restart_count=int(env.get("RLTOOLS_RESTART_COUNT", "0")),
            job_id=None,
        )

    @property
    def attempt(self) -> str:
        """Names this start of the job: records published for another start (an earlier job in the
        same run directory, or before a requeue) must not be trusted by this one."""
        return f"{self.job_id}.{self.restart_count}" if self.job_id else f"local.{self.restart_count}"

    @staticmethod
    def local_environ(role: str, rank: int, world_size: int, restart_count: int = 0) -> dict[str, str]:
        """The variables the local launcher sets for one task (the counterpart of `_local`)."""
        return {
            "RLTOOLS_LAUNCHER": "local",
            ROLE: role,
            "RLTOOLS_RANK": str(rank),
            "RLTOOLS_WORLD_SIZE": str(world_size),
            "RLTOOLS_LOCAL_RANK": str(rank),
            "RLTOOLS_TRAINER_HOST": "127.0.0.1",
            "RLTOOLS_RESTART_COUNT": str(restart_count),
        }


def _require(env: Mapping[str, str], name: str) -> str:
    if name not in env:
        raise UserError(f"{name} is not set: run this entry point through the rendered job script or the local launcher")
    return env[name]


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list: 'n[1-3,7],gpu05' -> ['n1', 'n2', 'n3', 'n7', 'gpu05'] (padding kept)."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        hosts += _expand_one(item)
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ValueError(f"unbalanced brackets in host list {text!r}")
    return [item for item in items + [current] if item]


def _expand_one(item: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, ranges, rest = item[:start], item[start + 1 : end], item[end + 1 :]
    suffixes = _expand_one(rest)
    hosts = []
    for part in ranges.split(","):
        match = _RANGE.match(part)
        if not match:
            raise ValueError(f"bad range {part!r} in host list {item!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        for number in range(int(low), int(high) + 1):
            hosts += [f"{prefix}{number:0{len(low)}d}{suffix}" for suffix in suffixes]
    return hosts
