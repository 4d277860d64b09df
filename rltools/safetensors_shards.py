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
