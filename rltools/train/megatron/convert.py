"""Hugging Face Llama-family (Llama, Mistral, Qwen3) or DeepSeek-V3 <-> Megatron GPTModel weights, and
their tensor-parallel shards.

Pure tensor functions, no process groups. Invariants:
- `to_megatron` and `to_hf` are exact inverses (they only copy, concatenate and slice).
- Megatron fuses q/k/v into `linear_qkv`, grouped by query group: for each of the `kv_heads` groups,
  its q heads, then its k head, then its v head. gate/up are fused into `linear_fc1` as [gate; up].
- A TP shard of `linear_qkv` is a contiguous block of whole query groups; a shard of `linear_fc1` is
  [gate shard; up shard]; `linear_proj`/`linear_fc2` split their input dimension; embeddings and the
  output layer split the vocabulary; norms are replicated.
- DeepSeek-V3 (MLA + MoE): each MLA projection is one HF tensor, split over TP along its output
  (the down projections too: megatron gathers their outputs); the shared experts are split as a
  dense MLP; routed experts are named by their global index and are never split over TP (expert
  tensor parallelism is 1: expert parallelism spreads whole experts); the router and its score
  correction bias are replicated.
- Qwen3's per-head q/k norms (`self_attn.q_norm`) are megatron's `q_layernorm`/`k_layernorm`, replicated.
"""

from dataclasses import dataclass

import torch


# MLA projection (megatron, under `self_attention.`) -> its HF projection (under `self_attn.`)
MLA = {"linear_q_down_proj": "q_a_proj", "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
       "linear_kv_up_proj": "kv_b_proj", "q_layernorm": "q_a_layernorm", "kv_layernorm": "kv_a_layernorm"}


QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # model types whose attention norms each query and key head


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # tie_word_embeddings: the output layer is the embedding
    mla: bool = False  # DeepSeek-V3: multi-latent attention
    dense_layers: int | None = None  # the first layers with a dense MLP, the others MoE (None: all dense)
    experts: int = 0  # routed experts per MoE layer
    shared_experts: bool = False
    qk_norm: bool = False  # Qwen3: an RMS norm over each query and key head, before RoPE
    expert_bias: bool = False  # DeepSeek-V3's router score correction bias


    @classmethod
    def from_hf(cls, config) -> "Shape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None) or 0
        deepseek = hasattr(config, "n_routed_experts")
        return cls(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   bool(config.tie_word_embeddings), mla=getattr(config, "kv_lora_rank", None) is not None,
                   # Qwen3-MoE: every layer (support.py refuses mlp_only_layers and a decoder_sparse_step)
                   dense_layers=(config.first_k_dense_replace if deepseek else 0) if experts else None,
                   experts=experts, shared_experts=bool(experts) and bool(getattr(config, "n_shared_experts", 0)),
                   qk_norm=getattr(config, "model_type", None) in QK_NORM_TYPES, expert_bias=bool(experts) and deepseek)

    def is_moe(self, layer: int) -> bool:
        return self.dense_layers is not None and layer >= self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        """The global indices of the MoE layers (routing replay numbers them 0, 1, ... in this order)."""
        return [i for i in range(self.layers) if self.is_moe(i)]


def name_map(shape: Shape) -> dict[str, tuple[str, ...]]:
    """Megatron name -> the HF names it is made of (in fusion order); routed experts by global index."""
    names = {"embedding.word_embeddings.weight": ("model.embed_tokens.weight",)}
    for i in range(shape.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        names[m + "input_layernorm.weight"] = (h + "input_layernorm.weight",)
        if shape.mla:
            for megatron, hf in MLA.items():
                names[f"{m}self_attention.{megatron}.weight"] = (f"{h}self_attn.{hf}.weight",)
        else:
            names[m + "self_attention.linear_qkv.weight"] = tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv")
        if shape.qk_norm:
            for p in "qk":
                names[f"{m}self_attention.{p}_layernorm.weight"] = (f"{h}self_attn.{p}_norm.weight",)
        names[m + "self_attention.linear_proj.weight"] = (h + "self_attn.o_proj.weight",)
        names[m + "pre_mlp_layernorm.weight"] = (h + "post_attention_layernorm.weight",)
        mlps = {"mlp.": "mlp."}
        if shape.is_moe(i):
            names[m + "mlp.router.weight"] = (h + "mlp.gate.weight",)
            if shape.expert_bias:
                names[m + "mlp.router.expert_bias"] = (h + "mlp.gate.e_score_correction_bias",)
            mlps = {f"mlp.experts.local_experts.{e}.": f"mlp.experts.{e}." for e in range(shape.experts)}
            if shape.shared_experts:
                mlps["mlp.shared_experts."] = "mlp.shared_experts."
        for megatron, hf in mlps.items():
            names[f"{m}{megatron}linear_fc1.weight"] = (f"{h}{hf}gate_proj.weight", f"{h}{hf}up_proj.weight")
            names[f"{m}{megatron}linear_fc2.weight"] = (f"{h}{hf}down_proj.weight",)
    names["decoder.final_layernorm.weight"] = ("model.norm.weight",)
    if not shape.tied:
        names["output_layer.weight"] = ("lm_head.weight",)
    return names


def to_megatron(name: str, hf: list[torch.Tensor], shape: Shape) -> torch.Tensor:
    """Fuse the HF tensors of one Megatron weight (full, unsharded)."""
    if name.endswith("linear_qkv.weight"):
        q, k, v = hf
        per_group = shape.heads // shape.kv_heads
        groups = [t.reshape(shape.kv_heads, -1, t.shape[-1]) for t in (q, k, v)]
        assert groups[0].shape[1] == per_group * shape.head_dim
        return torch.cat(groups, dim=1).reshape(-1, q.shape[-1])
    if name.endswith("linear_fc1.weight"):
        return torch.cat(hf, dim=0)
    (tensor,) = hf
    return tensor


def to_hf(name: str, tensor: torch.Tensor, shape: Shape) -> list[torch.Tensor]:
    """Split one full Megatron weight into its HF tensors (the inverse of `to_megatron`)."""
    if name.endswith("linear_qkv.weight"):
        q_rows = shape.heads // shape.kv_heads * shape.head_dim
        grouped = tensor.reshape(shape.kv_heads, q_rows + 2 * shape.head_dim, -1)
        q, k, v = grouped.split([q_rows, shape.head_dim, shape.head_dim], dim=1)
        return [t.reshape(-1, tensor.shape[-1]).contiguous() for t in (q, k, v)]
    if name.endswith("linear_fc1.weight"):
        return [t.contiguous() for t in tensor.chunk(2, dim=0)]
    return [tensor]


def split_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits a Megatron weight along (None: replicated)."""
    if ".mlp.experts." in name:  # routed experts: expert tensor parallelism is 1
        return None
    if name.endswith(("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight",
                      "_up_proj.weight")):  # MLA's up projections (its down projections are whole: build.py)
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank `rank`'s shard of a full Megatron weight."""
    dim = split_dim(name)
    if dim is None or size == 1:
        return full
    if name.endswith("linear_fc1.weight"):  # [gate; up]: each half is split, then re-fused
        return torch.cat([half.chunk(size, dim=0)[rank] for half in full.chunk(2, dim=0)], dim=0).contiguous()
    return full.chunk(size, dim=dim)[rank].contiguous()


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron weight from every TP rank's shard (the inverse of `shard`)."""
    dim = split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])], dim=0)
    return torch.cat(shards, dim=dim)
