"""Policy exports for evaluation: what `--checkpoint base|latest|step_N` means, in one place.

Invariants:
- weights/step_<k>/ holds the policy after k optimizer steps exactly as the generators served it,
  in the files of the run's weight format (rltools.weight_formats): weight_sync full -> a complete
  Hugging Face model (the merged tensors the engines loaded, plus the base model's config and
  tokenizer files); weight_sync lora -> a PEFT adapter over the base model.
- An export counts only with its marker (EXPORT_MARKER, written last, inside a temporary directory
  that is then renamed): a trainer killed mid-write leaves nothing a reader takes for a policy.
- `resolve_checkpoint` is the one place that turns a name (base, latest, step_N) into a policy, for
  `rltools eval` and `rltools export` alike: a policy export of that step, the trainer checkpoint of
  that step (checkpoints/step_N, valid with its marker), or both; latest is the newest step either
  holds, found by scanning.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from .durable import publish_dir
from .errors import UserError
from .paths import RunPaths
from .weight_formats import FORMATS, WeightFormat

EXPORT_MARKER = "policy.json"


@dataclass(frozen=True)
class Policy:
    name: str
    """How the user named it: base, latest or step_N."""
    step: int
    """Optimizer steps behind it (0 = the base model)."""
    kind: str
    """base (the model at model.path), full / lora / adapted (a policy export at `path`, in that weight
    format), or checkpoint (no export: only the trainer checkpoint at `checkpoint` holds it)."""
    path: Path | None
    """The policy export (weights/step_N), if there is one."""
    checkpoint: Path | None = None
    """The trainer checkpoint of the same step (checkpoints/step_N, with its marker), if there is one."""


class PolicyWriter:
    """One policy export written as its tensors arrive (`add`), finished by `close`; its files are
    the weight format's (`export_writer`): a full model in safetensors shards of `shard_bytes` as
    they fill, so the trainer never holds the whole model for it, or a PEFT adapter."""

    def __init__(self, target: Path, fmt: WeightFormat, step: int, shard_bytes: int = 4 << 30):
        self.target, self.fmt, self.step = Path(target), fmt, step
        self.tmp = self.target.with_name(self.target.name + ".tmp")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.files = fmt.export_writer(self.tmp, shard_bytes)

    def add(self, name: str, tensor) -> None:
        self.files.add(name, tensor)

    def close(self) -> None:
        self.files.close()
        (self.tmp / EXPORT_MARKER).write_text(json.dumps({"step": self.step, "kind": self.fmt.name,
                                                          "base_model": self.fmt.base_model}))
        publish_dir(self.tmp, self.target)


def save_policy(target: Path, tensors, fmt: WeightFormat, step: int) -> None:
    """Write an export of `tensors` ((name, tensor) pairs as broadcast to the generators) to `target`."""
    writer = PolicyWriter(target, fmt, step)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.close()


def available(paths: RunPaths) -> dict[int, Path]:
    """Complete policy exports of the run, by step."""
    return {step: path for step, path in sorted(paths.policy_steps().items()) if (path / EXPORT_MARKER).is_file()}


def prune_full_exports(paths: RunPaths, keep: int) -> list[Path]:
    """Delete complete-model exports beyond the newest `keep` (each is a whole model: with full weight
    sync of a large model they would fill the disk); adapter exports are small and all kept."""
    full = [path for path in available(paths).values()
            if FORMATS[json.loads((path / EXPORT_MARKER).read_text())["kind"]].whole_model]
    for path in full[:-keep]:
        shutil.rmtree(path)
    return full[:-keep]


def drop_after(paths: RunPaths, steps_done: int) -> None:
    """A resume from the checkpoint after `steps_done` steps: delete the exports of later policies,
    which the resumed run trains and exports again."""
    for step, directory in paths.policy_steps().items():
        if step > steps_done:
            shutil.rmtree(directory)


def resolve_checkpoint(paths: RunPaths, name: str, exports: bool = True) -> Policy:
    """The policy `name` (base, latest, step_N) of the run at `paths`: its policy export and its trainer
    checkpoint, where they exist; with `exports` False trainer checkpoints only (what `rltools export`
    reads). UserError naming what exists."""
    if name == "base" or name == "step_0":
        return Policy(name, 0, "base", None)
    found = available(paths) if exports else {}
    checkpoints = paths.valid_checkpoints()
    steps = sorted(found.keys() | checkpoints.keys())
    what = "policy export or trainer checkpoint" if exports else "trainer checkpoint"
    have = _listing(found, checkpoints, exports)
    if name == "latest":
        if not steps:
            raise UserError(f"--checkpoint latest: no {what} yet in {paths.root} (the trainer writes a checkpoint every "
                            f"schedule.checkpoint_every steps and at the end); available: {have}")
        step = steps[-1]
    else:
        if not (name.startswith("step_") and name[5:].isdigit()):
            raise UserError(f"--checkpoint {name!r}: expected base, latest or step_N")
        step = int(name[5:])
        if step not in steps:
            raise UserError(f"--checkpoint {name}: no complete {what} of step {step} in {paths.root}; available: {have}")
    path = found.get(step)
    kind = json.loads((path / EXPORT_MARKER).read_text())["kind"] if path else "checkpoint"
    return Policy(name, step, kind, path, checkpoints.get(step))


def _listing(exports: dict[int, Path], checkpoints: dict[int, Path], with_exports: bool) -> str:
    """What a run holds, as a UserError lists it: 'base; exports: step_2, step_4; checkpoints: step_4 (latest = step_4)'."""
    def steps(found) -> str:
        return ", ".join(f"step_{s}" for s in found) or "none"

    parts = (["base", f"exports: {steps(exports)}"] if with_exports else []) + [f"checkpoints: {steps(checkpoints)}"]
    latest = max(exports.keys() | checkpoints.keys(), default=None)
    return "; ".join(parts) + (f" (latest = step_{latest})" if latest is not None else "")
