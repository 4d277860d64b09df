"""RolloutBatch: the one typed record generators hand to trainers.

Invariant: ragged token arrays are stored flat with offsets (`ids[offsets[i]:offsets[i+1]]` is
sample i), completion logprobs are aligned one-to-one with completion tokens, and every per-sample
array has one entry per sample. The constructor checks this, so a batch read from disk or built
by a generator is consistent or is not built at all.

Routed experts (MoE models with `algorithm.routing_replay`) are optional: for sample i,
`routed_experts[routed_offsets[i]:routed_offsets[i+1]]` [positions, MoE layers, top-k] holds the
experts the generator routed each token it ran through the model to: every prompt token and every
completion token but the last (which was sampled, never run), so prompt + completion - 1 rows.

Multi-turn episodes (`env.type: tools`) carry the episode arrays: a sample's completion is its
model turns and the environment's answers in order, `completion_mask` marks which tokens the model
wrote (1: trained on, with the generator's logprob) and which the environment did (0: logprob 0,
never trained on). Turn boundaries are the mask's edges; `turns`, `tool_calls` and `tool_errors`
count per sample.
"""

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np


class FinishReason(enum.IntEnum):
    STOP = 0  # end-of-sequence or a stop string
    LENGTH = 1  # hit max_new_tokens
    ABORT = 2  # cancelled (e.g. preemption)


@dataclass(frozen=True)
class Sample:
    """One completion, as a generator produces it."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    completion_logprobs: Sequence[float]
    reward: float
    group_id: int
    sample_index: int
    finish_reason: FinishReason
    text: str | None = None
    routed_experts: np.ndarray | None = None  # [prompt + completion - 1, MoE layers, top-k]
    completion_mask: Sequence[int] | None = None  # multi-turn: 1 per model token, 0 per environment token
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    reward_failed: bool = False  # the reward call failed (rltools/reward/failures.py): `reward` is its 0
    scores: dict[str, float] | None = None  # a reward of several scores: each by name (nan: not given)
    failed_functions: tuple[str, ...] = ()  # a reward of several functions: those whose call failed


EPISODE = {"completion_mask": np.uint8, "turns": np.int16, "tool_calls": np.int16, "tool_errors": np.int16}


@dataclass(frozen=True, eq=False)
class RolloutBatch:
    prompt_ids: np.ndarray  # int32 [total prompt tokens]
    prompt_offsets: np.ndarray  # int64 [n + 1]
    completion_ids: np.ndarray  # int32 [total completion tokens]
    completion_offsets: np.ndarray  # int64 [n + 1]
    completion_logprobs: np.ndarray  # float32 [total completion tokens], generator's logprob of each token
    rewards: np.ndarray  # float32 [n]
    group_ids: np.ndarray  # int64 [n], samples of one prompt share a group id
    sample_indices: np.ndarray  # int32 [n], index within the group
    finish_reasons: np.ndarray  # uint8 [n], FinishReason values
    policy_version: int  # weights version that generated the batch
    texts: tuple[str, ...] | None = None  # completion texts, for debugging
    generation_seconds: float = 0.0  # wall time the generator spent producing the batch
    routed_experts: np.ndarray | None = None  # int16 [total routed positions, MoE layers, top-k]
    routed_offsets: np.ndarray | None = None  # int64 [n + 1]
    prompts_drawn: int = 0  # prompts sampled for the batch (dynamic sampling draws more than it keeps)
    completion_mask: np.ndarray | None = None  # uint8 [total completion tokens], 1: the model wrote it
    turns: np.ndarray | None = None  # int16 [n] model turns of each episode
    tool_calls: np.ndarray | None = None  # int16 [n]
    tool_errors: np.ndarray | None = None  # int16 [n] calls that failed
    slot_sizes: tuple[int, ...] = ()  # samples of each joined shard, in slot order (`concat`); not stored
    slot_versions: tuple[int, ...] = ()  # policy version of each joined shard, in slot order (`concat`); not stored
    reward_failures: int = 0  # samples whose reward call failed and scored 0 (timed out, raised, not a number)
    scores: np.ndarray | None = None  # float32 [n, len(score_names)]: each named score (nan: not given)
    score_names: tuple[str, ...] = ()  # the reward's named scores (rltools/reward/verifiers.py), columns of `scores`
    failures_by: tuple[tuple[str, int], ...] = ()  # (function, samples whose call of it failed), several functions

    DTYPES = {
        "prompt_ids": np.int32,
        "prompt_offsets": np.int64,
        "completion_ids": np.int32,
        "completion_offsets": np.int64,
        "completion_logprobs": np.float32,
        "rewards": np.float32,
        "group_ids": np.int64,
        "sample_indices": np.int32,
        "finish_reasons": np.uint8,
    }

    def __post_init__(self):
        for name, dtype in self.DTYPES.items():
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
                raise ValueError(f"RolloutBatch.{name}: expected a 1-d {np.dtype(dtype)} array")
        n = len(self)
        for prefix in ("prompt", "completion"):
            offsets, ids = getattr(self, f"{prefix}_offsets"), getattr(self, f"{prefix}_ids")
            if offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
                raise ValueError(f"RolloutBatch.{prefix}_offsets do not cover {prefix}_ids")
        if len(self.completion_logprobs) != len(self.completion_ids):
            raise ValueError("RolloutBatch.completion_logprobs must align with completion_ids")
        for name in ("rewards", "group_ids", "sample_indices", "finish_reasons"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries for {n} samples")
        if self.texts is not None and len(self.texts) != n:
            raise ValueError(f"RolloutBatch.texts has {len(self.texts)} entries for {n} samples")
        if (self.routed_experts is None) != (self.routed_offsets is None):
            raise ValueError("RolloutBatch.routed_experts and routed_offsets come together")
        if self.routed_experts is not None:
            routes, offsets = self.routed_experts, self.routed_offsets
            if routes.dtype != np.int16 or routes.ndim != 3 or offsets.dtype != np.int64 or len(offsets) != n + 1:
                raise ValueError("RolloutBatch.routed_experts: expected int16 [positions, layers, top-k] with int64 "
                                 "offsets, one per sample and one more")
            expected = np.diff(self.prompt_offsets) + np.diff(self.completion_offsets) - 1
            if offsets[0] != 0 or offsets[-1] != len(routes) or not np.array_equal(np.diff(offsets), expected):
                raise ValueError("RolloutBatch.routed_experts: each sample needs one row per prompt token and per "
                                 "completion token but the last")

        if self.scores is not None and (self.scores.dtype != np.float32 or self.scores.shape != (n, len(self.score_names))):
            raise ValueError(f"RolloutBatch.scores: expected float32 [{n}, {len(self.score_names)}] for the score names")
        present = [name for name in EPISODE if getattr(self, name) is not None]
        if present and len(present) != len(EPISODE):
            raise ValueError(f"RolloutBatch episode arrays come together: {', '.join(EPISODE)}")
        for name, dtype in EPISODE.items() if present else ():
            array, size = getattr(self, name), len(self.completion_ids) if name == "completion_mask" else n
            if array.dtype != dtype or array.ndim != 1 or len(array) != size:
                raise ValueError(f"RolloutBatch.{name}: expected a 1-d {np.dtype(dtype)} array of {size}")

    def __len__(self) -> int:
        return len(self.prompt_offsets) - 1

    @property
    def episodes(self) -> dict[str, np.ndarray]:
        """The multi-turn arrays (EPISODE), or {} for single-turn rollouts."""
        return {} if self.completion_mask is None else {name: getattr(self, name) for name in EPISODE}

    def trained_mask(self, i: int) -> np.ndarray:
        """1.0 for each completion token of sample i the model wrote (all of them in single turn)."""
        if self.completion_mask is None:
            return np.ones(self.completion_offsets[i + 1] - self.completion_offsets[i], dtype=np.float32)
        return self.completion_mask[self.completion_offsets[i] : self.completion_offsets[i + 1]].astype(np.float32)

    def score_metrics(self) -> dict[str, float | int]:
        """reward/<name>: each named score's mean over the samples that gave it; reward_failures/<function>."""
        means = {}
        for j, name in enumerate(self.score_names):
            given = self.scores[:, j][~np.isnan(self.scores[:, j])]
            if len(given):
                means[f"reward/{name}"] = float(given.mean())
        return {**means, **{f"reward_failures/{name}": count for name, count in self.failures_by}}

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.DTYPES}

    def prompt(self, i: int) -> np.ndarray:
        return self.prompt_ids[self.prompt_offsets[i] : self.prompt_offsets[i + 1]]

    def completion(self, i: int) -> np.ndarray:
        return self.completion_ids[self.completion_offsets[i] : self.completion_offsets[i + 1]]

    def logprobs(self, i: int) -> np.ndarray:
        return self.completion_logprobs[self.completion_offsets[i] : self.completion_offsets[i + 1]]

    def routes(self, i: int) -> np.ndarray:
        """Sample i's routed experts [prompt + completion - 1, MoE layers, top-k]."""
        return self.routed_experts[self.routed_offsets[i] : self.routed_offsets[i + 1]]

    def __eq__(self, other) -> bool:
        if not isinstance(other, RolloutBatch):
            return NotImplemented
        return (
            self.policy_version == other.policy_version
            and self.texts == other.texts
            and all(np.array_equal(a, b) for a, b in zip(self.arrays.values(), other.arrays.values()))
            and (self.routed_experts is None) == (other.routed_experts is None)
            and (self.routed_experts is None or np.array_equal(self.routed_experts, other.routed_experts))
            and self.episodes.keys() == other.episodes.keys()
            and all(np.array_equal(a, other.episodes[k]) for k, a in self.episodes.items())
        )

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], policy_version: int, generation_seconds: float = 0.0,
                     prompts_drawn: int = 0) -> "RolloutBatch":
        def flat(key: str, dtype) -> tuple[np.ndarray, np.ndarray]:
            parts = [np.asarray(getattr(s, key), dtype=dtype) for s in samples]
            offsets = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum([len(p) for p in parts], out=offsets[1:])
            return (np.concatenate(parts) if parts else np.zeros(0, dtype)), offsets

        prompt_ids, prompt_offsets = flat("prompt_ids", np.int32)
        completion_ids, completion_offsets = flat("completion_ids", np.int32)
        logprobs, _ = flat("completion_logprobs", np.float32)
        texts = [s.text for s in samples]
        routed = {}
        if samples and all(s.routed_experts is not None for s in samples):
            experts, offsets = flat("routed_experts", np.int16)
            routed = {"routed_experts": experts, "routed_offsets": offsets}
        if samples and all(s.completion_mask is not None for s in samples):
            routed["completion_mask"] = flat("completion_mask", np.uint8)[0]
            for name in ("turns", "tool_calls", "tool_errors"):
                routed[name] = np.array([getattr(s, name) for s in samples], dtype=EPISODE[name])
        return cls(
            prompt_ids=prompt_ids,
            prompt_offsets=prompt_offsets,
            completion_ids=completion_ids,
            completion_offsets=completion_offsets,
            completion_logprobs=logprobs,
            rewards=np.array([s.reward for s in samples], dtype=np.float32),
            group_ids=np.array([s.group_id for s in samples], dtype=np.int64),
            sample_indices=np.array([s.sample_index for s in samples], dtype=np.int32),
            finish_reasons=np.array([int(s.finish_reason) for s in samples], dtype=np.uint8),
            policy_version=policy_version,
            texts=tuple(texts) if all(t is not None for t in texts) and samples else None,
            generation_seconds=generation_seconds,
            prompts_drawn=prompts_drawn,
            reward_failures=sum(s.reward_failed for s in samples),
            **_named_scores(samples),
            **routed,
        )

    @classmethod
    def concat(cls, batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Join batches (one per slot of a step). Slots an engine generated for a lost one may carry
        another policy version: the joined batch carries the oldest (the staleness bound holds for
        every sample; each sample's own logprobs correct for its policy)."""
        if not batches:
            raise ValueError("no rollouts to concatenate")
        joined = {}
        names = [*cls.DTYPES, *(("routed_experts", "routed_offsets") if all(b.routed_experts is not None for b in batches)
                                else ()), *(EPISODE if all(b.completion_mask is not None for b in batches) else ())]
        for name in names:
            if name.endswith("_offsets"):
                starts = np.cumsum([0] + [getattr(b, name)[-1] for b in batches[:-1]])
                parts = [getattr(b, name)[1:] + start for b, start in zip(batches, starts)]
                joined[name] = np.concatenate([np.zeros(1, np.int64), *parts]).astype(np.int64)
            else:
                joined[name] = np.concatenate([getattr(b, name) for b in batches])
        texts = None if any(b.texts is None for b in batches) else sum((b.texts for b in batches), ())
        seconds = max((b.generation_seconds for b in batches), default=0.0)  # ranks generate in parallel
        names = tuple(dict.fromkeys(name for b in batches for name in b.score_names))
        scores = {}
        if names:  # slots may lack a score no sample of theirs gave: nan
            scores["scores"] = np.concatenate([_columns(b, names) for b in batches])
        failures = {}
        for b in batches:
            for name, count in b.failures_by:
                failures[name] = failures.get(name, 0) + count
        return cls(**joined, policy_version=min(b.policy_version for b in batches), texts=texts,
                   generation_seconds=seconds, prompts_drawn=sum(b.prompts_drawn for b in batches),
                   slot_sizes=tuple(len(b) for b in batches), slot_versions=tuple(b.policy_version for b in batches),
                   reward_failures=sum(b.reward_failures for b in batches),
                   score_names=names, failures_by=tuple(failures.items()), **scores)


def _named_scores(samples: Sequence[Sample]) -> dict:
    """The scores, score_names and failures_by of a batch of `samples` ({} for a reward of one score)."""
    names = tuple(dict.fromkeys(name for s in samples for name in (s.scores or {})))
    functions = dict.fromkeys(name for s in samples for name in s.failed_functions)
    if not names and not functions:
        return {}
    scores = np.array([[(s.scores or {}).get(name, np.nan) for name in names] for s in samples],
                      dtype=np.float32).reshape(len(samples), len(names))
    failures = tuple((name, sum(name in s.failed_functions for s in samples)) for name in functions)
    return {"scores": scores if names else None, "score_names": names, "failures_by": failures}


def _columns(batch: RolloutBatch, names: tuple[str, ...]) -> np.ndarray:
    """`batch`'s scores in the columns `names` (nan where it has none of one)."""
    out = np.full((len(batch), len(names)), np.nan, dtype=np.float32)
    for j, name in enumerate(batch.score_names):
        out[:, names.index(name)] = batch.scores[:, j]
    return out

