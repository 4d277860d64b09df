"""Which weights of a Hugging Face checkpoint become NVFP4 (or FP8), and the compressed-tensors
config entry that tells vLLM so.

Layout: compressed-tensors `nvfp4-pack-quantized`, weight-only (NVFP4A16: activations stay in the
compute dtype, no calibration data needed). Per quantised linear `P`: `P.weight_packed` (uint8
[out, in/2]), `P.weight_scale` (float8_e4m3fn [out, in/16]), `P.weight_global_scale` (float32 [1]).
vLLM maps this to `CompressedTensorsW4A4Fp4(use_a16=True)` (weights NVFP4, input_activations null).

The mixed layout of the public NVFP4 MoE checkpoints (`fp8_outside_experts`): routed experts in
NVFP4 as above, every other quantisable linear in FP8 (`quant.fp8`: `P.weight` float8_e4m3fn
[out, in], `P.weight_scale` float32 [out, 1]; compressed-tensors `float-quantized`, channel
strategy, weight-only: vLLM's `CompressedTensorsW8A16Fp8`), one config group each.

Invariants:
- Shards that vLLM fuses into one layer (`fused_layers`: q/k/v, gate/up, w1/w3, q_a/kv_a of one
  module) are all quantised or all kept (vLLM refuses a mix), and share one global scale (vLLM
  keeps only the max of them).
- Every 2-D weight that is kept in high precision and could be mistaken for a target is listed in
  the config's `ignore`.
"""

import re
from dataclasses import dataclass, field

from ..fused_layers import FUSED
from .nvfp4 import BLOCK

QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
ROUTED_EXPERT = re.compile(r".*\.experts\.\d+\.[^.]+")  # a routed expert's projection (module name)
# Kept in high precision by default: embeddings, the output head, norms, MoE routers.
DEFAULT_IGNORE = ("re:.*lm_head$", "re:.*embed.*", "re:.*norm.*", r"re:.*mlp\.gate$", "re:.*router.*")


@dataclass
class QuantPlan:
    """Module names (no `.weight`) to quantise, grouped by shared global scale, and those kept."""

    groups: list[list[str]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    fp8: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> set[str]:
        return {m for group in self.groups for m in group}

    def group_of(self) -> dict[str, int]:
        return {m: i for i, group in enumerate(self.groups) for m in group}


def matches(name: str, patterns) -> bool:
    """compressed-tensors / vLLM ignore syntax: an exact module name or `re:` + a full-match regex."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return True
        elif name == pattern:
            return True
    return False


def plan(shapes: dict[str, tuple[int, ...]], ignore=(), fp8_outside_experts: bool = False) -> QuantPlan:
    """Decide from tensor names and shapes alone (no data), so a checkpoint streams through.
    `fp8_outside_experts`: only routed experts become NVFP4; the other linears FP8."""
    patterns = DEFAULT_IGNORE + tuple(ignore)
    linear = {n[: -len(".weight")]: s for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2}
    allowed = {m for m in linear if not matches(m, patterns)}
    groups, fp8, seen = [], [], set()
    for module in sorted(linear):
        if module in seen:
            continue
        members = _fused_members(module, linear)
        seen.update(members)
        if not all(m in allowed for m in members):
            continue
        if fp8_outside_experts and not ROUTED_EXPERT.fullmatch(module):
            fp8.extend(members)
        elif all(linear[m][1] % BLOCK == 0 for m in members):
            groups.append(members)
    plan_ = QuantPlan(groups=groups, fp8=sorted(fp8))
    plan_.kept = sorted(m for m in linear if m not in plan_.quantized and m not in fp8)
    return plan_


def _fused_members(module: str, linear: dict) -> list[str]:
    prefix, _, leaf = module.rpartition(".")
    for family in FUSED:
        if leaf in family:
            return [f"{prefix}.{x}" if prefix else x for x in family if (f"{prefix}.{x}" if prefix else x) in linear]
    return [module]


def quantization_config(plan_: QuantPlan) -> dict:
    """The `quantization_config` entry of config.json, as llm-compressor writes it for NVFP4A16 (and,
    with FP8 linears, for its mixed-precision NVFP4A16 experts + FP8 W8A16 rest)."""
    groups = {"group_0": _nvfp4_group(["Linear"])}
    if plan_.fp8:
        groups = {"group_0": _nvfp4_group([f"re:{ROUTED_EXPERT.pattern}"]), "group_1": _fp8_group(["Linear"])}
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision" if plan_.fp8 else "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(plan_.kept),
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def _fp8_group(targets: list[str]) -> dict:
    return {
        "targets": targets,
        "format": "float-quantized",
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "group_size": None, "symmetric": True,
                    "dynamic": False, "observer": "minmax"},
        "input_activations": None,
        "output_activations": None,
    }


def _nvfp4_group(targets: list[str]) -> dict:
    return {
        "targets": targets,
        "format": "nvfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": BLOCK, "symmetric": True,
                    "dynamic": False, "observer": "minmax", "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None},
        "input_activations": None,
        "output_activations": None,
    }


def is_nvfp4_config(config: dict) -> bool:
    """An NVFP4 checkpoint (all NVFP4, or NVFP4 experts with FP8 linears) as this module writes them."""
    q = config.get("quantization_config") or {}
    formats = {q.get("format")} | {group.get("format") for group in (q.get("config_groups") or {}).values()}
    return q.get("quant_method") == "compressed-tensors" and "nvfp4-pack-quantized" in formats
