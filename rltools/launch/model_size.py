"""How big a model is, from its config.json and (when readable) its safetensors headers: parameter
counts, the bytes its weights take in memory, the LoRA parameters of the targeted modules, and what
one token costs in activations and in KV cache.

Invariant: light (json, re, struct: it runs on a login node) and never reads a tensor. Formulas and
the published figures they are checked against: docs/memory.md.
"""

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..fused_layers import FUSED

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NVFP4_BYTES = 9 / 16  # a 4-bit value plus one FP8 scale per 16 values (a float32 global scale per tensor: noise)
STORED_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1, "I16": 2,
                "I32": 4, "I64": 8, "BOOL": 1}
QUANT_PARTS = ("weight_packed", "weight_scale", "weight_global_scale", "weight_scale_inv", "weight_scale_2")
KEPT = re.compile(r".*(embed|lm_head|norm|mlp\.gate$|router).*")  # never quantised (quant.layout.DEFAULT_IGNORE)
LAYER = re.compile(r".*\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Linear:
    name: str  # the module's leaf name, as lora.target_modules names it
    fan_in: int
    fan_out: int
    count: int  # how many the model has
    expert: bool = False  # a routed expert's projection: held fused in memory, never adapted


@dataclass(frozen=True)
class Shape:
    """The dimensions of a dense (Llama/Qwen/Mistral) or MLA + MoE (DeepSeek-V3) decoder."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    max_positions: int | None = None
    gated_mlp: bool = True  # SwiGLU (gate, up, down); False: a GPT-style 2-matrix MLP
    kv_lora_rank: int = 0  # MLA when > 0
    q_lora_rank: int = 0
    qk_rope: int = 0
    qk_nope: int = 0
    v_head: int = 0
    experts: int = 0  # routed experts per MoE layer
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # all shared experts of a layer together
    dense_layers: int = 0  # leading layers with a dense MLP in an MoE model
    top_k: int = 0

    @classmethod
    def from_config(cls, c: dict) -> "Shape":
        c = c.get("text_config", c)
        heads = c["num_attention_heads"]
        experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
        expert_i = c.get("moe_intermediate_size") or c["intermediate_size"]
        shared = c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * expert_i
        return cls(
            hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate=c.get("intermediate_size") or 4 * c["hidden_size"], vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)), max_positions=c.get("max_position_embeddings"),
            kv_lora_rank=c.get("kv_lora_rank") or 0, q_lora_rank=c.get("q_lora_rank") or 0,
            qk_rope=c.get("qk_rope_head_dim") or 0, qk_nope=c.get("qk_nope_head_dim") or 0,
            v_head=c.get("v_head_dim") or 0, experts=experts, expert_intermediate=expert_i if experts else 0,
            shared_intermediate=shared if experts else 0,
            dense_layers=(c.get("first_k_dense_replace") or len(c.get("mlp_only_layers") or ())) if experts else 0,
            top_k=c.get("num_experts_per_tok") or 0,
        )

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def linears(self) -> list[Linear]:
        """Every linear projection of the decoder layers (not the embeddings and the head)."""
        h, n, L = self.hidden, self.heads, self.layers
        if self.mla:
            qk = self.qk_nope + self.qk_rope
            attn = [Linear("q_a_proj", h, self.q_lora_rank, L), Linear("q_b_proj", self.q_lora_rank, n * qk, L)] \
                if self.q_lora_rank else [Linear("q_proj", h, n * qk, L)]
            attn += [Linear("kv_a_proj_with_mqa", h, self.kv_lora_rank + self.qk_rope, L),
                     Linear("kv_b_proj", self.kv_lora_rank, n * (self.qk_nope + self.v_head), L),
                     Linear("o_proj", n * self.v_head, h, L)]
        else:
            d = self.head_dim
            attn = [Linear("q_proj", h, n * d, L), Linear("k_proj", h, self.kv_heads * d, L),
                    Linear("v_proj", h, self.kv_heads * d, L), Linear("o_proj", n * d, h, L)]
        dense = L - self.moe_layers
        mlp = _mlp(h, self.intermediate, dense, self.gated_mlp) if dense else []
        if self.experts:
            moe, i = self.moe_layers, self.expert_intermediate
            mlp += [Linear(x.name, x.fan_in, x.fan_out, x.count * self.experts, expert=True) for x in _mlp(h, i, moe)]
            mlp += _mlp(h, self.shared_intermediate, moe) if self.shared_intermediate else []
            mlp.append(Linear("gate", h, self.experts, moe))  # the router (kept in high precision)
        return attn + mlp

    def params(self) -> tuple[int, int]:
        """(total, activated per token): decoder linears, embeddings, head; norms are left out (< 0.01%)."""
        total = active = self.vocab * self.hidden * (1 if self.tied else 2)
        for x in self.linears():
            size = x.fan_in * x.fan_out * x.count
            total += size
            active += size * self.top_k // self.experts if x.expert else size
        return total, active

    def largest_export_params(self) -> int:
        """The parameters of the biggest group FSDP2's streaming export holds whole at once: a decoder
        layer without its routed experts, the routed experts' gate and up projections of one layer
        (held fused: `experts.gate_up_proj`), or the embedding."""
        h, L = self.hidden, self.layers
        per_layer = {"dense": 0, "moe": 0}
        for x in self.linears():
            size = x.fan_in * x.fan_out
            if x.count == L:  # attention: in every layer
                per_layer["dense"] += size
                per_layer["moe"] += size
            elif x.expert:
                continue  # a group of their own, below
            elif x.count == self.moe_layers:  # shared experts, router
                per_layer["moe"] += size * x.count // self.moe_layers
            else:  # the dense layers' MLP
                per_layer["dense"] += size
        routed = 2 * self.experts * h * self.expert_intermediate if self.moe_layers else 0
        return max(per_layer["moe"] if self.moe_layers else 0, per_layer["dense"] if L > self.moe_layers else 0,
                   routed, self.vocab * h)

    def kv_elements(self, vllm: bool) -> int:
        """KV-cache values per token and layer: vLLM keeps MLA's compressed latent (kv_lora_rank +
        qk_rope_head_dim, shared by all heads); Hugging Face's cache (the trainer's) keeps the
        decompressed keys and values of every head."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope if vllm else self.heads * (self.qk_nope + self.qk_rope + self.v_head)
        return 2 * self.kv_heads * self.head_dim

    def saved_elements(self) -> float:
        """Values one decoder layer keeps for backward per token, averaged over the layers, with no
        dropout: the two norms' inputs, the attention's input, queries, keys, values and output, the
        MLP's input and intermediates (SwiGLU: gate, up, silu(gate), their product). Korthikanti et
        al. 2022's 34 s b h bytes for GPT is this count in 16 bits (32 s b h) plus two 1-byte dropout
        masks. No s x s scores: the Megatron backend's core attention (train/megatron/attention.py,
        torch's scaled_dot_product_attention) keeps q, k, v, its output and a float32 log-sum-exp
        per head (left out: < 0.5%); measured on its layers (float32, LoRA on every projection), the
        q, k, v and output it keeps are those counted here (on CPU, MLA's values and output are
        padded to the key width). transformers' sdpa (FSDP2) keeps the same where a fused kernel
        serves it."""
        h, n = self.hidden, self.heads
        if self.mla:
            qk = self.qk_nope + self.qk_rope
            attn = h + 2 * self.q_lora_rank + 2 * (self.kv_lora_rank + self.qk_rope) + 2 * n * qk + 2 * n * self.v_head
        else:
            attn = h + 2 * n * self.head_dim + self.kv_elements(vllm=False)
        widths = 4 if self.gated_mlp else 2
        dense = h + widths * self.intermediate
        moe = h + self.top_k * (2 * h + 4 * self.expert_intermediate) + 4 * self.shared_intermediate
        mlp = (dense * (self.layers - self.moe_layers) + moe * self.moe_layers) / self.layers
        return 2 * h + attn + mlp


def _mlp(h: int, i: int, count: int, gated: bool = True) -> list[Linear]:
    up = [Linear("gate_proj", h, i, count), Linear("up_proj", h, i, count)] if gated else [Linear("up_proj", h, i, count)]
    return up + [Linear("down_proj", i, h, count)]


@dataclass(frozen=True)
class Weights:
    """The base weights in memory, in bytes."""

    total: float
    experts: float  # the routed experts' share of total
    largest_layer: float  # the biggest decoder layer (FSDP2 gathers one at a time)
    outside_layers: float  # embeddings, head, final norm
    params: int
    source: str  # where the sizes come from


def linear_format(model_config: dict, quantize: bool) -> tuple[float | None, float | None]:
    """Bytes per value of (routed experts, other layer linears) when quantised; None: compute dtype.
    From config.json's quantization_config, or NVFP4 everywhere for a plain checkpoint that the
    roles quantise on load (model.quantization: nvfp4)."""
    q = model_config.get("quantization_config") or {}
    if q.get("quant_method") == "fp8":  # e.g. DeepSeek-V3 as published: 128x128-block FP8
        return 1.0, 1.0
    formats = {q.get("format")} | {g.get("format") for g in (q.get("config_groups") or {}).values()}
    if "nvfp4-pack-quantized" in formats:
        return NVFP4_BYTES, 1.0 if "float-quantized" in formats else NVFP4_BYTES
    return (NVFP4_BYTES, NVFP4_BYTES) if quantize else (None, None)


def weights_from_config(shape: Shape, model_config: dict, dtype_bytes: int, quantize: bool) -> Weights:
    experts_b, other_b = linear_format(model_config, quantize)
    outside = shape.vocab * shape.hidden * (1 if shape.tied else 2) * dtype_bytes
    total = outside
    experts = 0.0
    for x in shape.linears():
        size = x.fan_in * x.fan_out * x.count
        per_value = experts_b if x.expert else other_b
        nbytes = size * (dtype_bytes if per_value is None or x.name == "gate" else per_value)
        total += nbytes
        experts += nbytes if x.expert else 0
    layers = total - outside
    moe_share = (experts / shape.moe_layers) if shape.moe_layers else 0.0
    largest = (layers - experts) / shape.layers + moe_share
    return Weights(total, experts, largest, outside, shape.params()[0], "config.json")


def weights_from_headers(path: Path, shape: Shape, model_config: dict, dtype_bytes: int,
                         quantize: bool) -> Weights | None:
    """Exact sizes from the safetensors headers (names, dtypes, shapes): quantised tensors as stored,
    the others in the compute dtype. None when there are no readable safetensors files."""
    files = sorted(path.glob("*.safetensors"))
    stored_quantized = linear_format(model_config, False) != (None, None)
    per_layer: dict[int, float] = {}
    total = experts = outside = 0.0
    params = 0
    try:
        for file in files:
            for name, entry in safetensors_header(file).items():
                layer = LAYER.match(name)
                if layer and int(layer.group(1)) >= shape.layers:  # multi-token-prediction layers: not loaded
                    continue
                count = math.prod(entry["shape"])
                leaf = name.rpartition(".")[2]
                params += 2 * count if leaf == "weight_packed" else 0 if leaf in QUANT_PARTS else count
                if STORED_BYTES[entry["dtype"]] == 1 or leaf in QUANT_PARTS:
                    nbytes = count * STORED_BYTES[entry["dtype"]]
                elif quantize and not stored_quantized and layer and len(entry["shape"]) == 2 and not KEPT.match(name):
                    nbytes = count * NVFP4_BYTES
                else:
                    nbytes = count * dtype_bytes
                total += nbytes
                experts += nbytes if ".experts." in name else 0
                if layer:
                    per_layer[int(layer.group(1))] = per_layer.get(int(layer.group(1)), 0.0) + nbytes
                else:
                    outside += nbytes
    except (OSError, ValueError, KeyError, struct.error):
        return None
    if not per_layer:
        return None
    return Weights(total, experts, max(per_layer.values()), outside, params, "safetensors headers")


def safetensors_header(file: Path) -> dict:
    """A safetensors file's tensor entries (name -> dtype, shape, offsets), read from its header alone."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def lora_params(shape: Shape, targets: list[str], rank: int) -> int:
    """r x (fan_in + fan_out) for every module lora.target_modules names (routed experts excepted:
    they stay frozen), embeddings and head included when named."""
    total = sum(rank * (x.fan_in + x.fan_out) * x.count for x in shape.linears() if x.name in targets and not x.expert)
    edge = rank * (shape.vocab + shape.hidden)
    return total + edge * (("lm_head" in targets) + ("embed_tokens" in targets))


# How vLLM 0.32 splits each layer over its TP ranks: row-parallel layers split their input, the
# MLA down-projections (and the router) are replicated, every other linear splits its output.
VLLM_ROW_PARALLEL = ("o_proj", "down_proj")
VLLM_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "gate")


def vllm_lora_bytes(shape: Shape, targets: list[str], max_rank: int, max_loras: int, tp: int, dtype_bytes: int) -> int:
    """What vLLM allocates on each GPU for LoRA (enable_lora with lora_target_modules = `targets`),
    as its LoRA layers do (vllm/lora/layers/base_linear.py, column_parallel_linear.py): a wrapped
    layer holds, per slice (each part of a fused layer: q, k, v of qkv_proj; gate, up), A of
    max_loras x max_rank x its input and B of max_loras x its output x max_rank, in the model's dtype,
    for every part of a fused layer as soon as one part is a target. Column-parallel layers keep the
    whole input and 1/TP of the output, row-parallel ones the reverse, replicated ones both whole.
    Routed experts are never wrapped (no target names them: vLLM calls them experts.N.gate_proj)."""
    linears = [x for x in shape.linears() if not x.expert]
    wrapped = {x.name for x in linears if any(x.name in _fused_with(t) for t in targets)}
    elements = 0
    for x in linears:
        if x.name in wrapped:
            fan_in, fan_out = _vllm_local(shape, x, tp)
            elements += x.count * max_rank * (fan_in + fan_out)
    edge = max_rank * (shape.vocab + shape.hidden)  # embeddings and head: whole on every rank
    elements += edge * (("lm_head" in targets) + ("embed_tokens" in targets))
    return elements * max_loras * dtype_bytes


def _fused_with(name: str) -> tuple[str, ...]:
    """`name` and the projections vLLM fuses it with into one layer."""
    return next((group for group in FUSED if name in group), (name,))


def _vllm_local(shape: Shape, x: Linear, tp: int) -> tuple[int, int]:
    """(input, output) of linear `x` on one of vLLM's TP ranks."""
    if x.name in VLLM_ROW_PARALLEL:
        return math.ceil(x.fan_in / tp), x.fan_out
    if x.name in VLLM_REPLICATED:
        return x.fan_in, x.fan_out
    if x.name in ("k_proj", "v_proj"):  # KV heads are replicated when fewer than the ranks
        return x.fan_in, math.ceil(shape.kv_heads / tp) * shape.head_dim
    return x.fan_in, math.ceil(x.fan_out / tp)
