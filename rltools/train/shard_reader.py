"""Reading a rank's rows of a model's tensors from its safetensors checkpoint, under the names and
layouts the model holds them in memory.

Invariant: `rows(name, lo, hi)` reads rows lo..hi (dim 0) of the in-memory tensor `name` and nothing
more of the files (`safe_open(...).get_slice`): a rank that owns 1/N of every tensor reads 1/N of the
checkpoint. The in-memory layouts that differ from the checkpoint's are mapped here, one rule each:
- transformers 5's fused routed experts (`mlp.experts.gate_up_proj` [E, 2I, H] = gate rows then up
  rows, `mlp.experts.down_proj` [E, H, I]) from the per-expert `mlp.experts.<e>.<proj>.weight`;
- NVFP4Experts' stacked triples (`mlp.experts.gate_proj_weight_packed` [E, ...]) from the per-expert
  `mlp.experts.<e>.gate_proj.weight_packed`;
- an NVFP4 layer over a plain checkpoint (`model.quantization: nvfp4` on a bf16 model): its rows
  quantised now, with the global scale of its fused group (`quant.nvfp4_checkpoint._Quantizer`, one
  streaming pass over the quantised weights first). NVFP4 blocks run along a row, so a row slice
  quantises to the same bytes as the rows of the whole tensor.
"""

import re

import torch

from ..quant.layout import QUANT_SUFFIXES, is_nvfp4_config, plan
from ..quant.nvfp4_checkpoint import Source, _Quantizer

_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")
_STACKED = re.compile(r"(.*\.experts)\.(gate_proj|up_proj|down_proj)_(weight_packed|weight_scale|weight_global_scale)")
_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}


class ShardReader:
    """The tensors of the checkpoint in `model_dir` by in-memory name and row range. With
    `quantize`, the NVFP4 layout of the model (the checkpoint's if it is NVFP4, else the default plan
    applied at load)."""

    def __init__(self, model_dir: str, quantize: bool = False):
        self.source = Source(model_dir)
        self.names = set(self.source.names())
        self.quantizer = None
        self.quantized: set[str] = set()  # modules quantised at load (plain checkpoint, quantize=True)
        if quantize and not is_nvfp4_config(self.source.config):
            plan_ = plan(self.source.shapes())
            self.quantizer, self.quantized = _Quantizer(self.source, plan_), plan_.quantized

    def layout(self) -> dict[str, torch.dtype | None]:
        """Checkpoint name -> dtype where it matters (FP8 weights, packed codes) of the model's tensors
        as the NVFP4 layers hold them, per expert: what picks each layer's type, read from names
        and headers only."""
        out = {}
        for name in self.source.names():
            module = name.removesuffix(".weight")
            if module in self.quantized and name.endswith(".weight"):
                out.update({f"{module}.{leaf}": None for leaf in QUANT_SUFFIXES})
            else:
                out[name] = _SAFETENSORS_DTYPES.get(self.source.stored_dtype(name))
        return out

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo..hi of the in-memory tensor `name`."""
        if name in self.names:
            return self._stored(name, lo, hi)
        if match := _FUSED_EXPERTS.fullmatch(name):
            prefix, fused = match.groups()
            parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
            return _stack([torch.cat([self.rows(f"{prefix}.{e}.{p}.weight", 0, None) for p in parts])
                           for e in range(lo, hi)])
        if match := _STACKED.fullmatch(name):
            prefix, projection, leaf = match.groups()
            return _stack([self.rows(f"{prefix}.{e}.{projection}.{leaf}", 0, None) for e in range(lo, hi)])
        module, _, leaf = name.rpartition(".")
        if leaf in QUANT_SUFFIXES and module in self.quantized:
            if leaf == "weight_global_scale":  # the group's, whatever rows are quantised
                lo, hi = 0, 1
            ((_, tensor),) = [(n, t) for n, t in self.quantizer(f"{module}.weight", self._stored(f"{module}.weight", lo, hi))
                              if n.endswith(f".{leaf}")]
            return tensor
        raise ValueError(f"{self.source.dir}: the model has a tensor {name} that the checkpoint does not hold "
                         "(nor its per-expert parts): is model.path a checkpoint of this architecture?")

    def _stored(self, name: str, lo: int, hi: int | None) -> torch.Tensor:
        if name not in self.names:
            raise ValueError(f"{self.source.dir}: no tensor {name} in the checkpoint")
        return self.source.rows(name, lo, hi)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        raise ValueError("an empty row range has no shape to read")  # callers skip empty shards
    return torch.stack(tensors)
