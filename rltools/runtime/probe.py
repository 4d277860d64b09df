"""The logprob probe: after every weight sync, proof that the generators serve the policy trained.

Before broadcasting policy version v, the trainers score one fixed token sequence with the new
weights and trainer rank 0 writes `probes/probe_v<v>.json` (tokens and their log-probabilities, at
temperature 1). Each generator, once it loaded v, scores the same tokens with vLLM and reports the
mean absolute difference to trainer rank 0 over the weight-sync group (`WeightSender.probe_gaps`):
the largest is the step's `logprob_gap` metric. Trainer rank 0 stops the run when it is beyond
`generator.max_logprob_gap`, with the gap, the engine and the likely causes named: a layer vLLM
serves with other weights than the trainer's (a LoRA target it does not apply, a weight name it does
not load, another dtype) would otherwise only show as a policy that learns less than it should.

Invariant: both roles score exactly the token ids in the file (no second tokenisation).
"""

import json
from pathlib import Path

from ..durable import atomic_write
from ..paths import RunPaths

PROBE_TEXT = "What is 23+58?=81 What is 7*6-5?=37"
"""Short, and made of characters every tokenizer of ours has (the char-level demo models' too)."""


def probe_tokens(tokenizer) -> list[int]:
    """The probe's token ids under `tokenizer` (with its BOS, as a prompt would get it)."""
    return list(tokenizer(PROBE_TEXT).input_ids)


def write_probe(paths: RunPaths, version: int, tokens: list[int], logprobs: list[float]) -> None:
    """Trainer rank 0, before broadcasting `version`; drops the probe of version - 2 (every generator
    has compared it: it took version - 1 since)."""
    paths.probe_file(version).parent.mkdir(exist_ok=True)
    atomic_write(paths.probe_file(version), json.dumps({"version": version, "tokens": tokens, "logprobs": logprobs}))
    paths.probe_file(version - 2).unlink(missing_ok=True)


def read_probe(paths: RunPaths, version: int) -> tuple[list[int], list[float]] | None:
    """The trainer's probe of `version`; None when the trainer wrote none (a backend whose
    `probe_logprobs` returns None)."""
    if not paths.probe_file(version).exists():
        return None
    return read_probe_file(paths.probe_file(version))


def read_probe_file(path: Path) -> tuple[list[int], list[float]]:
    """The tokens and trainer log-probabilities of a probe file (probes/, or a checkpoint's copy)."""
    record = json.loads(Path(path).read_text())
    return record["tokens"], record["logprobs"]


def probe_gap(trainer: list[float], generator: list[float]) -> tuple[float, float]:
    """(mean, max) absolute difference of two scorings of the probe's tokens."""
    if len(trainer) != len(generator) or not trainer:
        raise ValueError(f"probe: the trainer scored {len(trainer)} tokens, the generator {len(generator)}")
    gaps = [abs(a - b) for a, b in zip(trainer, generator)]
    return sum(gaps) / len(gaps), max(gaps)


def check_gap(version: int, mean: float, who: str, limit: float) -> None:
    """Raise when the gap of `version` is beyond `limit` (generator.max_logprob_gap; 0: never)."""
    if limit and mean > limit:
        raise RuntimeError(
            f"policy version {version}: the log-probabilities of the probe sequence ({PROBE_TEXT!r}) that {who} "
            f"computed differ from the trainer's by {mean:.3g} on average, above "
            f"generator.max_logprob_gap {limit:g}: the generators serve another policy than the one trained. Likely "
            "causes: a LoRA target vLLM does not apply (an MLA model's kv_b_proj under weight_sync: lora), weights "
            "vLLM did not load (names it does not know: see the generator log), or the roles differ in model.dtype "
            "or quantization. Raise generator.max_logprob_gap only if the numerics explain the gap")
