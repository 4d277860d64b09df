"""The core attention of the Megatron backend's layers: softmax(q k^T * scale, causal) v over torch's
`scaled_dot_product_attention`, in megatron-core's core-attention protocol (the constructor keywords
its `SelfAttention` and `MLASelfAttention` pass; [s, b, heads, d] in, [s, b, heads x v_d] out).

Invariant: no [s, s] tensor is allocated or kept for backward. Masking is causal inside the kernel,
with no mask tensor: `MegatronPolicy.forward` packs each row's real tokens first (model.py), so a
causal mask is the whole mask. For backward the kernel keeps q, k, v, its output and one float32
log-sum-exp per head and token: memory grows linearly with the sequence, where megatron's local
`DotProductAttention` keeps [b x heads, s, s] float32 scores and their softmax per layer.

Kernels: on CPU torch's flash kernel (float32 and bfloat16, causal, GQA) takes one head width for
q, k and v; with MLA's narrower values torch falls back to its math path, which materialises the
[b, heads, s, s] scores (measured), so there the values are zero-padded to the key width and the
output cut back. On CUDA the flash kernel (16-bit) or the memory-efficient one (which takes a
narrower value) serves without padding; unverified here (no GPU).

With Transformer Engine installed and a 16-bit model, `core_attention` picks megatron's
`TEDotProductAttention` instead (TE's fused kernels; in float32 TE falls back to an unfused
attention with s x s scores). That path needs a GPU and is tested only there.
"""

import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


def core_attention(dtype: torch.dtype) -> type:
    """The core attention class for the layer specs: Transformer Engine's for a 16-bit model when
    it is installed (GPU only), else `SdpaAttention`."""
    from megatron.core.extensions import transformer_engine

    if transformer_engine.HAVE_TE and dtype in (torch.bfloat16, torch.float16):  # GPU only: tested there
        return transformer_engine.TEDotProductAttention
    return SdpaAttention


class SdpaAttention(MegatronModule):
    """Causal attention without dropout, any query-group count (GQA), and keys wider than values
    (MLA: qk head dim nope + rope, v head dim its own)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection=None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {"attention dropout": dropout != 0.0,
                       "a mask other than causal": attn_mask_type != AttnMaskType.causal,
                       "context parallelism": config.context_parallel_size != 1,
                       "sliding-window attention": config.window_size is not None,
                       "a softmax other than vanilla": config.softmax_type != "vanilla",
                       "query-key layer scaling": config.apply_query_key_layer_scaling,
                       "qk_clip / log_max_attention_logit": config.qk_clip or config.log_max_attention_logit}
        named = [what for what, present in unsupported.items() if present]
        assert not named, f"SdpaAttention does not compute {', '.join(named)} (build.py sets none of them)"
        # megatron's default: 1/sqrt(key width); MLA passes its own (YaRN's mscale^2 / sqrt(qk head dim))
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: None,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        """query [s, b, heads, qk_d], key [s, b, groups, qk_d], value [s, b, groups, v_d]
        -> [s, b, heads x v_d]."""
        assert attention_mask is None, "rows come packed real-first (MegatronPolicy.forward): causal is the mask"
        assert attention_bias is None and packed_seq_params is None
        assert attn_mask_type in (None, AttnMaskType.causal), attn_mask_type
        s, b, heads, width = *query.shape[:3], value.shape[-1]
        # the kernel keeps q, k and v for backward: a value that is a view of megatron's fused q/k/v
        # projection output would keep all of it alive; a copy of the value alone is smaller
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value.contiguous()))  # [b, heads, s, d]
        if width != q.shape[-1] and q.device.type == "cpu":  # CPU's flash kernel takes one head width
            v = F.pad(v, (0, q.shape[-1] - width))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != heads)
        return out[..., :width].permute(2, 0, 1, 3).reshape(s, b, heads * width)
