"""Checkpoints: the trainer's state after k optimizer steps, in `checkpoints/step_<k>/`.

Invariants:
- A crash at any moment leaves the previous valid checkpoint intact: a checkpoint is written into
  `checkpoints/.step_<k>.tmp/` (every trainer rank writes its shards there through
  torch.distributed.checkpoint), rank 0 writes the completion marker last, then renames the
  directory to `step_<k>` and fsyncs the parent.
- Only a `step_<k>` directory holding the marker is valid; the latest is found by scanning, never
  from a pointer file. Anything else under `checkpoints/` is debris of an interrupted save and is
  deleted by `clean_incomplete`.
- Every file of a checkpoint is listed in its `checksums.json` (size and XXH3-64) before the marker
  is written; a resume verifies the newest checkpoint against it and, when a file is damaged,
  truncated or missing, moves that checkpoint to `checkpoints.rejected/` and takes the next newest
  one, naming what it skipped. Retention only ever deletes checkpoints older than the newest one.
- What is saved: the trainable weights (the LoRA adapters, or every weight without LoRA) and the
  optimizer state as DCP shards, so a different number of trainer ranks can load them; plus the
  step (= policy version = data cursor: step k's prompts are a function of the seed and k) and each
  rank's RNG states. The frozen base is never copied.
- A checkpoint carries the trainer's probe of its policy (`probe.json`, `runtime.probe`: written
  before that version was broadcast), so an export of it can be checked against the trainer long
  after the run's own probes/ moved on. `read_saved` reads any of its weights alone (`rltools export`).
"""

import json
import os
import pickle
import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ..durable import naming, publish_dir
from ..paths import CHECKPOINT_MARKER, CHECKPOINT_PROBE, RunPaths
from ..runtime import faults

META = "meta.json"
MANIFEST = "checksums.json"
PROBE = CHECKPOINT_PROBE
_FAILURES = (Exception, CheckpointException)  # DCP's own error derives from BaseException
_CHUNK = 8 << 20
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# One trainer rank saves without a process group (no_dist); DCP still warns that it assumes so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
# Loading sets the trainable weights only; dcp.load has already failed on any of them missing.
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def clean_incomplete(paths: RunPaths) -> list[Path]:
    """Delete what interrupted saves left behind (temporary and marker-less directories)."""
    valid = set(paths.valid_checkpoints().values())
    entries = list(paths.checkpoints.iterdir()) if paths.checkpoints.is_dir() else []
    debris = [entry for entry in entries if entry not in valid]
    for entry in debris:
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return debris


def save(paths: RunPaths, step: int, model, optimizer, *, rank: int, keep: int) -> Path:
    """Write the checkpoint of `step` (collective over the trainer ranks); returns its directory."""
    tmp, final = paths.checkpoint_tmp(step), paths.checkpoint_dir(step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    try:
        model_state, optim_state = _trainable_state(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp, no_dist=not dist.is_initialized())
        with naming(tmp / f"rng_{rank}.pkl"), open(tmp / f"rng_{rank}.pkl", "wb") as f:
            pickle.dump(_rng_state(), f)
            _sync(f)
        barrier()
        faults.point("trainer.checkpoint", step)
        if rank == 0:
            _keep_probe(paths, step, tmp)
            _write_synced(tmp / META, json.dumps({"step": step, "policy_version": step, "time": time.time(),
                                                  "world_size": _world_size()}))
            _write_synced(tmp / MANIFEST, json.dumps(_checksums(tmp)))
            _write_synced(tmp / CHECKPOINT_MARKER, "")
    except _FAILURES as err:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # on a full disk, give the space back at once
        raise _named(err, tmp) from err
    if rank == 0:
        publish_dir(tmp, final)  # replaces a marker-less leftover of the same step
        for old in list(paths.valid_checkpoints())[:-keep]:
            shutil.rmtree(paths.checkpoint_dir(old))
    barrier()
    return final


def _keep_probe(paths: RunPaths, step: int, directory: Path) -> None:
    """The trainer's probe of policy version `step` into the checkpoint (none: a backend scored none)."""
    if paths.probe_file(step).is_file():
        _write_synced(directory / PROBE, paths.probe_file(step).read_text())


def resume_point(paths: RunPaths) -> tuple[int, list[str]]:
    """The steps of the newest checkpoint that verifies (0: none), and one note per newer checkpoint
    that did not, which is moved to `paths.rejected_checkpoints` (kept for inspection, never loaded).
    Trainer rank 0 calls it before the other ranks look for the latest checkpoint."""
    notes = []
    for step, directory in reversed(paths.valid_checkpoints().items()):
        problems = verify(directory)
        if not problems:
            return step, notes
        paths.rejected_checkpoints.mkdir(exist_ok=True)
        target = paths.rejected_checkpoints / f"{directory.name}.{int(time.time())}"
        os.replace(directory, target)
        notes.append(f"checkpoint {directory} is damaged ({'; '.join(problems[:3])}); moved it to {target}")
    return 0, notes


def verify(directory: Path) -> list[str]:
    """What is wrong with a published checkpoint, file by file, against its checksums.json; [] when
    nothing is (a checkpoint of an rltools without checksums cannot be checked: [] too)."""
    try:
        recorded = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as err:
        return [f"{MANIFEST} unreadable: {err}"]
    problems = []
    for name, expected in recorded.items():
        path = directory / name
        try:
            size = path.stat().st_size
            if size != expected["bytes"]:
                problems.append(f"{name} has {size} bytes, {expected['bytes']} were written")
            elif _xxh3(path) != expected["xxh3_64"]:
                problems.append(f"{name} fails its checksum")
        except FileNotFoundError:
            problems.append(f"{name} is missing")
        except OSError as err:
            problems.append(f"{name} unreadable: {err.strerror}")
    return problems


def _checksums(directory: Path) -> dict[str, dict]:
    return {path.name: {"bytes": path.stat().st_size, "xxh3_64": _xxh3(path)}
            for path in sorted(directory.iterdir()) if path.is_file() and path.name not in (MANIFEST, CHECKPOINT_MARKER)}


def _xxh3(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


def _named(err: BaseException, directory: Path) -> Exception:
    """The error of a failed save, naming the checkpoint (DCP wraps a full disk in its own exception)."""
    cause = _os_error(err)
    if cause is not None:
        return OSError(cause.errno, f"{cause.strerror} (writing checkpoint {directory})", cause.filename or str(directory))
    return RuntimeError(f"writing checkpoint {directory} failed: {type(err).__name__}: {err}")


def _os_error(err: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError at the root of `err`: its causes, or the per-rank failures DCP collects."""
    if err is None or depth > 8:
        return None
    if isinstance(err, OSError) and err.errno is not None:
        return err
    failures = [f[0] if isinstance(f, tuple) else f for f in getattr(err, "failures", {}).values()]  # (error, trace)
    for inner in [err.__cause__, err.__context__, *failures]:
        found = _os_error(inner if isinstance(inner, BaseException) else None, depth + 1)
        if found is not None:
            return found
    return None


def _trainable_state(model, optimizer) -> tuple[dict, dict]:
    """The state a checkpoint holds: the parameters that train and their optimizer state. Frozen
    parameters and buffers (a MoE router's score correction bias, NVFP4 global scales) are the base
    checkpoint's and never change, so they are left out: every backend's checkpoint then holds the
    same adapters (the Megatron backend's view has no buffers), and checkpoints written with them
    still load (only the keys asked for are read)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    buffers = {name for name, _ in model.named_buffers()}
    return {k: v for k, v in model_state.items() if k not in buffers}, optim_state


def load(paths: RunPaths, step: int, model, optimizer, *, rank: int) -> dict:
    """Restore the checkpoint of `step` into `model` and `optimizer` (collective); returns its meta."""
    directory = paths.checkpoint_dir(step)
    model_state, optim_state = _trainable_state(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=directory, no_dist=not dist.is_initialized())
    except _FAILURES as err:
        raise RuntimeError(
            f"loading checkpoint {directory} failed ({type(err).__name__}: {_first_line(err)}); "
            f"move it into {paths.rejected_checkpoints} and resume again to continue from the checkpoint before it"
        ) from err
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_LOAD_OPTIONS)
    rng = directory / f"rng_{rank}.pkl"
    if rng.exists():  # a rank that did not exist at save time keeps its seeded state
        with open(rng, "rb") as f:
            _set_rng_state(pickle.load(f))
    return json.loads((directory / META).read_text())


def saved_weights(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every trainable weight a checkpoint holds, under the names the model
    holds them by (a peft model's: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`),
    from DCP's metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key.removeprefix("model."): (tuple(entry.size), entry.properties.dtype)
            for key, entry in metadata.items() if key.startswith("model.") and hasattr(entry, "size")}


def read_saved(directory: Path, names, shapes: dict | None = None) -> dict[str, torch.Tensor]:
    """The saved trainable weights `names` (as `saved_weights` names them), whole, in one process: DCP
    reads their bytes and no others (a full fine-tune's weights can be read a few at a time)."""
    shapes = shapes or saved_weights(directory)
    state = {"model": {name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in names}}
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    return state["model"]


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The saved trainable weights of a checkpoint as full tensors (for tests and tools; one process)."""
    shapes = saved_weights(directory)
    return read_saved(directory, list(shapes), shapes)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def barrier() -> None:
    """Wait for every trainer rank (nothing to wait for with one)."""
    if dist.is_initialized():
        dist.barrier()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _write_synced(path: Path, text: str) -> None:
    with naming(path), open(path, "w") as f:
        f.write(text)
        _sync(f)


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())
