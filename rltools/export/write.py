"""One export of a trainer checkpoint: its files (`write_files`), and its publication (`export_policy`).

Invariants:
- The export is written into a temporary directory beside its final place, checked there (when a
  check is asked for: `verify`), and renamed into place whole (`durable.publish_dir`): a directory
  under the final name is complete and, unless the user declined the check, verified. A failure at
  any point leaves nothing under the final name and removes the temporary.
- An existing non-empty directory is replaced only with `force`.
- Both formats carry the tokenizer and chat template the policy was trained with: the base's files,
  and the run's own template (data.chat_template as a file) as chat_template.jinja.
- `EXPORT_INFO` records where the export came from (run, checkpoint, step, format, base) and its
  check; it is written last, so a directory without it was not made by `rltools export`.
"""

import json
import os
import shutil
import time
from pathlib import Path

from ..durable import fsync_path, publish_dir
from ..errors import UserError
from ..policy_exports import Policy
from ..safetensors_shards import copy_side_files
from ..weight_formats import write_adapter

FORMATS = ("adapter", "merged")
EXPORT_INFO = "rltools_export.json"
QUANTIZE = ("nvfp4", "nvfp4-experts-fp8")


def default_name(policy: Policy, fmt: str, quantize: str | None) -> str:
    """exports/<name>: step_40-merged, step_40-adapter, step_40-merged-nvfp4."""
    return f"step_{policy.step}-{fmt}" + (f"-{quantize}" if quantize else "")


def refuse_overwrite(out: Path, force: bool) -> None:
    """UserError when `out` is a file, or a non-empty directory that `force` does not allow replacing."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; the export is a directory: choose another -o DIR")
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"{out} exists and is not empty; choose another -o DIR, or pass --force to replace it")


def export_policy(config, run: Path, policy: Policy, fmt: str, out: Path, *, force: bool = False,
                  quantize: str | None = None, verify=None, shard_bytes: int = 1 << 30, progress: bool = True) -> dict:
    """Write `policy` (its trainer checkpoint) of the run at `run` as `fmt` to `out`; `verify(directory)
    -> dict` checks the written files before they are put in place. Returns the summary `EXPORT_INFO` holds."""
    out = Path(out)
    refuse_overwrite(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    begin = time.perf_counter()
    try:
        summary = {"run": str(run), **write_files(config, policy, fmt, tmp, quantize=quantize, shard_bytes=shard_bytes,
                                                  progress=progress)}
        summary["verified"] = verify(tmp) if verify is not None else None
        summary["seconds"] = round(time.perf_counter() - begin, 2)
        (tmp / EXPORT_INFO).write_text(json.dumps(summary, indent=2) + "\n")
        for file in tmp.iterdir():
            fsync_path(file)  # what the rename publishes is on disk
        refuse_overwrite(out, force)  # another export may have put one there meanwhile
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**summary, "output": str(out)}


def write_files(config, policy: Policy, fmt: str, directory: Path, *, quantize: str | None = None,
                shard_bytes: int = 1 << 30, progress: bool = True) -> dict:
    """The export's files in the new directory `directory`, from the trainer checkpoint `policy.checkpoint`."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if policy.checkpoint is None:
        raise UserError(f"{policy.name} has no trainer checkpoint to export (step {policy.step})")
    _check_intact(policy.checkpoint)
    summary = {"checkpoint": f"step_{policy.step}", "step": policy.step, "format": fmt, "base_model": config.model.path,
               "quantization": quantize}
    if fmt == "adapter":
        summary.update(_write_adapter(config, policy, directory))
    elif quantize:
        summary.update(_write_quantized(config, policy, directory, quantize, shard_bytes, progress))
    else:
        summary.update(_write_merged(config, policy, directory, shard_bytes, progress))
    template = _chat_template(config.data.chat_template)
    if template is not None:
        shutil.copyfile(template, directory / "chat_template.jinja")
        summary["chat_template"] = str(template)
    return summary


def _write_adapter(config, policy: Policy, directory: Path) -> dict:
    from .trained import adapter_tensors

    tensors = adapter_tensors(policy.checkpoint)  # a UserError for a run without LoRA
    directory.mkdir(parents=True)
    write_adapter(directory, tensors, config.lora, config.model.path)
    copy_side_files(Path(config.model.path), directory, with_config=False)
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "lora": {"rank": config.lora.rank, "alpha": config.lora.alpha, "target_modules": list(config.lora.target_modules)}}


def _write_merged(config, policy: Policy, directory: Path, shard_bytes: int, progress: bool) -> dict:
    from .merge import write_merged
    from .trained import policy_changes

    directory.mkdir(parents=True)
    merged = write_merged(config.model.path, config.model.quantization == "nvfp4", config.model.dtype,
                          policy_changes(policy.checkpoint, config.lora), directory, shard_bytes, progress)
    return {"tensors": merged.tensors, "bytes": merged.bytes, "dtype": merged.dtype, "dequantized": merged.dequantized,
            "untied_output_layer": merged.untied, "changed": len(merged.changed)}


def _write_quantized(config, policy: Policy, directory: Path, quantize: str, shard_bytes: int, progress: bool) -> dict:
    """The merged model, then `rltools quantize`'s conversion of it (the merged copy is removed)."""
    from ..quant.nvfp4_checkpoint import quantize_checkpoint

    merged = directory.with_name(directory.name + ".merged")
    shutil.rmtree(merged, ignore_errors=True)
    try:
        summary = _write_merged(config, policy, merged, shard_bytes, progress)
        try:
            quantized = quantize_checkpoint(merged, directory, shard_bytes=shard_bytes, progress=progress,
                                            fp8_outside_experts=quantize == "nvfp4-experts-fp8")
        except ValueError as err:
            raise UserError(f"--quantize {quantize}: {err}") from err
    finally:
        shutil.rmtree(merged, ignore_errors=True)
    return {**summary, "bytes": quantized.total_bytes_after, "quantized_layers": quantized.quantized_layers}


def _chat_template(setting: str) -> Path | None:
    """The run's own chat template file (data.chat_template as a path), which overrides the base's."""
    return None if setting in ("model", "none") else Path(setting)


def _check_intact(checkpoint: Path) -> None:
    from ..train.checkpoints import verify

    problems = verify(checkpoint)
    if problems:
        raise UserError(f"checkpoint {checkpoint} is damaged ({'; '.join(problems[:3])}); export another step")
