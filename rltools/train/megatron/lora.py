"""LoRA on Megatron's tensor-parallel linear layers, one adapter per Hugging Face projection.

Megatron fuses q/k/v (`linear_qkv`) and gate/up (`linear_fc1`, of a dense MLP or the shared
experts); PEFT adapts each projection on its own (MLA's projections are one HF projection each).
So a fused layer carries one (A, B) pair per targeted projection, exactly PEFT's tensors, and the
deltas are laid out the way the fused output is (per query group for q/k/v, [gate; up] for fc1).

Sharding follows the base layer, so no adapter is ever gathered in the forward pass:
- column-parallel (qkv, fc1; output split over TP): A [r, in] replicated, B [out/TP, r] split.
  The gradient reaching A's output sums over the output shards: `copy_to_tensor_model_parallel_region`
  (identity forward, all-reduce backward) makes it complete and equal on every TP rank.
- row-parallel (proj, fc2; input split over TP): A [r, in/TP] split, B [out, r] replicated.
  A's partial products are summed by `reduce_from_tensor_model_parallel_region` before B.
Replicated adapters therefore get identical gradients on every TP rank and stay identical.

- replicated (MLA's down projections, whole on every rank): A and B replicated, no TP region.

Under sequence parallelism (TP on a MoE model) each rank holds 1/TP of the sequence between the TP
regions: a column-parallel layer's A reads the gathered sequence (whose gradient is then split, not
summed: it is complete on every rank after the all-reduce above), and a row-parallel layer's delta,
computed on the whole sequence from the all-reduced A products, keeps this rank's part (whose
backward gathers the gradient: B's is complete on every rank); a replicated layer's adapters read
the gathered sequence and keep their part of the delta, so their gradients are complete too.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

# Megatron module (in a transformer layer) -> (parallel style, the HF projections it fuses); a layer has
# some of them (Llama: qkv; DeepSeek-V3: MLA's, and a dense MLP or shared experts); the output layer
# (`lm_head`, column-parallel over the vocabulary) is `model.OUTPUT`
LINEARS = {
    "self_attention.linear_qkv": ("column", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "self_attention.linear_q_down_proj": ("replicated", ("self_attn.q_a_proj",)),
    "self_attention.linear_q_up_proj": ("column", ("self_attn.q_b_proj",)),
    "self_attention.linear_kv_down_proj": ("replicated", ("self_attn.kv_a_proj_with_mqa",)),
    "self_attention.linear_kv_up_proj": ("column", ("self_attn.kv_b_proj",)),
    "self_attention.linear_proj": ("row", ("self_attn.o_proj",)),
    "mlp.linear_fc1": ("column", ("mlp.gate_proj", "mlp.up_proj")),
    "mlp.linear_fc2": ("row", ("mlp.down_proj",)),
    "mlp.shared_experts.linear_fc1": ("column", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
    "mlp.shared_experts.linear_fc2": ("row", ("mlp.shared_experts.down_proj",)),
}


class LoraParallelLinear(nn.Module):
    """A Megatron Column/RowParallelLinear plus LoRA adapters for the targeted projections it fuses.

    `rows` gives each projection's local output rows; for q/k/v, `groups` (local query groups) says
    how the fused output interleaves them."""

    def __init__(self, base: nn.Module, style: str, projections: dict[str, tuple[int, int]], targets: set[str],
                 rank: int, scale: float, groups: int = 1):
        super().__init__()
        self.base, self.style, self.scale, self.groups = base, style, scale, groups
        self.rows = {p: rows for p, (rows, _) in projections.items()}  # local output rows, in fused order
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        self.enabled = True
        for projection, (rows, in_features) in projections.items():
            if projection not in targets:
                continue
            key = projection.replace(".", "_")
            self.lora_A[key] = nn.Parameter(torch.empty(rank, in_features))
            self.lora_B[key] = nn.Parameter(torch.zeros(rows, rank))
            nn.init.kaiming_uniform_(self.lora_A[key], a=math.sqrt(5))  # as PEFT; B = 0: a no-op at start

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled or not len(self.lora_A):
            return out, bias
        from megatron.core import tensor_parallel as tp

        sequence_parallel = self.base.config.sequence_parallel
        if self.style == "replicated":  # whole on every rank: no TP region (see the module docstring)
            (key,) = self.lora_A.keys()
            if sequence_parallel:
                x = tp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
            delta = F.linear(F.linear(x, self.lora_A[key]), self.lora_B[key])
            if sequence_parallel:
                delta = tp.scatter_to_sequence_parallel_region(delta)
            return out + self.scale * delta, bias
        if self.style == "row":
            (key,) = self.lora_A.keys()
            hidden = tp.reduce_from_tensor_model_parallel_region(F.linear(x, self.lora_A[key]))
            delta = F.linear(hidden, self.lora_B[key])
            if sequence_parallel:  # the base output is reduce-scattered: keep this rank's part of the sequence
                delta = tp.scatter_to_sequence_parallel_region(delta)
            return out + self.scale * delta, bias
        if sequence_parallel:  # the base gathers the sequence first; A's gradient is complete on every rank
            x = tp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        deltas = []
        for projection, rows in self.rows.items():
            key = projection.replace(".", "_")
            if key in self.lora_A:
                hidden = tp.copy_to_tensor_model_parallel_region(F.linear(x, self.lora_A[key]))
                deltas.append(F.linear(hidden, self.lora_B[key]))
            else:
                deltas.append(out.new_zeros(*out.shape[:-1], rows))
        grouped = [d.reshape(*d.shape[:-1], self.groups, -1) for d in deltas]  # q/k/v interleave per group
        delta = torch.cat(grouped, dim=-1).reshape(*out.shape[:-1], -1)
        gathered = kwargs.get("runtime_gather_output")
        if getattr(self.base, "gather_output", False) if gathered is None else gathered:  # the output layer's
            delta = tp.gather_from_tensor_model_parallel_region(delta)  # full vocabulary, as the base output
        return out + self.scale * delta, bias


def split_dim(style: str, matrix: str) -> int | None:
    """The dimension TP splits an adapter matrix along (None: replicated on every TP rank)."""
    if style == "column":
        return 0 if matrix == "B" else None
    if style == "row":
        return 1 if matrix == "A" else None
    return None
