"""A merged Hugging Face model written tensor by tensor: the base model as the trainer computed with
it, with what the checkpoint changed (`trained`) applied to each tensor as it passes.

Invariants:
- Memory holds the output shard being filled (`ShardWriter`, `shard_bytes`) and the tensor in hand
  (of an NVFP4 base, one module's packed triple and its dequantised weight; a float32 weight gets its
  delta in place): never the whole model.
- The base is what the trainer loaded: an NVFP4 base (stored, or quantised as it loads under
  `model.quantization: nvfp4`) is dequantised with the trainer's own functions
  (`quant.nvfp4_checkpoint.dequantized_state`) into the base's dtype, and config.json loses its
  quantization_config. Other tensors keep the dtype they are stored in.
- A trained output layer tied to the embedding (the base file holds that matrix once) is written as
  its own `lm_head.weight`, and config.json says tie_word_embeddings: false.
- Names and layout are the base checkpoint's (per-expert names of a MoE included), which is what
  transformers and vLLM load.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..errors import UserError
from ..quant.layout import is_nvfp4_config
from ..quant.nvfp4_checkpoint import Source, dequantized_state, load_nvfp4_state
from ..safetensors_shards import ShardWriter, copy_side_files
from .trained import LoraDeltas, TrainedWeights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OUTPUT_LAYER = "lm_head"


@dataclass
class Merged:
    tensors: int = 0
    bytes: int = 0
    dtype: str = ""
    """The dtype dequantised weights got (the base's)."""
    dequantized: bool = False
    untied: bool = False
    changed: list[str] = field(default_factory=list)


def write_merged(model_path: str, nvfp4: bool, fallback_dtype: str, trained: LoraDeltas | TrainedWeights,
                 out: Path, shard_bytes: int, progress: bool = True) -> Merged:
    """Write the merged model into the existing directory `out` (shards, index, config.json, the base's
    tokenizer and other side files). `nvfp4`: the run's model.quantization is nvfp4; `fallback_dtype`:
    the run's model.dtype, for a base whose config.json names none."""
    from tqdm import tqdm

    config = json.loads((Path(model_path) / "config.json").read_text())
    dequantize = nvfp4 or is_nvfp4_config(config)
    dtype = _base_dtype(config, fallback_dtype)
    summary = Merged(dtype=dtype, dequantized=dequantize)
    writer = ShardWriter(out, shard_bytes, mode_of=Path(model_path) / "config.json")
    embedding = None
    with tqdm(total=None if dequantize else Source(model_path).nbytes(), unit="B", unit_scale=True, desc="merge",
              disable=not progress) as bar:
        for name, tensor in base_tensors(model_path, dequantize, DTYPES[dtype]):
            if name.endswith("embed_tokens.weight"):
                embedding = name
            tensor = trained.apply(name, tensor)
            writer.add(name, tensor)
            summary.tensors, summary.bytes = summary.tensors + 1, summary.bytes + tensor.numel() * tensor.element_size()
            bar.update(tensor.numel() * tensor.element_size())
        summary.untied = _untie_output_layer(model_path, config, trained, embedding, writer)
    writer.close()
    missing = trained.missing()
    if missing:
        raise UserError(f"the checkpoint changes {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}, which "
                        f"{model_path} has no weight of that name for: is it this run's model.path? (a full fine-tune "
                        "of a MoE holds transformers' fused experts, which this export does not split)")
    summary.changed = sorted(trained.applied)
    config.pop("quantization_config", None)
    if summary.untied:
        config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(Path(model_path), out, with_config=False)
    return summary


def base_tensors(model_path: str, dequantize: bool, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the base as the trainer computes with it, one at a time, in file order."""
    if dequantize:
        return dequantized_state(load_nvfp4_state(model_path), dtype)
    source = Source(model_path)
    return ((name, source.get(name)) for name in source.names())


def _untie_output_layer(model_path: str, config: dict, trained, embedding: str | None, writer: ShardWriter) -> bool:
    """A trained output layer the base ties to its embedding gets a tensor of its own (True), merged
    from the embedding; a full fine-tune's tied copy is the embedding already written."""
    weight = f"{OUTPUT_LAYER}.weight"
    if OUTPUT_LAYER not in trained.modules() or OUTPUT_LAYER in trained.applied or weight in trained.applied:
        return False
    if not config.get("tie_word_embeddings") or embedding is None:
        return False  # not tied: `missing` names it
    if isinstance(trained, TrainedWeights):
        trained.applied.add(weight)
        return False
    writer.add(weight, trained.apply(weight, Source(model_path).get(embedding)))
    return True


def _base_dtype(config: dict, fallback: str) -> str:
    named = config.get("dtype") or config.get("torch_dtype")
    return named if named in DTYPES else fallback

