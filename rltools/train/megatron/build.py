"""megatron-core's GPTModel for an HF config: its TransformerConfig and layer spec (the local spec,
with a core attention whose memory is linear in the sequence: `attention.py`), for a Llama-family
model or a DeepSeek-V3 one (megatron's MLA attention and MoE layers), and the mends megatron-core
0.16.1 needs to build the latter without Transformer Engine."""

import torch
from torch import nn

from ...versions import MEGATRON_CORE, require_tested
from . import convert
from .packed import pack_expert_specs


# Every layer keeps only its input for backward and runs its forward again there (megatron's
# `tensor_parallel.checkpoint`, which also replays the RNG states of its model-parallel tracker).
_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def build_gpt(hf, dtype: torch.dtype, tensor_parallel: int, pipeline_parallel: int, *, pre_process: bool,
              post_process: bool, recompute: bool = False, packed_experts: bool = False) -> nn.Module:
    """`packed_experts`: the routed experts' linears hold NVFP4 triples (`packed.py`)."""
    require_tested(MEGATRON_CORE)  # its private code, reached from here, is listed in rltools/versions.py
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from .attention import core_attention

    shape = convert.Shape.from_hf(hf)
    common = dict(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads, normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu_initialization=True,
        perform_initialization=False,  # every weight is overwritten from the checkpoint
        variable_seq_lengths=True,  # micro batches are as long as their own samples: stages swap shapes
        moe_token_dispatcher_type="alltoall",  # dense models use none; megatron refuses its default here
        # megatron's MoE layer takes TP only with sequence parallelism: between the TP regions each
        # rank holds 1/TP of the sequence (so it must divide the sequence: MegatronPolicy pads it)
        sequence_parallel=tensor_parallel > 1 and shape.experts > 0,
        **(_RECOMPUTE if recompute else {}),
    )
    rotary_base = int(rope_parameters(hf).get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    if shape.experts:
        _without_transformer_engine()
        moe = _moe(hf, shape)
        if shape.mla:
            config = MLATransformerConfig(
                **common, kv_channels=hf.v_head_dim, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                qk_head_dim=hf.qk_nope_head_dim, qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                qk_layernorm=True, rotary_base=rotary_base, **mla_rope(hf), **moe)
        else:
            config = TransformerConfig(**common, num_query_groups=hf.num_key_value_heads, kv_channels=shape.head_dim,
                                       qk_layernorm=shape.qk_norm, **moe)
        spec = _with_frozen_norms(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                             normalization="RMSNorm"))
        if packed_experts:
            pack_expert_specs(spec)
        for layer_spec in spec.layer_specs:
            attention = layer_spec.submodules.self_attention.submodules
            attention.core_attention = core_attention(dtype)
            if shape.mla:
                attention.linear_q_down_proj = attention.linear_kv_down_proj = _replicated_linear()
    else:
        config = TransformerConfig(**common, num_query_groups=hf.num_key_value_heads, kv_channels=shape.head_dim,
                                   qk_layernorm=shape.qk_norm)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm)
        spec.submodules.self_attention.submodules.core_attention = core_attention(dtype)
    gpt = GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
        position_embedding_type="none" if shape.mla else "rope", rotary_base=rotary_base,
        share_embeddings_and_output_weights=shape.tied and pipeline_parallel == 1, parallel_output=False,
        pre_process=pre_process, post_process=post_process,
    )
    if recompute and pre_process:
        # megatron's recompute is a reentrant autograd Function: its output needs a gradient only if
        # its input does, and the frozen embedding's output needs none — without this the LoRA
        # weights inside the layers would get no gradient (later stages receive inputs that do).
        gpt.embedding.register_forward_hook(_output_needs_grad)
    return gpt


def _moe(hf, shape: convert.Shape) -> dict:
    """The MoE settings of megatron's TransformerConfig that compute what transformers' model does:
    DeepSeek-V3's sigmoid scores with the correction bias, groups and a scaling factor, and shared
    experts; Qwen3-MoE's softmax (over the top-k logits when norm_topk_prob renormalises them, else
    over all experts first) and no shared expert."""
    common = dict(num_moe_experts=shape.experts, moe_ffn_hidden_size=hf.moe_intermediate_size,
                  moe_router_topk=hf.num_experts_per_tok,
                  moe_router_dtype="fp32",  # transformers scores the router in float32 too
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,  # the router is frozen
                  moe_layer_freq=[int(shape.is_moe(i)) for i in range(hf.num_hidden_layers)])
    if not shape.expert_bias:  # Qwen3-MoE
        return {**common, "moe_router_score_function": "softmax", "moe_router_pre_softmax": not hf.norm_topk_prob}
    return dict(
        **common, moe_shared_expert_intermediate_size=hf.n_shared_experts * hf.moe_intermediate_size or None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=hf.routed_scaling_factor,
        moe_router_num_groups=hf.n_group if hf.n_group > 1 else None,
        moe_router_group_topk=hf.topk_group if hf.n_group > 1 else None)


def rope_parameters(hf) -> dict:
    """An HF config's RoPE settings (`rope_parameters`, or the older `rope_scaling`)."""
    return getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}


def mla_rope(hf) -> dict:
    """MLATransformerConfig's RoPE settings for an HF DeepSeek-V3 config: plain, or YaRN as
    transformers computes it (inverse frequencies ramped between `beta_fast` and `beta_slow`, cos/sin
    scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), softmax by mscale(factor,
    mscale_all_dim)^2); what megatron cannot express, `yarn_unsupported` names."""
    rope = rope_parameters(hf)
    if rope.get("rope_type", rope.get("type", "default")) != "yarn":
        return {"rope_type": "rope"}
    original = rope["original_max_position_embeddings"]
    return {"rope_type": "yarn", "rotary_scaling_factor": float(rope.get("factor") or hf.max_position_embeddings / original),
            "original_max_position_embeddings": original, "beta_fast": float(rope.get("beta_fast") or 32),
            "beta_slow": float(rope.get("beta_slow") or 1), "mscale": float(rope.get("mscale") or 1.0),
            "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}


def yarn_unsupported(hf) -> list[str]:
    """The YaRN settings of an HF config that megatron's YaRN would compute otherwise."""
    rope = rope_parameters(hf)
    missing = []
    if rope.get("attention_factor") is not None:
        missing.append("YaRN with an explicit attention_factor")
    if rope.get("mscale_all_dim") and not rope.get("mscale"):  # transformers then ignores mscale_all_dim for cos/sin
        missing.append("YaRN with mscale_all_dim but no mscale")
    if rope.get("truncate", True) is not True:
        missing.append("YaRN with truncate: false")
    return missing


def _without_transformer_engine() -> None:
    """megatron-core 0.16.1 without Transformer Engine: its MLA module takes TE for present (the TE
    extension defines `TELinear` on a mock, so `isinstance(..., TELinear)` raises) and its router's
    gating function reads a `te_general_gemm` that is then never defined. Say they are absent."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None


def _replicated_linear():
    """The MLA down projections whole on every TP rank (megatron's TE spec does the same), not split
    over TP as in its local spec: there, the RoPE key part of the KV down projection's output is
    used by every head after an all-gather whose backward only splits, so each rank keeps the
    gradient of its own heads and the input gradient is wrong under TP (measured: the LoRA
    gradients of every layer below 3% off). Whole, the key part is gathered over the sequence-
    parallel region, whose backward sums it over the TP ranks."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.Linear = Linear  # None without TE: MLA accepts only the classes it names
    return Linear


def _with_frozen_norms(spec):
    """`spec` with megatron's torch norm wrapper replaced by one that also builds under sequence
    parallelism, which the wrapper refuses because a norm's weight gradient is then partial on each
    TP rank and nothing all-reduces it. This backend never trains the norms (only LoRA adapters),
    so no such gradient exists."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def walk(node):
        if node is WrappedTorchNorm:
            return _FrozenRMSNorm
        if isinstance(node, ModuleSpec):
            node.submodules = walk(node.submodules)
        elif isinstance(node, list):
            return [walk(n) for n in node]
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                setattr(node, field.name, walk(getattr(node, field.name)))
        return node

    return walk(spec)


class _FrozenRMSNorm:
    """Builds what megatron's torch norm wrapper builds for RMSNorm (a module spec is a class)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_) -> nn.Module:
        return nn.RMSNorm(hidden_size, eps=eps)


def _output_needs_grad(module, args, output: torch.Tensor) -> torch.Tensor:
    return output.requires_grad_(True) if torch.is_grad_enabled() else output
