"""Policy exports for evaluation: what `--checkpoint base|latest|step_N` means, in one place.

Invariants:
- weights/step_<k>/ holds the policy after k optimizer steps exactly as the generators served it:
  weight_sync full -> a complete Hugging Face model (the merged tensors the engines loaded, plus the
  base model's config and tokenizer files); weight_sync lora -> a PEFT adapter over the base model.
- An export counts only with its marker (EXPORT_MARKER, written last, inside a temporary directory
  that is then renamed): a trainer killed mid-write leaves nothing a reader takes for a policy.
- `resolve_checkpoint` is the only reader of the layout; checkpoints with optimizer state (issue 6)
  re-point it here without touching the evaluator.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from .config.schema import LoraConfig
from .errors import UserError
from .paths import RunPaths
from .safetensors_shards import ShardWriter

EXPORT_MARKER = "policy.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class Policy:
    name: str
    """How the user named it: base, latest or step_N."""
    step: int
    """Optimizer steps behind it (0 = the base model)."""
    kind: str
    """base (the model at model.path), full (a complete HF model at `path`) or lora (an adapter at `path`)."""
    path: Path | None


def peft_adapter_config(lora: LoraConfig, base_model: str) -> dict:
    """adapter_config.json of an adapter trained with `lora` (what vLLM and peft read)."""
    return {
        "peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0,
        "target_modules": list(lora.target_modules), "bias": "none", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
    }


class PolicyWriter:
    """One policy export written as its tensors arrive (`add`), finished by `close`: a full model
    goes out in safetensors shards of `shard_bytes` as they fill, so the trainer never holds the
    whole model for it; adapters (small) are written at `close`."""

    def __init__(self, target: Path, kind: str, base_model: str, lora: LoraConfig, step: int,
                 shard_bytes: int = 4 << 30):
        self.target, self.kind, self.base_model, self.lora, self.step = Path(target), kind, base_model, lora, step
        self.tmp = self.target.with_name(self.target.name + ".tmp")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.adapter: dict = {}
        self.shards = ShardWriter(self.tmp, shard_bytes) if kind == "full" else None

    def add(self, name: str, tensor) -> None:
        if self.shards is not None:
            self.shards.add(name, tensor)
        else:
            self.adapter[name] = tensor.detach().contiguous().cpu()

    def close(self) -> None:
        from safetensors.torch import save_file

        if self.shards is None:
            save_file(self.adapter, str(self.tmp / "adapter_model.safetensors"))
            (self.tmp / "adapter_config.json").write_text(json.dumps(peft_adapter_config(self.lora, self.base_model)))
        else:
            self.shards.close()
            for source in Path(self.base_model).iterdir():  # config, generation config, tokenizer files
                if source.is_file() and not source.name.endswith(_WEIGHT_SUFFIXES) and not source.name.endswith(".index.json"):
                    shutil.copy2(source, self.tmp / source.name)
        (self.tmp / EXPORT_MARKER).write_text(json.dumps({"step": self.step, "kind": self.kind,
                                                          "base_model": self.base_model}))
        shutil.rmtree(self.target, ignore_errors=True)
        self.tmp.rename(self.target)


def save_policy(target: Path, tensors, kind: str, base_model: str, lora: LoraConfig, step: int) -> None:
    """Write an export of `tensors` ((name, tensor) pairs as broadcast to the generators) to `target`."""
    writer = PolicyWriter(target, kind, base_model, lora, step)
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
            if json.loads((path / EXPORT_MARKER).read_text())["kind"] == "full"]
    for path in full[:-keep]:
        shutil.rmtree(path)
    return full[:-keep]


def drop_after(paths: RunPaths, steps_done: int) -> None:
    """A resume from the checkpoint after `steps_done` steps: delete the exports of later policies,
    which the resumed run trains and exports again."""
    for step, directory in paths.policy_steps().items():
        if step > steps_done:
            shutil.rmtree(directory)


def resolve_checkpoint(paths: RunPaths, name: str) -> Policy:
    """The policy `name` (base, latest, step_N) of the run at `paths`; UserError naming what exists."""
    if name == "base" or name == "step_0":
        return Policy(name, 0, "base", None)
    exports = available(paths)
    where = paths.weights
    have = ", ".join(["base"] + [f"step_{s}" for s in exports]) + (f" (latest = step_{max(exports)})" if exports else "")
    if name == "latest":
        if not exports:
            raise UserError(f"--checkpoint latest: no policy exported yet under {where}; available: {have}")
        step = max(exports)
    else:
        if not (name.startswith("step_") and name[5:].isdigit()):
            raise UserError(f"--checkpoint {name!r}: expected base, latest or step_N")
        step = int(name[5:])
        if step not in exports:
            raise UserError(f"--checkpoint {name}: no complete export at {where}/{name}; available: {have}")
    meta = json.loads((exports[step] / EXPORT_MARKER).read_text())
    return Policy(name, step, meta["kind"], exports[step])
