"""Projections vLLM serves as one fused layer (its models' `packed_modules_mapping`): q, k and v as
qkv_proj; gate and up as gate_up_proj (w1 and w3 in Mixtral's naming); MLA's q_a_proj and
kv_a_proj_with_mqa as fused_qkv_a_proj. Both the NVFP4 layout (the parts of a fused layer share one
global scale, and are all quantised or all kept) and the adapted-layers weight sync (a fused layer
is reloaded from all of its parts) follow this one table."""

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa"))


def module_of(name: str) -> str:
    """The module a checkpoint tensor belongs to, as `lora.target_modules` names modules:
    `model.layers.0.self_attn.q_proj.weight` -> q_proj."""
    return name.rpartition(".")[0].rpartition(".")[2]


def with_fused_partners(modules) -> frozenset[str]:
    """`modules` (leaf names) and every projection vLLM fuses with one of them."""
    names = set(modules)
    for group in FUSED:
        if names & set(group):
            names |= set(group)
    return frozenset(names)
