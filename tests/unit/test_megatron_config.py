"""What the Megatron backend does not build yet stops the trainer at start-up with a UserError that
names it, before any model is loaded."""

from types import SimpleNamespace

import pytest

from rltools.config.schema import LoraConfig, ModelConfig, RLConfig
from rltools.errors import UserError
from tests.conftest import REPO

pytest.importorskip("torch")

LLAMA = SimpleNamespace(model_type="llama", hidden_act="silu", num_key_value_heads=4, vocab_size=100, num_hidden_layers=4,
                        hidden_size=64, num_attention_heads=4, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def check(lora=LoraConfig(), model=ModelConfig(path="m"), hf=LLAMA, tp=2, pp=1, ep=1, world=2, algorithm=None):
    from rltools.train.megatron.support import check_supported

    config = RLConfig(run={"name": "t"}, model=model, lora=lora, algorithm=algorithm or {}, trainer={
        "backend": "megatron", "tensor_parallel": tp, "pipeline_parallel": pp, "expert_parallel": ep})
    check_supported(config, hf, world)


@pytest.mark.parametrize("kwargs", [dict(), dict(tp=1, pp=2), dict(tp=2, pp=2, world=8), dict(tp=1, pp=4, world=4),
                                    dict(lora=LoraConfig(target_modules=["q_proj", "lm_head"]))])
def test_a_supported_setup_passes(kwargs):
    check(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(tp=1, world=1), dict(tp=1, ep=2), dict(tp=1, ep=2, world=4),
                                    dict(tp=1, ep=8, world=8), dict(tp=1, pp=2, ep=2, world=4, layers=4),
                                    dict(tp=2, ep=2, world=4), dict(tp=2, pp=2, ep=2, world=8, layers=4),
                                    dict(tp=2, ep=2, world=4, kv_lora_rank=31)])  # MLA's down projections are whole
def test_a_deepseek_v3_model_trains_with_expert_pipeline_and_data_parallelism(kwargs):
    extra = {"kv_lora_rank": kwargs.pop("kv_lora_rank")} if "kv_lora_rank" in kwargs else {}
    hf = _deepseek(num_hidden_layers=kwargs.pop("layers", 3), **extra, rope_parameters={  # DeepSeek-V3's own RoPE
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    check(hf=hf, lora=LoraConfig(target_modules=["q_a_proj", "kv_b_proj", "gate_proj", "lm_head"]), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=1, pp=3, world=3), "layer count"),
    (dict(tp=2, pp=2, world=6), r"tensor_parallel x trainer.pipeline_parallel \(2 x 2\) must divide them"),
    (dict(ep=4), "expert_parallel"),
    (dict(world=3), "must divide them"),
    (dict(lora=LoraConfig(enabled=False)), "full fine-tuning"),
    (dict(lora=LoraConfig(dropout=0.1)), "lora.dropout"),
    (dict(algorithm={"routing_replay": True}), "routing_replay on a dense model"),
    (dict(model=ModelConfig(path="m", quantization="nvfp4")), "nvfp4 on a dense model"),
    (dict(hf=SimpleNamespace(**{**vars(LLAMA), "model_type": "gemma3"})), r"model type gemma3 \(llama, mistral, qwen3"),
    (dict(hf=SimpleNamespace(**{**vars(LLAMA), "rope_parameters": {"rope_type": "yarn", "factor": 4}})),
     r"RoPE scaling yarn \(YaRN on MLA models only\)"),
    (dict(tp=8, world=8), "must divide"),
    (dict(hf=SimpleNamespace(**{**vars(LLAMA), "tie_word_embeddings": True}),
          lora=LoraConfig(target_modules=["lm_head"])), r"LoRA on \['lm_head'\].*with tied embeddings"),
])
def test_unbuilt_settings_fail_with_what_is_missing(kwargs, message):
    with pytest.raises(UserError, match=message) as error:
        check(**kwargs)
    assert "trainer.backend: fsdp2" in str(error.value)


def test_without_cuda_the_backend_says_so():
    import torch

    from rltools.train.megatron.backend import _require_cuda

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(UserError, match="megatron needs CUDA GPUs.*trainer.backend: fsdp2"):
        _require_cuda()


def test_settings_the_backend_lacks_fail_at_submit_time_already(repo):
    """`rltools submit --dry-run` (no torch) refuses them before the job waits for its nodes."""
    from rltools.config import load_config
    from rltools.launch.plan import plan

    config = load_config(repo / "configs" / "demo.yaml", ["trainer.backend=megatron", "lora.dropout=0.1"])
    with pytest.raises(UserError, match="lora.dropout.*use trainer.backend: fsdp2"):
        plan(config)


def _deepseek(**changes):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(REPO / "rltools" / "assets" / "tiny-moe-arith")
    for key, value in changes.items():
        setattr(hf, key, value)
    return hf


@pytest.mark.parametrize("changes, kwargs, message", [
    (dict(), dict(tp=1, pp=2, world=2), "layer count"),
    (dict(), dict(tp=3, world=3), r"tensor_parallel 3 must divide the attention heads \(4\)"),
    (dict(intermediate_size=343), dict(tp=2), r"must divide the intermediate_size \(343\)"),
    (dict(), dict(tp=1, ep=3, world=3), "expert_parallel 3 must divide the 8 routed experts"),
    (dict(rope_interleave=False), dict(tp=1), "rope_interleave: false"),
    (dict(q_lora_rank=None), dict(tp=1), "q_lora_rank: null"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4, "original_max_position_embeddings": 16,
                           "attention_factor": 1.2}), dict(tp=1), "explicit attention_factor"),
    (dict(scoring_func="softmax"), dict(tp=1), "scoring_func softmax"),
    (dict(n_group=4, topk_group=2), dict(tp=1), "num_experts_per_tok // topk_group = 1"),
    (dict(), dict(tp=1, lora=LoraConfig(target_modules=["q_a_proj", "q_proj"])), r"LoRA on \['q_proj'\]"),
])
def test_a_deepseek_v3_model_is_refused_with_what_is_missing(changes, kwargs, message):
    with pytest.raises(UserError, match=message):
        check(hf=_deepseek(**changes), **kwargs)


def test_a_llama_model_refuses_the_mla_projections_it_does_not_have():
    with pytest.raises(UserError, match=r"LoRA on \['q_a_proj'\]"):
        check(lora=LoraConfig(target_modules=["q_proj", "q_a_proj"]))


def test_a_dense_model_has_no_experts_to_spread():
    with pytest.raises(UserError, match="expert_parallel 2 on a dense model"):
        check(tp=1, ep=2)
