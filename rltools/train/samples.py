"""A bounded sample of each trained step's rollouts, kept readable in samples/step_<k>.jsonl
(`rltools.completions`; `rltools samples RUN` prints them).

Invariants:
- Whole groups are kept (advantages are relative to the group: its samples are read side by side), as
  many as fit in `run.samples_per_step` samples, at least one; which groups is a function of (run.seed,
  step) alone, so a resumed run keeps the same ones of a step it trains again.
- The advantage is the one the step trained on (`Trainer.advantages`: the overlong penalty included);
  the reward is the verifier's, before any penalty.
- The completion is the text the reward scored (the shard's: vLLM's detokenization; a multi-turn
  episode's last model turn, the whole episode decoded beside it). Shards keep no prompt text: prompts
  are decoded from their tokens with the model's tokenizer, special tokens included, as the model saw them.
- `sample_row` is the one place a line's fields are decided.
"""

from typing import Callable

import numpy as np

from ..completions import write_step_samples
from ..paths import RunPaths
from ..rollout import FinishReason, RolloutBatch


class StepSamples:
    """Trainer rank 0's writer of samples/step_<k>.jsonl; `limit` 0 writes nothing. The tokenizer
    (`decode`) is model_path's unless one is given, loaded here, before the steps it would delay."""

    def __init__(self, paths: RunPaths, limit: int, seed: int, model_path: str, tokenizer=None):
        self.paths, self.limit, self.seed = paths, limit, seed
        if limit and tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.tokenizer = tokenizer

    def write(self, step: int, batch: RolloutBatch, advantages_of: Callable, engines: list[int]) -> list[dict]:
        """Keep a sample of step `step`'s `batch`; `advantages_of(batch)` gives the advantages [N] the step
        trained on and their metrics (`Trainer.advantages`), `engines` the engine of each slot
        (`FleetRecord.slots`). Returns the rows written ([] when off)."""
        if not self.limit:
            return []
        advantages = advantages_of(batch)[0].numpy()
        slots = slot_of_each(batch)
        rows = []
        for i in choose_groups(batch.group_ids, self.limit, self.seed, step):
            slot = int(slots[i])
            rows.append(sample_row(batch, i, advantage=float(advantages[i]), slot=slot,
                                   engine=engines[slot] if slot < len(engines) else None, **self._texts(batch, i)))
        write_step_samples(self.paths, step, rows)
        return rows

    def _texts(self, batch: RolloutBatch, i: int) -> dict:
        decode = self.tokenizer.decode
        texts = {"prompt": decode(batch.prompt(i).tolist()),
                 "completion": batch.texts[i] if batch.texts is not None
                 else decode(batch.completion(i).tolist(), skip_special_tokens=True)}
        if batch.episodes:
            texts["episode"] = decode(batch.completion(i).tolist())
        return texts


def sample_row(batch: RolloutBatch, i: int, *, advantage: float, slot: int, engine: int | None, prompt: str,
               completion: str, episode: str | None = None) -> dict:
    """Sample i's line of samples/step_<k>.jsonl; a reward of several scores adds each by name (`scores`:
    those the sample's functions gave; rltools/reward/verifiers.py)."""
    version = batch.slot_versions[slot] if slot < len(batch.slot_versions) else batch.policy_version
    row = {"group": int(batch.group_ids[i]), "index": int(batch.sample_indices[i]),
           "reward": round(float(batch.rewards[i]), 6), "advantage": round(advantage, 6),
           "finish_reason": FinishReason(int(batch.finish_reasons[i])).name.lower(),
           "completion_tokens": int(batch.completion_offsets[i + 1] - batch.completion_offsets[i]),
           "policy_version": int(version), "engine": engine, "slot": slot, "prompt": prompt, "completion": completion}
    if batch.scores is not None:
        given = {name: round(float(v), 6) for name, v in zip(batch.score_names, batch.scores[i]) if not np.isnan(v)}
        row["scores"] = given
    if episode is not None:
        row.update(episode=episode, turns=int(batch.turns[i]), tool_calls=int(batch.tool_calls[i]),
                   tool_errors=int(batch.tool_errors[i]))
    return row


def choose_groups(group_ids: np.ndarray, limit: int, seed: int, step: int) -> np.ndarray:
    """Indices (in batch order) of the samples of whole groups drawn at random by (seed, step), as
    many groups as fit in `limit` samples, at least one."""
    groups, sizes = np.unique(group_ids, return_counts=True)
    order = np.random.default_rng([seed % 2**32, step]).permutation(len(groups))
    chosen, total = [], 0
    for g in order:
        if chosen and total + sizes[g] > limit:
            break
        chosen.append(groups[g])
        total += sizes[g]
    return np.flatnonzero(np.isin(group_ids, chosen))


def slot_of_each(batch: RolloutBatch) -> np.ndarray:
    """The slot (shard) of each sample: `concat` joins the shards in slot order."""
    sizes = batch.slot_sizes or (len(batch),)
    return np.repeat(np.arange(len(sizes)), sizes)
