"""`rltools bench moe`: the trainer's memory and step time on a MoE whose routed experts are packed
NVFP4, against the same model in bf16, in one run.

The model is a DeepSeek-V3-architecture MoE made here with random weights (hidden 512, 3 MoE layers
of 32 routed experts, top-4, plus a shared expert; ~45M parameters, 85% of them in routed experts),
saved in bf16 and quantised by `rltools quantize` code (every linear with a 16-divisible input; the
router, norms, embeddings and head stay bf16). Each variant: LoRA on the attention projections, bf16
compute, `STEPS` training steps (forward, backward, AdamW on the adapters) on 8 sequences of 128
random tokens.

Memory is counted in tensor bytes, not the process's resident size (which the allocator's caching
and lazily loaded kernels swamp at this scale): the weights the model holds (its parameters and
buffers; of them, the routed experts'), and what autograd keeps from forward for backward beyond
those weights (activations, and any dense copy of a packed weight: `quant.linear.packed_linear`
keeps none). Weights plus saved tensors is the step's footprint, less the transients of one layer.
"""

import json
import statistics
import tempfile
import time
from pathlib import Path

STEPS, WARMUP = 5, 1
SHAPE = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=32,
             num_experts_per_tok=4, n_group=1, topk_group=1, n_shared_experts=1, num_hidden_layers=4,
             first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128,
             kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=512)
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def run_moe_bench(threads: int = 1, shape: dict = SHAPE, steps: int = STEPS) -> dict:
    import torch

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="rltools-bench-moe-") as tmp:
        bf16, nvfp4 = _make_checkpoints(Path(tmp), shape)
        reference = _measure(bf16, "none", shape["vocab_size"], steps)
        ours = _measure(nvfp4, "nvfp4", shape["vocab_size"], steps)
    mb = 2**20

    def pair(key: str, scale: float = 1 / mb, digits: int = 1) -> dict:
        return {"nvfp4": round(ours[key] * scale, digits), "bf16": round(reference[key] * scale, digits)}

    return {
        "model": f"DeepSeek-V3-class MoE, {shape['num_hidden_layers'] - shape['first_k_dense_replace']} MoE layers x "
                 f"{shape['n_routed_experts']} experts, hidden {shape['hidden_size']}, 8 x 128 tokens a step",
        "experts_mb": pair("experts"),
        "experts_ratio": round(ours["experts"] / reference["experts"], 3),
        "weights_mb": pair("weights"),
        "saved_for_backward_mb": pair("saved"),
        "footprint_ratio": round((ours["weights"] + ours["saved"]) / (reference["weights"] + reference["saved"]), 3),
        "step_s": pair("step_s", 1, 3),
        "step_ratio": round(ours["step_s"] / reference["step_s"], 2),
        "threads": threads,
    }


def _make_checkpoints(directory: Path, shape: dict) -> tuple[Path, Path]:
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from ..quant.nvfp4_checkpoint import quantize_checkpoint

    torch.manual_seed(0)
    config = DeepseekV3Config(**shape, scoring_func="sigmoid", topk_method="noaux_tc", initializer_range=0.02)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory / "bf16")
    del model
    quantize_checkpoint(directory / "bf16", directory / "nvfp4", progress=False)
    return directory / "bf16", directory / "nvfp4"


def _measure(path: Path, quantization: str, vocab_size: int, steps: int) -> dict:
    import torch

    from ..config.schema import LoraConfig, ModelConfig
    from ..train.model import load_policy

    policy = load_policy(ModelConfig(path=str(path), dtype="bfloat16", quantization=quantization),
                         LoraConfig(rank=8, alpha=16, target_modules=TARGETS))
    held = {}  # storage -> bytes of every weight the model holds
    for name, tensor in [*policy.named_parameters(), *policy.named_buffers()]:
        held[tensor.untyped_storage().data_ptr()] = (name, tensor.untyped_storage().nbytes())
    experts = sum(size for name, size in held.values() if ".mlp.experts." in name)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    times, saved = [], {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    for step in range(WARMUP + steps):
        ids = torch.randint(0, vocab_size, (8, 128), generator=generator)
        saved.clear()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            logits = policy(input_ids=ids[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    return {"experts": experts, "weights": sum(size for _, size in held.values()), "saved": sum(saved.values()),
            "step_s": statistics.median(times)}


if __name__ == "__main__":
    print(json.dumps(run_moe_bench()))
