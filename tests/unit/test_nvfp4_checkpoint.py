"""`rltools quantize` on the shipped tiny model: layout, sizes, streaming shards, and an independent
decode with compressed-tensors' own NVFP4 decompressor."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rltools.cli import main
from rltools.quant.layout import plan
from rltools.quant.nvfp4 import dequantize
from rltools.quant.nvfp4_checkpoint import (
    Source,
    load_nvfp4_state,
    quantize_checkpoint,
    write_dequantized,
)

TINY = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("q") / "tiny-nvfp4"
    assert main(["quantize", str(TINY), "-o", str(out), "--quiet"]) == 0
    return out


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    source = Source(model_dir)
    return {n: source.get(n) for n in source.names()}


def test_names_dtypes_and_config_are_what_vllm_reads(quantized):
    state = tensors(quantized)
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    # vLLM's CompressedTensorsConfig picks CompressedTensorsW4A4Fp4(use_a16=True) for this group
    # (_is_nvfp4_format: float, 4 bits, tensor_group, group 16, symmetric; input_activations null)
    weights = config["config_groups"]["group_0"]["weights"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
    assert (weights["type"], weights["num_bits"], weights["strategy"], weights["group_size"], weights["symmetric"]) == (
        "float", 4, "tensor_group", 16, True)
    assert config["config_groups"]["group_0"]["input_activations"] is None
    assert config["config_groups"]["group_0"]["targets"] == ["Linear"]
    for layer in range(4):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                     "mlp.up_proj"):
            p = f"model.layers.{layer}.{proj}"
            assert f"{p}.weight" not in state
            out_f, in_f = tensors(TINY)[f"{p}.weight"].shape
            assert state[f"{p}.weight_packed"].dtype == torch.uint8 and state[f"{p}.weight_packed"].shape == (out_f, in_f // 2)
            assert state[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn and state[f"{p}.weight_scale"].shape == (out_f, in_f // 16)
            assert state[f"{p}.weight_global_scale"].dtype == torch.float32 and state[f"{p}.weight_global_scale"].shape == (1,)
        # down_proj's input dim 344 is not a multiple of 16: kept, and listed in ignore
        assert f"model.layers.{layer}.mlp.down_proj.weight" in state
        assert f"model.layers.{layer}.mlp.down_proj" in config["ignore"]
    assert {"lm_head", "model.embed_tokens"} <= set(config["ignore"])
    assert state["model.norm.weight"].dtype == torch.float32
    assert (quantized / "model.safetensors").stat().st_mode == (TINY / "config.json").stat().st_mode
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (quantized / side).read_bytes() == (TINY / side).read_bytes()


def test_compressed_tensors_parses_the_config_and_decodes_our_tensors(quantized):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(json.loads((quantized / "config.json").read_text())["quantization_config"])
    scheme = config.config_groups["group_0"]
    state = tensors(quantized)
    source = tensors(TINY)
    for p in ("model.layers.0.self_attn.q_proj", "model.layers.2.mlp.up_proj"):
        parts = {s: state[f"{p}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = NVFP4PackedCompressor.decompress(parts, scheme)["weight"]  # bf16, their own unpack
        ours = dequantize(*parts.values())
        assert torch.equal(theirs, ours.to(theirs.dtype))
        assert (ours - source[f"{p}.weight"]).abs().max() < source[f"{p}.weight"].abs().max() / 6


def test_fused_shards_share_one_global_scale(quantized):
    state = tensors(quantized)
    for layer in range(4):
        qkv = [state[f"model.layers.{layer}.self_attn.{x}_proj.weight_global_scale"] for x in "qkv"]
        gate_up = [state[f"model.layers.{layer}.mlp.{x}_proj.weight_global_scale"] for x in ("gate", "up")]
        assert all(torch.equal(qkv[0], g) for g in qkv) and torch.equal(gate_up[0], gate_up[1])
        amax = max(float(tensors(TINY)[f"model.layers.{layer}.self_attn.{x}_proj.weight"].abs().max()) for x in "qkv")
        assert qkv[0].item() == pytest.approx(448 * 6 / amax)


def test_quantized_layers_are_3_5_to_4x_smaller_than_bf16(tmp_path, capsys):
    summary = quantize_checkpoint(TINY, tmp_path / "q", progress=False)
    ratio = summary.quantized_bytes_bf16 / summary.quantized_bytes_after
    print("\n".join(summary.lines()))
    assert 3.5 <= ratio <= 4.0
    on_disk = tensors(tmp_path / "q")
    quantized_bytes = sum(t.numel() * t.element_size() for n, t in on_disk.items() if n.rsplit(".", 1)[1].startswith("weight_"))
    assert quantized_bytes == summary.quantized_bytes_after


def test_streamed_shards_and_on_the_fly_quantization_agree(quantized, tmp_path):
    quantize_checkpoint(TINY, tmp_path / "sharded", shard_bytes=200_000, progress=False)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:
        with safe_open(str(tmp_path / "sharded" / f), "pt") as handle:
            assert all(index["weight_map"][k] == f for k in handle.keys())
    one, sharded, fly = tensors(quantized), tensors(tmp_path / "sharded"), dict(load_nvfp4_state(TINY))
    assert set(one) == set(sharded) == set(fly)
    for name, tensor in one.items():
        assert torch.equal(sharded[name].view(torch.uint8), tensor.view(torch.uint8)), name
        assert torch.equal(fly[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_dequantized_copy_holds_the_dequantized_weights(quantized, tmp_path):
    dense = tensors(write_dequantized(quantized, tmp_path / "dense"))
    state = tensors(quantized)
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    p = "model.layers.1.self_attn.v_proj"
    assert torch.equal(dense[f"{p}.weight"], dequantize(state[f"{p}.weight_packed"], state[f"{p}.weight_scale"],
                                                        state[f"{p}.weight_global_scale"]))
    assert set(dense) == set(tensors(TINY))


def test_ignore_patterns_and_refusals(tmp_path):
    shapes = Source(TINY).shapes()
    kept = plan(shapes, ignore=["re:.*layers\\.0\\..*", "model.layers.1.self_attn.o_proj"]).kept
    assert "model.layers.0.self_attn.q_proj" in kept and "model.layers.1.self_attn.o_proj" in kept
    assert "model.layers.1.self_attn.q_proj" not in kept
    # ignoring one shard of a fused layer keeps its siblings too (vLLM refuses mixed shards)
    kept = plan(shapes, ignore=["model.layers.2.self_attn.k_proj"]).kept
    assert {f"model.layers.2.self_attn.{x}_proj" for x in "qkv"} <= set(kept)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    assert main(["quantize", str(TINY), "-o", str(tmp_path / "x"), "--quiet"]) == 2
    assert main(["quantize", str(tmp_path / "none"), "-o", str(tmp_path / "y"), "--quiet"]) == 2
    # the mixed MoE layout needs routed experts; a dense model is refused before anything is written
    assert main(["quantize", str(TINY), "-o", str(tmp_path / "z"), "--format", "nvfp4-experts-fp8", "--quiet"]) == 2
    assert not (tmp_path / "z").exists()


def test_bf16_source(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "bf16"
    src.mkdir()
    save_file({n: t.to(torch.bfloat16) for n, t in tensors(TINY).items()}, str(src / "model.safetensors"))
    (src / "config.json").write_text((TINY / "config.json").read_text())
    summary = quantize_checkpoint(src, tmp_path / "q", progress=False)
    assert summary.quantized_bytes_before == summary.quantized_bytes_bf16
    assert summary.total_bytes_before == sum(t.numel() * 2 for t in tensors(TINY).values())
    state = tensors(tmp_path / "q")
    p = "model.layers.0.mlp.gate_proj"
    w = tensors(src)[f"{p}.weight"].float()
    dq = dequantize(state[f"{p}.weight_packed"], state[f"{p}.weight_scale"], state[f"{p}.weight_global_scale"])
    assert (dq - w).norm() / w.norm() < 0.12
    assert state["model.norm.weight"].dtype == torch.bfloat16
