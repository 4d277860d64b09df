"""What the Megatron backend builds, checked against the run config and the model's HF config at
trainer start-up, before anything is loaded: every setting it does not build is named in one
UserError (the config-only part runs at submit time already: `config.support.megatron_unsupported`)."""

from ...errors import UserError
from . import convert
from .build import rope_parameters, yarn_unsupported
from .lora import LINEARS


MODEL_TYPES = ("llama", "mistral", "qwen3", "qwen3_moe", "deepseek_v3")


def check_supported(config, hf_config, world_size: int) -> None:
    """UserError for every setting this backend does not build yet (rather than a late failure); the
    config-only part already ran at submit time (config.support.megatron_unsupported)."""
    from ...config.support import megatron_unsupported

    t, lora_cfg = config.trainer, config.lora
    tensor_parallel, pipeline_parallel, expert_parallel = t.tensor_parallel, t.pipeline_parallel, t.expert_parallel
    missing = megatron_unsupported(config)
    if world_size % (tensor_parallel * pipeline_parallel):
        missing.append(f"{world_size} trainer ranks: trainer.tensor_parallel x trainer.pipeline_parallel "
                       f"({tensor_parallel} x {pipeline_parallel}) must divide them")
    if world_size % (expert_parallel * pipeline_parallel):
        missing.append(f"{world_size} trainer ranks: trainer.expert_parallel x trainer.pipeline_parallel "
                       f"({expert_parallel} x {pipeline_parallel}) must divide them")
    if hf_config.num_hidden_layers % pipeline_parallel:
        missing.append(f"{hf_config.num_hidden_layers} layers over trainer.pipeline_parallel {pipeline_parallel} "
                       "stages (it must divide the layer count)")
    model_type = getattr(hf_config, "model_type", "?")
    if model_type not in MODEL_TYPES or getattr(hf_config, "hidden_act", "silu") != "silu":
        missing.append(f"model type {model_type} ({', '.join(MODEL_TYPES)} only)")
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    if window:
        missing.append(f"sliding-window attention (sliding_window {window})")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        missing.append("attention/MLP biases")
    rope = rope_parameters(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn" and model_type == "deepseek_v3":  # megatron's MLA has YaRN
        missing += yarn_unsupported(hf_config)
    elif rope_type != "default":
        missing.append(f"RoPE scaling {rope_type}" + (" (YaRN on MLA models only)" if rope_type == "yarn" else ""))
    if model_type == "deepseek_v3":
        missing += _deepseek_unsupported(hf_config, tensor_parallel, expert_parallel)
    elif model_type == "qwen3_moe":
        missing += _qwen3_moe_unsupported(hf_config, tensor_parallel, expert_parallel)
    elif hf_config.num_key_value_heads % tensor_parallel:
        missing.append(f"trainer.tensor_parallel {tensor_parallel} must divide the KV heads")
    elif expert_parallel != 1:
        missing.append(f"trainer.expert_parallel {expert_parallel} on a dense model (it has no experts)")
    if config.algorithm.routing_replay and model_type != "deepseek_v3":
        missing.append("algorithm.routing_replay on a dense model (it has no routers)" if model_type != "qwen3_moe"
                       else "algorithm.routing_replay on a qwen3_moe model (DeepSeek-V3's routers only)")
    if config.model.quantization != "none" and model_type != "deepseek_v3":
        missing.append(f"model.quantization: {config.model.quantization} on a dense model (this backend keeps the "
                       "routed experts of a MoE model packed; it would dequantise every weight of this one)")
    if hf_config.vocab_size % tensor_parallel:
        missing.append(f"trainer.tensor_parallel {tensor_parallel} must divide the vocabulary")
    adaptable = _adaptable(convert.Shape.from_hf(hf_config))
    unknown = set(lora_cfg.target_modules) - adaptable
    if unknown:
        missing.append(f"LoRA on {sorted(unknown)} (this backend adapts {sorted(adaptable)}; "
                       "on a MoE model the routed experts are not adapted, with tied embeddings lm_head is not)")
    if missing:
        raise UserError("trainer.backend: megatron does not support " + "; ".join(missing) +
                        " — use trainer.backend: fsdp2")


def _adaptable(shape: convert.Shape) -> set[str]:
    """The HF projection names LoRA can adapt in a model of this shape (`lora.LINEARS` it has)."""
    kinds = ["self_attention.linear_proj"]
    kinds += ["self_attention.linear_q_", "self_attention.linear_kv_"] if shape.mla else ["self_attention.linear_qkv"]
    kinds += ["mlp.linear_fc"] if shape.dense_layers != 0 else []
    kinds += ["mlp.shared_experts."] if shape.shared_experts else []
    names = {p.rsplit(".", 1)[1] for path, (_, ps) in LINEARS.items() if path.startswith(tuple(kinds)) for p in ps}
    return names | ({"lm_head"} if not shape.tied else set())  # a tied lm_head is the (frozen) embedding


def _qwen3_moe_unsupported(hf, tensor_parallel: int, expert_parallel: int) -> list[str]:
    """What of a Qwen3-MoE config this backend would build otherwise than transformers does."""
    missing = []
    if hf.mlp_only_layers or hf.decoder_sparse_step != 1:
        missing.append(f"Qwen3-MoE dense layers (mlp_only_layers {hf.mlp_only_layers}, decoder_sparse_step "
                       f"{hf.decoder_sparse_step}): every layer must be MoE")
    if hf.num_key_value_heads % tensor_parallel:
        missing.append(f"trainer.tensor_parallel {tensor_parallel} must divide the KV heads")
    if hf.num_experts % expert_parallel:
        missing.append(f"trainer.expert_parallel {expert_parallel} must divide the {hf.num_experts} routed experts")
    return missing


def _deepseek_unsupported(hf, tensor_parallel: int, expert_parallel: int) -> list[str]:
    """What of a DeepSeek-V3-architecture config megatron's MLA and MoE layers would compute otherwise
    than transformers does."""
    missing = []
    if hf.q_lora_rank is None:
        missing.append("MLA without a query LoRA rank (q_lora_rank: null)")
    if not getattr(hf, "rope_interleave", True):
        missing.append("MLA with rope_interleave: false (megatron's MLA reads the RoPE channels interleaved)")
    split = {"attention heads": hf.num_attention_heads, "intermediate_size": hf.intermediate_size,
             "the shared experts' width": hf.n_shared_experts * hf.moe_intermediate_size}
    for what, size in split.items():  # the TP-split output rows (MLA's down projections are whole: build.py)
        if size % tensor_parallel:
            missing.append(f"trainer.tensor_parallel {tensor_parallel} must divide the {what} ({size})")
    if hf.scoring_func != "sigmoid" or hf.topk_method != "noaux_tc" or not hf.norm_topk_prob:
        missing.append(f"router scoring_func {hf.scoring_func} / topk_method {hf.topk_method} / norm_topk_prob "
                       f"{hf.norm_topk_prob} (sigmoid, noaux_tc, normalised top-k only)")
    if hf.n_group > 1 and hf.num_experts_per_tok // hf.topk_group != 2:
        missing.append(f"group-limited routing with num_experts_per_tok // topk_group = "
                       f"{hf.num_experts_per_tok // hf.topk_group} (megatron scores a group by that many experts, "
                       "transformers by its top 2)")
    if hf.n_routed_experts % expert_parallel:
        missing.append(f"trainer.expert_parallel {expert_parallel} must divide the {hf.n_routed_experts} routed experts")
    return missing
