"""The policy model on the trainer: HF causal LM, optional LoRA (peft), FSDP2 sharding, and the
export of its weights under Hugging Face names for the generators.

Invariant: whatever wraps the model (peft, FSDP2), `export_weights` yields the tensors a plain HF
model of the same architecture would load — merged base + LoRA delta, HF parameter names. An NVFP4
base (`model.quantization: nvfp4`) is exported dequantised (`quant.nvfp4.dequantize`) before the
LoRA delta is added.

With `trainer.gradient_checkpointing`, each decoder layer keeps only its inputs (and the keys and
values it cached) for backward and recomputes the rest there (`checkpoint_layers`): the same
numbers as without it.
"""

import contextlib
import functools
import re
from typing import Iterator

import torch
from torch import nn

from ..config.schema import LoraConfig, ModelConfig
from ..errors import UserError
from ..fused_layers import module_of
from ..versions import PEFT, TRANSFORMERS, require_tested
from .materialize import local_rows, materialize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PEFT_PREFIX = "base_model.model."
_LORA_WEIGHT = re.compile(r"(.*)\.lora_([AB])\.[^.]+\.weight")
_LAYER_PREFIX = re.compile(r".*?\.layers\.\d+\.")
# one projection of a layer's routed experts: held fused (transformers 5) or as stacked NVFP4 triples
_ROUTED = re.compile(r"(.*\.experts\.)(gate_up_proj|gate_proj|up_proj|down_proj)(_weight_\w+)?")


def load_policy(model_cfg: ModelConfig, lora_cfg: LoraConfig, gradient_checkpointing: bool = False, *,
                device: torch.device | str = "cpu", shard: bool = False) -> nn.Module:
    """The policy on `device`: built on the meta device, wrapped (LoRA, activation checkpointing),
    with `shard` sharded by FSDP2 there (`shard_model`, a collective of the trainer ranks), and only
    then given memory and filled from the checkpoint (`materialize`): no rank ever holds a parameter
    it does not own."""
    require_tested(TRANSFORMERS, PEFT)  # their private code, reached from here, is listed in rltools/versions.py
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from .shard_reader import ShardReader

    nvfp4 = model_cfg.quantization == "nvfp4"
    if nvfp4 and not lora_cfg.enabled:
        raise ValueError("model.quantization: nvfp4 freezes the base model; set lora.enabled: true to train adapters")
    reader = ShardReader(model_cfg.path, quantize=nvfp4)
    config = AutoConfig.from_pretrained(model_cfg.path, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the packed tensors are ours to load (a plain model has none)
    with init_empty_weights():  # parameters on the meta device; buffers real (rotary frequencies)
        model = causal_lm_class(config, model_cfg.path).from_config(config, dtype=DTYPES[model_cfg.dtype])
    if nvfp4:
        from ..quant.linear import swap_quantized_layers

        swap_quantized_layers(model, reader.layout(), model_cfg.path)
    model.config.use_cache = False
    rng = torch.get_rng_state()  # LoRA's initial values are drawn again, whole, once memory exists
    if lora_cfg.enabled:
        model = _with_lora(model, lora_cfg, nvfp4)
    if gradient_checkpointing:
        checkpoint_layers(model)
    if shard:
        shard_model(model)
    torch.set_rng_state(rng)
    materialize(model, reader, torch.device(device))
    return model


def causal_lm_class(config, path):
    """The auto class that builds the policy: AutoModelForCausalLM, or AutoModelForPreTraining where that
    is what maps the model type to a causal LM (transformers 5.19 registers `mistral4`'s
    Mistral4ForCausalLM there only). UserError for a model type with neither."""
    from transformers import AutoModelForCausalLM, AutoModelForPreTraining
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_PRETRAINING_MAPPING_NAMES,
    )

    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if MODEL_FOR_PRETRAINING_MAPPING_NAMES.get(config.model_type, "").endswith("ForCausalLM"):
        return AutoModelForPreTraining
    raise UserError(f"model.path {path}: transformers has no causal language model for model type {config.model_type} "
                    f"(architectures {config.architectures}); a multimodal checkpoint's text model is not loaded on its "
                    "own yet: point model.path at a text-only checkpoint")


def _with_lora(model: nn.Module, lora_cfg: LoraConfig, nvfp4: bool) -> nn.Module:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        bias="none",
    )
    if nvfp4:
        from ..quant.linear import lora_custom_modules

        peft_config._register_custom_module(lora_custom_modules())
    with _targets_as_named():
        return get_peft_model(model, peft_config)


@contextlib.contextmanager
def _targets_as_named():
    """`lora.target_modules` names linear modules, on every model. peft 0.21 on transformers 5 renames
    the targets of MoE models (a v4-compatibility step): any target ending in gate_proj, up_proj or
    down_proj is moved to the fused routed experts, so a DeepSeek-V3 model's shared expert and dense
    MLP would silently lose their adapters and the frozen routed experts gain some. rltools trains
    the shared expert and keeps the routed experts frozen (tests/integration/test_moe.py checks which
    modules carry adapters), so that renaming is switched off while the adapters are made."""
    from peft.utils import transformers_weight_conversion as conversion

    renamer = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = renamer


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the modules HF names as never to be split across devices."""
    layer_types = set(getattr(_hf_model(model), "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in layer_types]


def checkpoint_layers(model: nn.Module) -> None:
    """Activation checkpointing: each decoder layer saves only its inputs for backward, and runs its
    forward again there (torch's non-reentrant checkpoint, so a frozen base whose layer inputs need
    no gradient still gets the LoRA gradients; dropout replays with the same random numbers).

    Not HF's `gradient_checkpointing_enable`: in training mode it drops the layers' KV cache, which
    the trainer's shared-prompt forward (`logprobs.completion_logprobs`) is built on. Here the cache
    is written once; the recompute gets back the keys and values that write returned (`_ReplayCache`).
    The layer's own `forward` is wrapped, inside its module hooks: FSDP2 (`shard_model`) gathers the
    layer's weights for the recompute in its pre-backward hook, as it does for torch's checkpoint_wrapper.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(_hf_model(model)).__name__}: no decoder layers found (_no_split_modules) to "
                         "checkpoint; set trainer.gradient_checkpointing: false")
    for layer in layers:
        layer.forward = functools.partial(_checkpointed_forward, layer, layer.forward)


def _checkpointed_forward(layer, forward, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    from .routing import pinned

    if not torch.is_grad_enabled():  # reference and evaluation passes: nothing is saved anyway
        return forward(*args, **kwargs)
    if kwargs.get("past_key_values") is not None:
        kwargs["past_key_values"] = _ReplayCache(kwargs["past_key_values"])
    return checkpoint(pinned(layer, forward), *args, use_reentrant=False, **kwargs)  # replayed routes too


class _ReplayCache:
    """The KV cache as one checkpointed layer call sees it: the first `update` appends the layer's
    keys and values to the real cache; the recompute in backward gets the same tensors back instead
    of appending them a second time. Everything else is the real cache's."""

    def __init__(self, cache):
        self._cache, self._result = cache, None

    def update(self, *args, **kwargs):
        if self._result is None:
            self._result = self._cache.update(*args, **kwargs)
        return self._result

    def __getattr__(self, name):
        return getattr(self._cache, name)


def shard_model(model: nn.Module, mesh=None) -> None:
    """FSDP2: shard each decoder layer, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def export_weights(model: nn.Module, lora_scale: float | None, modules: frozenset[str] | None = None):
    """(HF name, full tensor) for every weight, LoRA merged in; with `modules`, only the weights of the
    modules so named (`fused_layers.module_of`). Collective under FSDP2: every trainer rank must
    iterate it; the tensors are complete on all of them.

    A `TensorStream`: its specs come from meta tensors (nothing gathered), and the tensors one group
    at a time (`_layer_groups`: a decoder layer, one projection of its routed experts): a group's
    weights are gathered, merged and yielded, then dropped before the next group's are gathered, so
    no rank holds more than its shard and one layer (the weight sender, given the specs, holds no
    more either)."""
    from ..weight_sync import TensorStream

    def wanted(name: str) -> bool:
        return modules is None or bool(_LORA_WEIGHT.fullmatch(name)) or module_of(name.replace(".base_layer.", ".")) in modules

    groups = _layer_groups(model, wanted)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1)  # not FP8
    specs = [(name, t.dtype, tuple(t.shape)) for group in groups
             for name, t in _exported(model, {n: _on_meta(t) for n, t in group}, lora_scale, dtype)]

    def tensors():
        for group in groups:
            exported = _exported(model, {n: _whole(t) for n, t in group}, lora_scale, dtype)
            exported.reverse()
            while exported:
                yield exported.pop()  # the consumer holds what it took; we keep only what it has not

    return TensorStream(specs, tensors())


def _layer_groups(model: nn.Module, wanted) -> list[list[tuple[str, torch.Tensor]]]:
    """The `wanted` tensors of the state dict (clean names, as held: DTensors under FSDP2), grouped by
    decoder layer (a LoRA pair with its base weight), a layer's routed experts one projection a group
    (an MoE layer's bulk: never adapted, dequantised whole); outside the layers, one module a group.
    A tied output embedding is the input one: the checkpoint (and what loads it) has it once."""
    groups: dict[str, list] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        name = _clean(name)
        if wanted(name) and id(tensor) not in seen:
            seen.add(id(tensor))
            groups.setdefault(_group(name), []).append((name, tensor))
    return list(groups.values())


def _group(name: str) -> str:
    if routed := _ROUTED.fullmatch(name):
        return routed.group(1) + routed.group(2)
    layer = _LAYER_PREFIX.match(name)
    return layer.group(0) if layer else _module(name)


def _module(name: str) -> str:
    """The module a parameter belongs to, LoRA's matrices and the base layer they adapt alike."""
    match = _LORA_WEIGHT.fullmatch(name)
    if match:
        return match.group(1)
    return name.split(".base_layer.")[0] if ".base_layer." in name else name.rsplit(".", 1)[0]


def _exported(model: nn.Module, state: dict[str, torch.Tensor], lora_scale: float | None,
              dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """One group's tensors (whole, or meta for their specs) as exported: NVFP4 and FP8 weights
    dequantised to `dtype`, LoRA deltas merged, under the checkpoint's names and layout."""
    if any(tensor.dtype == torch.float8_e4m3fn for tensor in state.values()):  # NVFP4 block scales, FP8 weights
        from ..quant.linear import unstack_experts
        from ..quant.nvfp4_checkpoint import dequantized_state

        state = unstack_experts(state)  # packed routed experts: one triple per expert, as stored
        state = dict(dequantized_state(_drained(state), dtype))
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = _LORA_WEIGHT.fullmatch(name)
        if match:
            adapters.setdefault(match.group(1), {})[match.group(2)] = tensor
    merged = {}
    for name in list(state):
        tensor = state.pop(name)  # each gathered weight is dropped once merged: a layer and one weight at most
        if _LORA_WEIGHT.fullmatch(name):
            continue
        if ".base_layer." in name:
            stem, leaf = name.rsplit(".base_layer.", 1)
            pair = adapters.get(stem)
            if pair and leaf == "weight" and lora_scale is not None:  # W + scale * B @ A, in float32
                tensor = torch.addmm(tensor.float(), pair["B"].float(), pair["A"].float(), alpha=lora_scale).to(tensor.dtype)
        merged[name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")] = tensor
    return list(checkpoint_layout(model, merged).items())


def _drained(state: dict):
    """(name, tensor) of `state`, each removed as it is taken: what was dequantised is not kept twice."""
    while state:
        name = next(iter(state))
        yield name, state.pop(name)


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")  # a DTensor's shape is the whole one


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (_gather(tensor) if hasattr(tensor, "full_tensor") else tensor).detach()


def checkpoint_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (names as the model holds them in memory) under the names and shapes of the model's
    checkpoint files, which vLLM loads. The one place that maps them: transformers 5 holds a MoE
    layer's routed experts fused (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj`
    (E, H, I)) where the checkpoint has `mlp.experts.<e>.{gate,up,down}_proj.weight`; its own
    `revert_weight_conversion` (what `save_pretrained` calls) maps them back, and is the identity
    for a model it does not convert (Llama)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(_hf_model(model), state)


def adapter_name(name: str) -> str | None:
    """The name a saved PEFT adapter gives the LoRA weight a model (or its checkpoint) holds as `name`
    (`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`); None for any other weight."""
    match = _LORA_WEIGHT.fullmatch(name)
    return f"{match.group(1)}.lora_{match.group(2)}.weight" if match else None


def export_adapter(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, full tensor) of every LoRA weight, named as in a saved PEFT adapter
    (`...q_proj.lora_A.weight`). Collective under FSDP2, like `export_weights`."""
    for name, tensor in _full_state_dict(model, lambda name: bool(_LORA_WEIGHT.fullmatch(name))).items():
        yield adapter_name(name), tensor


def load_adapter(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Set the LoRA weights from `tensors` (PEFT names as `export_adapter` yields them; each rank copies
    the rows it holds under FSDP2); LoRA weights `tensors` lacks keep their values. A KeyError or
    ValueError names a tensor the model has no place for."""
    params = {adapter_name(_clean(name)): param for name, param in model.named_parameters()
              if adapter_name(_clean(name))}
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise KeyError(f"the model has no LoRA weight {unknown[0]} ({len(unknown)} such); its first: {min(params)}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} where the model's is {tuple(param.shape)}")
            local, lo, hi = local_rows(param)
            if hi > lo:
                local.copy_(tensor[lo:hi])


def _full_state_dict(model: nn.Module, wanted=lambda name: True) -> dict[str, torch.Tensor]:
    """The `wanted` tensors (by clean name), whole: under FSDP2 only those are gathered, so exporting
    an adapter never holds the base model. Every rank asks for the same names in the same order."""
    state = {}
    for name, tensor in model.state_dict().items():
        name = _clean(name)
        if not wanted(name):
            continue
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor: all-gather the shards
            tensor = _gather(tensor)
        state[name] = tensor.detach()
    return state


def _gather(tensor) -> torch.Tensor:
    """All-gather a DTensor (FSDP2: sharded on dim 0) into a new whole tensor. FP8 ones (NVFP4 block
    scales) travel as bytes, which gloo can carry. Gloo's all-gather keeps a flat copy of its whole
    output besides the output (twice the tensor for a moment: the embedding of a large vocabulary),
    so on gloo each rank broadcasts its rows into place instead; NCCL's writes into the output."""
    import torch.distributed as dist

    group = tensor.device_mesh.get_group()
    if dist.get_backend(group) == "gloo":
        whole = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        local, lo, hi = local_rows(tensor)
        chunk = -(-tensor.shape[0] // group.size())
        for rank in range(group.size()):
            rows = whole[rank * chunk:(rank + 1) * chunk]
            if rows.numel():
                if (rank * chunk, rank * chunk + rows.shape[0]) == (lo, hi):
                    rows.copy_(local)
                dist.broadcast(_wire(rows), src=dist.get_global_rank(group, rank), group=group)
        return whole
    if tensor.element_size() != 1 or tensor.dtype == torch.uint8:
        return tensor.full_tensor()
    from torch.distributed.tensor import DTensor

    as_bytes = DTensor.from_local(_wire(tensor.to_local()), tensor.device_mesh, tensor.placements,
                                  shape=tensor.shape, stride=tensor.stride())
    return as_bytes.full_tensor().view(tensor.dtype)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _clean(name: str) -> str:
    return re.sub(r"\._checkpoint_wrapped_module|\._orig_mod", "", name)


def _hf_model(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
