"""Safetensors shards written while a model's tensors arrive one at a time.

Invariant: the writer holds at most one shard's tensors (copied to host memory), writes each shard
as soon as it is full under a temporary name, and names them only at `close`: a single shard is
`model.safetensors`, several are model-0000i-of-0000n plus the index Hugging Face loaders read (n is
known only at the end). A model larger than host memory is written with a shard's worth of it.
"""

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def copy_side_files(src: Path, dst: Path, with_config: bool = True) -> list[str]:
    """Copy what a model directory holds besides its weights (tokenizer, chat template, generation
    config; config.json unless `with_config` is False) from `src` into `dst`; returns the names copied."""
    copied = []
    for source in sorted(Path(src).iterdir()):
        weights = source.name.endswith(WEIGHT_SUFFIXES) or source.name.endswith(".index.json")
        if source.is_file() and not weights and (with_config or source.name != "config.json"):
            shutil.copy2(source, Path(dst) / source.name)
            copied.append(source.name)
    return copied


class ShardWriter:
    def __init__(self, dst: Path, shard_bytes: int, mode_of: Path | None = None):
        """Shards go into the existing directory `dst`; with `mode_of` they get that file's mode
        (safetensors writes 0600: a shared model directory must stay readable)."""
        self.dst, self.shard_bytes, self.mode_of = Path(dst), shard_bytes, mode_of
        self.written: list[tuple[Path, list[str]]] = []
        self.batch: dict[str, "torch.Tensor"] = {}
        self.size = 0

    def add(self, name: str, tensor: "torch.Tensor") -> None:
        self.batch[name] = tensor.detach().contiguous().cpu()
        self.size += tensor.numel() * tensor.element_size()
        if self.size >= self.shard_bytes:
            self._flush()

    def close(self) -> list[Path]:
        """Write the last shard, name every shard (and the index); returns the shard paths."""
        self._flush()
        weight_map, final_paths = {}, []
        for i, (path, names) in enumerate(self.written):
            count = len(self.written)
            final = self.dst / ("model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors")
            path.rename(final)
            if self.mode_of is not None:
                shutil.copymode(self.mode_of, final)
            weight_map.update(dict.fromkeys(names, final.name))
            final_paths.append(final)
        if len(self.written) > 1:
            (self.dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
        return final_paths

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self.batch:
            path = self.dst / f".shard-{len(self.written)}.tmp"
            save_file(self.batch, str(path), metadata={"format": "pt"})
            self.written.append((path, list(self.batch)))
        self.batch, self.size = {}, 0


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}


def read_header(path: Path) -> dict[str, dict]:
    """name -> {dtype, shape, data_offsets (absolute in the file)} of one safetensors file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["data_offsets"] = [8 + size + offset for offset in entry["data_offsets"]]
    return header


def read_rows(path: Path, entry: dict, lo: int, hi: int | None) -> "torch.Tensor":
    """Rows lo..hi (dim 0; a scalar: itself) of one tensor of a safetensors file, read with one pread
    into a fresh tensor: no memory map, so a rank's memory holds the bytes it asked for and no page of
    the file beyond them (a mapped file's pages count in the process's resident memory)."""
    import torch

    dtype = getattr(torch, _DTYPES[entry["dtype"]])
    shape, (begin, end) = entry["shape"], entry["data_offsets"]
    rows = shape[0] if shape else 1
    hi = rows if hi is None else min(hi, rows)
    row_bytes = (end - begin) // rows if rows else 0
    out = torch.empty((hi - lo) * row_bytes, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        f.seek(begin + lo * row_bytes)
        view, done = memoryview(out.numpy()), 0
        while done < len(view):
            count = f.readinto(view[done:])
            if not count:
                raise ValueError(f"{path}: truncated: the header places {entry} past the end of the file")
            done += count
    return out.view(dtype).reshape(hi - lo, *shape[1:]) if shape else out.view(dtype).reshape(())
