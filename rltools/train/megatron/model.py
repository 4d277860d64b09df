"""The policy as a megatron-core GPTModel: built from a Llama-family or DeepSeek-V3 (MLA + MoE) HF
config, loaded from its safetensors one weight at a time (each TP rank keeps its shard, each EP rank
its experts), with LoRA on the parallel linears.

Invariants:
- Each pipeline stage builds and loads only its own layers (the first stage the embedding, the last
  the final norm and output layer); parameter names inside a stage count layers from 0, and each EP
  rank's routed experts from 0; names outside it (HF, PEFT, checkpoints) are global.
- Every exported tensor has the Hugging Face name and full shape an HF model would load:
  `export_weights` merges the LoRA deltas and yields one weight at a time (gathered over TP just
  before it is yielded, a routed expert broadcast from its EP rank, sent from its stage to rank 0),
  so no rank holds the whole model;
  `export_adapter` yields the same PEFT names
  (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) as the FSDP2 backend.
- Inside the GPTModel every row has its real tokens first, in order, and its padding after them
  (`forward` reorders them, and the routes of routing replay, and puts the logits back): causal
  masking is then the whole attention mask, and no [B, S, S] mask exists (attention.py).
- A tied embedding is untied when the pipeline has more than one stage: the last stage loads its
  own copy of it as the output layer. Both stay equal because the base model is frozen.
- Collectives: building, exporting and `adapter_state` are collective over the trainer ranks;
  every trainer rank must call them in the same order.
"""

import contextlib
import json
import re
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ...config.schema import LoraConfig, ModelConfig
from ...errors import UserError
from ...fused_layers import module_of
from ...quant.nvfp4_checkpoint import QuantizedModules
from ...weight_sync import TensorStream
from . import convert
from .build import build_gpt
from .lora import LINEARS, LoraParallelLinear, split_dim
from .packed import PackedExpertLinear
from .parallel import (
    ep_rank_size,
    every_stage,
    expert_shards,
    gather,
    pp_rank_size,
    shards,
    to_first_stage,
    tp_rank_size,
)
from .replay import set_routes

PEFT_PREFIX = "base_model.model."
EXPERTS = "mlp.experts.local_experts."
OUTPUT = ("column", ("lm_head",))  # the output layer's LoRA: one column-parallel projection
PROJECTIONS = {p.replace(".", "_"): p for _, ps in [*LINEARS.values(), OUTPUT] for p in ps}  # ParameterDict key -> HF path
_LAYER = re.compile(r"^model\.layers\.\d+\.")


def _linears(layer: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) of the layer's linears that LoRA can adapt (`lora.LINEARS`) which it has."""
    for path in LINEARS:
        parent, leaf = path.rsplit(".", 1)
        module = getattr(_submodule(layer, parent), leaf, None)
        if module is not None:
            yield path, module


def _real_first(key_mask: torch.Tensor) -> torch.Tensor | None:
    """The order [B, S] that moves each row's real tokens (`key_mask` 1) before its padding, each
    group in its own order; None when every row is already so (no padding before a real token)."""
    pad = ~key_mask.bool()
    if not (pad[:, :-1] & ~pad[:, 1:]).any():
        return None
    return torch.sort(pad.to(torch.uint8), dim=1, stable=True).indices


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


class MegatronPolicy(nn.Module):
    """A GPTModel plus what the trainer needs around it: the HF shape, LoRA control, the TP group."""

    def __init__(self, gpt: nn.Module, shape: convert.Shape, lora_scale: float | None):
        super().__init__()
        self.gpt, self.shape, self.lora_scale = gpt, shape, lora_scale
        self.config, self.model_type = gpt.config, gpt.model_type  # what megatron's schedules look up
        layers = gpt.decoder.layers
        self.first_layer = layers[0].layer_number - 1 if len(layers) else 0  # global index of local layer 0
        self.ep_rank, ep_size = ep_rank_size()
        self.local_experts = shape.experts // ep_size  # routed experts per EP rank
        stage = range(self.first_layer, self.first_layer + len(layers))  # global MoE index of each local MoE layer
        self.moe_layers = [shape.moe_layers.index(i) for i in stage if shape.is_moe(i)]
        self.recompute = False  # gradient checkpointing (load_megatron_policy sets it)

    def set_input_tensor(self, tensor) -> None:
        """The previous stage's activations (megatron's pipeline schedules call it)."""
        self.gpt.set_input_tensor(tensor)

    def global_name(self, name: str, ep_rank: int | None = None) -> str:
        """A parameter name of this stage's GPTModel with the global layer number (and, for a routed
        expert, its global index: as held by EP rank `ep_rank`, by default this rank)."""
        if not name.startswith("decoder.layers."):
            return name
        local, rest = name.removeprefix("decoder.layers.").split(".", 1)
        if rest.startswith(EXPERTS):
            expert, rest = rest.removeprefix(EXPERTS).split(".", 1)
            first = (self.ep_rank if ep_rank is None else ep_rank) * self.local_experts
            rest = f"{EXPERTS}{int(expert) + first}.{rest}"
        return f"decoder.layers.{int(local) + self.first_layer}.{rest}"

    def weights(self, meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(local name, tensor) of every weight of the checkpoint as a dense model holds it: the
        parameters, the routers' score correction biases (buffers megatron would update, but never
        does here) and each packed expert linear's dequantised weight (with `meta`, a meta tensor of
        its shape: nothing is dequantised)."""
        packed = dict(self.packed_linears())
        yield from ((n, p) for n, p in self.gpt.named_parameters() if n.rsplit(".", 1)[0] not in packed)
        yield from ((f"{n}.weight", m.dense(self.config.params_dtype, meta)) for n, m in packed.items())
        yield from ((n, b) for n, b in self.gpt.named_buffers() if n.endswith(".router.expert_bias"))

    def packed_linears(self) -> Iterator[tuple[str, "PackedExpertLinear"]]:
        """(local name, module) of the routed experts' packed linears (`model.quantization: nvfp4`)."""
        return ((n, m) for n, m in self.gpt.named_modules() if isinstance(m, PackedExpertLinear))

    def forward(self, input_ids: torch.Tensor, key_mask: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab] (full vocabulary on every TP rank) of left- or right-padded rows;
        `key_mask` [B, S] is 1 for real tokens. Padding positions produce junk logits. A stage
        before the last returns its hidden states [S, B, hidden] instead; a stage after the first
        reads its input from `set_input_tensor`, not from `input_ids`. `routes` [B, S, MoE layers,
        top-k]: the experts each token's router takes (routing replay; None: its own)."""
        width = input_ids.shape[1]
        extra = -width % self.config.tensor_model_parallel_size if self.config.sequence_parallel else 0
        if extra:  # right padding to a multiple of TP, masked, cut off the logits
            input_ids, key_mask = (nn.functional.pad(t, (0, extra)) for t in (input_ids, key_mask))
        order = _real_first(key_mask)  # real tokens first (module docstring): token i sits at position i
        if order is not None:
            input_ids = input_ids.gather(1, order)
        if self.moe_layers:
            set_routes(self.gpt, None if routes is None else self._as_routed(routes, extra, order), self.moe_layers,
                       recompute=self.recompute)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        out = self.gpt(input_ids=input_ids, position_ids=positions, attention_mask=None)
        if not self.gpt.post_process:
            return out
        if order is None:
            return out[:, :width]
        unpacked = order.argsort(dim=1)[:, :width]  # where each original token sits in its packed row
        return out.gather(1, unpacked[..., None].expand(-1, -1, out.shape[-1]))

    def _as_routed(self, routes: torch.Tensor, extra: int, order: torch.Tensor | None) -> torch.Tensor:
        """[B, S, MoE layers, k] -> [tokens, MoE layers, k] in the order this rank's routers see the
        tokens: packed like the rows (`order`), sequence-major, padded like the sequence (with
        experts 0..k-1), this rank's part of it under sequence parallelism."""
        moe = len(self.shape.moe_layers)
        if routes.shape[2] != moe:
            raise ValueError(f"routing replay: the rollouts route {routes.shape[2]} MoE layers, the model has {moe}: "
                             "generator and trainer serve different models (model.path)")
        filler = torch.arange(routes.shape[-1], dtype=routes.dtype, device=routes.device).expand(
            routes.shape[0], extra, *routes.shape[2:])
        routes = torch.cat([routes, filler], dim=1)
        if order is not None:
            routes = routes.gather(1, order[:, :, None, None].expand_as(routes))
        routes = routes.transpose(0, 1)
        if self.config.sequence_parallel:
            rank, size = tp_rank_size()
            routes = routes.chunk(size, dim=0)[rank]
        return routes.reshape(-1, *routes.shape[2:])

    def lora_modules(self) -> Iterator[tuple[str, str, LoraParallelLinear]]:
        """(global Megatron module name, HF module prefix, module) of this stage's LoRA-wrapped
        linears; the output layer's prefix is empty (PEFT's `lm_head`)."""
        for i, layer in enumerate(self.gpt.decoder.layers):
            index = self.first_layer + i
            for path, module in _linears(layer):
                if isinstance(module, LoraParallelLinear):
                    yield f"decoder.layers.{index}.{path}", f"model.layers.{index}.", module
        if isinstance(getattr(self.gpt, "output_layer", None), LoraParallelLinear):
            yield "output_layer", "", self.gpt.output_layer

    def adapter_params(self) -> Iterator[tuple[str, nn.Parameter, int | None]]:
        """(PEFT name, local parameter, the dimension TP splits it along) of each LoRA matrix of this
        stage: the FSDP2 backend's names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)."""
        for _, prefix, module in self.lora_modules():
            for key in module.lora_A:
                for matrix, params in (("A", module.lora_A), ("B", module.lora_B)):
                    name = f"{PEFT_PREFIX}{prefix}{PROJECTIONS[key]}.lora_{matrix}.weight"
                    yield name, params[key], split_dim(module.style, matrix)

    @contextlib.contextmanager
    def disable_adapter(self):
        """The frozen base model (for the KL reference), as peft's `disable_adapter`."""
        layers = [m for _, _, m in self.lora_modules()]
        for m in layers:
            m.enabled = False
        try:
            yield
        finally:
            for m in layers:
                m.enabled = True


def load_megatron_policy(model_cfg: ModelConfig, lora_cfg: LoraConfig, recompute: bool = False) -> MegatronPolicy:
    """Build this rank's part of the GPTModel (its pipeline stage's layers, their TP shards) and fill
    it from the HF checkpoint (after `init_parallel`). `recompute` (trainer.gradient_checkpointing):
    each layer keeps only its input for backward and recomputes the rest there."""
    from transformers import AutoConfig

    from ..model import DTYPES

    hf_config = AutoConfig.from_pretrained(model_cfg.path, local_files_only=True)
    shape = convert.Shape.from_hf(hf_config)
    rank, size = tp_rank_size()
    stage, stages = pp_rank_size()
    quantized = model_cfg.quantization == "nvfp4"
    gpt = build_gpt(hf_config, DTYPES[model_cfg.dtype], size, stages, pre_process=stage == 0,
                    post_process=stage == stages - 1, recompute=recompute, packed_experts=quantized)
    policy = MegatronPolicy(gpt, shape, lora_cfg.alpha / lora_cfg.rank)
    policy.recompute = recompute
    names = convert.name_map(shape)
    if shape.tied and stages > 1:  # untied (see the module docstring): the output layer is the embedding
        names["output_layer.weight"] = names["embedding.word_embeddings.weight"]
    nvfp4 = QuantizedModules(model_cfg.path) if quantized else None
    packed = dict(policy.packed_linears())
    # an NVFP4 base's other quantised linears are dequantised here
    reader = contextlib.nullcontext(nvfp4.dense) if quantized else _SafetensorsReader(model_cfg.path)
    with reader as read, torch.no_grad():
        for local, param in policy.weights(meta=True):
            if local.removesuffix(".weight") in packed:
                continue
            name = policy.global_name(local)
            full = convert.to_megatron(name, [read(n) for n in names[name]], shape)
            param.copy_(convert.shard(name, full, rank, size))
        for local, module in packed.items():  # their triples, as stored (or quantised now)
            stored = dict(zip(module.PROJECTIONS, names[policy.global_name(f"{local}.weight")]))
            module.load(lambda projection: nvfp4.tensors(stored[projection].removesuffix(".weight")))
    for p in gpt.parameters():
        p.requires_grad_(False)
    _add_lora(policy, lora_cfg, size)
    return policy


def _add_lora(policy: MegatronPolicy, lora_cfg: LoraConfig, tp_size: int) -> None:
    shape = policy.shape
    groups = shape.kv_heads // tp_size
    targets = set(lora_cfg.target_modules)

    def wrap(parent: nn.Module, leaf: str, style: str, projections: tuple[str, ...], rows: list[int]) -> None:
        base = getattr(parent, leaf)
        targeted = {p for p in projections if p.rsplit(".", 1)[-1] in targets}
        if targeted:
            parts = {p: (r, base.weight.shape[1]) for p, r in zip(projections, rows)}
            setattr(parent, leaf, LoraParallelLinear(base, style, parts, targeted, lora_cfg.rank, policy.lora_scale,
                                                     groups if leaf == "linear_qkv" else 1))

    for layer in policy.gpt.decoder.layers:
        for path, base in list(_linears(layer)):
            style, projections = LINEARS[path]
            local_rows = base.weight.shape[0]
            rows = _column_rows(path, shape, local_rows) if style == "column" else [local_rows]
            parent, leaf = path.rsplit(".", 1)
            wrap(layer.get_submodule(parent), leaf, style, projections, rows)
    if getattr(policy.gpt, "output_layer", None) is not None and not shape.tied:  # the last stage
        wrap(policy.gpt, "output_layer", *OUTPUT, [policy.gpt.output_layer.weight.shape[0]])
    for module in policy.modules():
        if isinstance(module, LoraParallelLinear):
            for matrix, params in (("A", module.lora_A), ("B", module.lora_B)):
                for p in params.values():
                    p.data = p.data.to(module.base.weight.dtype)
                    p.tp_split = tp_size > 1 and split_dim(module.style, matrix) is not None  # for the grad norm


def _column_rows(path: str, shape: convert.Shape, local_rows: int) -> list[int]:
    """Local output rows of each fused projection of a column-parallel layer."""
    if path.endswith("linear_qkv"):
        groups = local_rows // ((shape.heads // shape.kv_heads + 2) * shape.head_dim)
        q = groups * shape.heads // shape.kv_heads * shape.head_dim
        return [q, groups * shape.head_dim, groups * shape.head_dim]
    if path.endswith("linear_fc1"):
        return [local_rows // 2, local_rows // 2]
    return [local_rows]


class _SafetensorsReader:
    """Reads one HF tensor at a time from a (possibly sharded) safetensors checkpoint."""

    def __init__(self, directory: str):
        self.directory = Path(directory)

    def __enter__(self):
        from safetensors import safe_open

        index = self.directory / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
                 else ["model.safetensors"])
        self.handles = [safe_open(self.directory / f, framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}
        return self.read

    def read(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise UserError(f"{self.directory}: no tensor {name} in the checkpoint")
        return self.where[name].get_tensor(name)

    def __exit__(self, *exc):
        self.handles = self.where = None


def export_adapter(policy: MegatronPolicy) -> TensorStream:
    """(PEFT name, full tensor) of every LoRA weight, as the FSDP2 backend's `export_adapter`, on
    rank 0 (collective; see `export_weights`)."""

    def stage_adapters(meta: bool):
        for name, param, dim in policy.adapter_params():
            yield name, _full_on_meta(param, dim) if meta else gather(param, dim)

    return _stream(policy, stage_adapters)


def load_adapter(policy: MegatronPolicy, tensors: dict[str, torch.Tensor]) -> None:
    """Set the adapters from full PEFT-named tensors (each TP rank keeps its shard, each pipeline
    stage its layers'); adapters `tensors` lacks keep their values."""
    rank, size = tp_rank_size()
    with torch.no_grad():
        for name, param, dim in policy.adapter_params():
            if name in tensors:
                param.copy_(tensors[name] if dim is None else tensors[name].chunk(size, dim=dim)[rank])


def export_weights(policy: MegatronPolicy, lora_scale: float | None = None,
                   modules: frozenset[str] | None = None) -> TensorStream:
    """(HF name, full tensor) of every weight with the LoRA deltas merged (with `modules`, of the
    Megatron weights holding a module so named, `fused_layers.module_of`), one Megatron weight at a
    time: gathered over TP (a routed expert: broadcast from its EP rank), merged, split into its HF
    tensors, yielded on rank 0 (sent there from a later pipeline stage), dropped; so no rank holds the whole model, and the weight sender, which
    knows every tensor's name, dtype and shape up front (the stream's specs), need not either.

    Collective over the trainer ranks (`parallel.to_first_stage`): rank 0 gets every tensor, the
    others their stage's, to discard. Replicated tensors may be views of live parameters: copy what
    is kept past the next optimizer step."""
    shape, scale = policy.shape, policy.lora_scale if lora_scale is None else lora_scale
    adapters = {name: m for name, _, m in policy.lora_modules()}
    names = convert.name_map(shape)  # without the output layer of a tied model: HF loads none

    def full_weights(meta: bool):
        """(global Megatron name, full tensor) of every weight to export (routed experts: of every EP rank)."""
        for local, param in policy.weights(meta):
            local = local.replace(".base.weight", ".weight")
            name = policy.global_name(local)
            if name not in names:
                continue  # the LoRA matrices themselves, or the untied copy of a tied embedding
            if modules is not None and (f".{EXPERTS}" in name  # routed experts: never adapted (nor fused with what is)
                                        or not any(module_of(hf_name) in modules for hf_name in names[name])):
                continue
            if f".{EXPERTS}" in name:  # whole on its EP rank
                for ep_rank, expert in enumerate([param] * ep_rank_size()[1] if meta else expert_shards(param)):
                    yield policy.global_name(local, ep_rank), _full_on_meta(expert, None) if meta else expert
                continue
            dim = convert.split_dim(name)
            if meta:
                yield name, _full_on_meta(param, dim)
            else:
                yield name, convert.unshard(name, shards(param) if dim is not None else [param.detach()])

    def stage_weights(meta: bool):
        for name, full in full_weights(meta):
            module = None if meta else adapters.get(name.removesuffix(".weight"))
            for hf_name, tensor in zip(names[name], convert.to_hf(name, full, shape)):
                yield hf_name, tensor if module is None else _merged(module, hf_name, tensor, scale)

    return _stream(policy, stage_weights)


def _stream(policy: MegatronPolicy, stage_items) -> TensorStream:
    """Every stage's `stage_items(meta=False)` on rank 0, announced by their specs (which
    `stage_items(meta=True)` gives from meta tensors, without gathering anything)."""
    specs = every_stage([(name, t.dtype, tuple(t.shape)) for name, t in stage_items(meta=True)])
    device = next(policy.gpt.parameters()).device
    return TensorStream(specs, to_first_stage(lambda: stage_items(meta=False), device))


def _full_on_meta(param: torch.Tensor, dim: int | None) -> torch.Tensor:
    """A meta tensor shaped like the full tensor of a TP shard split along `dim`."""
    full = list(param.shape)
    if dim is not None:
        full[dim] *= tp_rank_size()[1]
    return torch.empty(full, dtype=param.dtype, device="meta")


def _merged(module: LoraParallelLinear, hf_name: str, tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """`tensor` (the full HF weight `hf_name` of a LoRA-wrapped layer) plus its adapter's delta."""
    key = _LAYER.sub("", hf_name).removesuffix(".weight").replace(".", "_")  # model.layers.0.self_attn.q_proj.weight
    if key not in module.lora_A:
        return tensor
    a = gather(module.lora_A[key], split_dim(module.style, "A")).float()
    b = gather(module.lora_B[key], split_dim(module.style, "B")).float()
    return (tensor.float() + scale * b @ a).to(tensor.dtype)
