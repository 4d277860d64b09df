"""Memory for a model built on the meta device, rank by rank, filled from its checkpoint.

Invariant: each parameter gets memory for this rank's rows only (its FSDP2 shard, or the whole
tensor when unsharded) and is filled from those rows of the checkpoint (`ShardReader`): no rank
allocates or reads a row it does not own, so host and device memory per rank stay ~1/N of the model
plus the largest tensor's rows being read. Buffers the model computed itself (rotary frequencies)
keep their values; persistent buffers come from the checkpoint. LoRA matrices are drawn whole, in
module order, from the RNG state the caller had when peft made them, with peft's draws (nn.Linear's
own initialisation of A and B, then A again, B zero), and each rank keeps its rows: the adapters of
any number of ranks equal peft's on a model loaded whole.
"""

import math

import torch
from torch import nn

from .shard_reader import ShardReader

_WRAPPERS = ("base_model.model.", ".base_layer", "._checkpoint_wrapped_module", "._orig_mod")


def materialize(model: nn.Module, reader: ShardReader, device: torch.device) -> None:
    computed = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    _retie(model)
    persistent = _persistent_buffers(model)
    lora = _lora_rows(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in persistent:
                buffer.copy_(reader.rows(checkpoint_name(name), 0, buffer.shape[0] if buffer.dim() else None))
            elif name in computed:
                buffer.copy_(computed[name])
        for name, param in model.named_parameters():
            local, lo, hi = local_rows(param)
            if hi == lo:
                continue  # an uneven split left this rank no rows of it
            local.copy_(lora[name](lo, hi) if name in lora else reader.rows(checkpoint_name(name), lo, hi))


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """This rank's part of `param` and the rows lo..hi of the whole tensor it holds. FSDP2 shards
    dim 0 as torch.chunk does: rank r holds rows r*c..(r+1)*c, c = ceil(rows / ranks)."""
    if not hasattr(param, "to_local"):
        return param, 0, param.shape[0] if param.dim() else 0
    (placement,) = param.placements
    assert placement.is_shard(0), f"FSDP2 shards dim 0; got {placement}"
    rows, ranks, rank = param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = -(-rows // ranks)
    lo, hi = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    local = param.to_local()
    assert local.shape[0] == hi - lo, f"FSDP2 gave rank {rank} {local.shape[0]} rows of {rows}, expected {hi - lo}"
    return local, lo, hi


def checkpoint_name(name: str) -> str:
    """The in-memory HF name of a parameter or buffer of the wrapped model."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _retie(model: nn.Module) -> None:
    """`to_empty` gives tied parameters (input and output embeddings) memory of their own: tie them again."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(hf.config, "tie_word_embeddings", False):
        hf.tie_weights()


def _persistent_buffers(model: nn.Module) -> set[str]:
    return {f"{prefix}.{name}".lstrip(".") for prefix, module in model.named_modules()
            for name in module._buffers if name not in module._non_persistent_buffers_set}


def _lora_rows(model: nn.Module) -> dict:
    """Parameter name -> rows(lo, hi) of its initial value, for every LoRA matrix, drawn now in
    peft's order (so the RNG advances as peft's own initialisation made it)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, a in module.lora_A.items():
            b = module.lora_B[adapter]
            _kaiming(b.in_features, a.in_features)  # nn.Linear(in, r)'s own initialisation, overwritten
            _kaiming(b.out_features, b.in_features)  # nn.Linear(r, out)'s, zeroed
            whole = _kaiming(b.in_features, a.in_features)  # peft's reset_lora_parameters
            out[f"{prefix}.lora_A.{adapter}.weight"] = lambda lo, hi, whole=whole: whole[lo:hi]
            out[f"{prefix}.lora_B.{adapter}.weight"] = lambda lo, hi, n=b.in_features: torch.zeros(hi - lo, n)
    return out


def _kaiming(rows: int, columns: int) -> torch.Tensor:
    weight = torch.empty(rows, columns)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return weight
