"""The check of `lora.init_from`: a PEFT adapter the run's adapters can start from.

Invariant: light (json and the safetensors header, no tensor read), so `submit` runs it on a login
node (`preflight`) and the trainer runs it again before it loads the adapter; every refusal is a
UserError naming the key and the file and saying what to change.
"""

import json
from pathlib import Path

from .config.schema import LoraConfig
from .errors import UserError
from .policy_exports import EXPORT_MARKER
from .safetensors_shards import read_header
from .weight_formats import ADAPTER_CONFIG, ADAPTER_WEIGHTS

_KINDS = {"full": "a complete model", "adapted": "merged layers"}


def check_init_adapter(lora: LoraConfig) -> None:
    """`lora.init_from` (when set) is a PEFT LoRA adapter of rank lora.rank and alpha lora.alpha whose
    adapted modules are all among lora.target_modules."""
    if lora.init_from is None:
        return
    directory = Path(lora.init_from)
    key = f"lora.init_from {directory}"
    if not directory.is_dir():
        raise UserError(f"{key} is not a directory: point it at a PEFT adapter directory ({ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS}), e.g. RUN/weights/step_N of a run with generator.weight_sync: lora")
    settings = _adapter_config(directory, key)
    config_file = directory / ADAPTER_CONFIG
    if str(settings.get("peft_type", "LORA")).upper() != "LORA" or settings.get("use_dora") or settings.get("use_rslora"):
        raise UserError(f"{key}: {config_file} describes no plain LoRA adapter (peft_type {settings.get('peft_type')}, "
                        f"use_dora {settings.get('use_dora')}, use_rslora {settings.get('use_rslora')}): rltools "
                        "trains plain LoRA")
    for field, ours, name in (("r", lora.rank, "lora.rank"), ("lora_alpha", lora.alpha, "lora.alpha")):
        theirs = settings.get(field)
        if theirs is None or float(theirs) != float(ours):
            raise UserError(f"{key}: the adapter has {field} {theirs} ({config_file}) where {name} is {ours}: set "
                            f"{name}: {theirs}, or the adapters would not compute what they were trained to")
    modules = _adapted_modules(directory / ADAPTER_WEIGHTS, key)
    outside = sorted(modules - set(lora.target_modules))
    if outside:
        raise UserError(f"{key}: the adapter adapts {', '.join(outside)} ({directory / ADAPTER_WEIGHTS}), which "
                        f"lora.target_modules ({', '.join(lora.target_modules)}) leaves out: add "
                        f"{'it' if len(outside) == 1 else 'them'} to lora.target_modules")


def _adapter_config(directory: Path, key: str) -> dict:
    config_file = directory / ADAPTER_CONFIG
    try:
        settings = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise UserError(f"{key} has no {ADAPTER_CONFIG}: not a PEFT adapter directory{_what_it_is(directory)}") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{key}: {config_file} is unreadable ({err})") from None
    if not isinstance(settings, dict):
        raise UserError(f"{key}: {config_file} is no JSON object")
    return settings


def _what_it_is(directory: Path) -> str:
    """What a policy export that is no adapter holds, and how to get one."""
    try:
        kind = json.loads((directory / EXPORT_MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return ""
    if kind not in _KINDS:
        return ""
    return (f" (it is a policy export of {_KINDS[kind]}: generator.weight_sync {kind}; a run exports its adapters "
            "with generator.weight_sync: lora)")


def _adapted_modules(weights: Path, key: str) -> set[str]:
    """The leaf names of the modules whose `<module>.lora_A.weight` the adapter file holds."""
    try:
        names = read_header(weights)
    except FileNotFoundError:
        raise UserError(f"{key} has no {ADAPTER_WEIGHTS}: the adapter's weights are missing") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{key}: {weights} is no readable safetensors file ({err})") from None
    modules = {name.removesuffix(".lora_A.weight").rpartition(".")[2] for name in names if name.endswith(".lora_A.weight")}
    if not modules:
        raise UserError(f"{key}: {weights} holds no LoRA weights named as peft saves them "
                        f"(`...q_proj.lora_A.weight`); its first tensors: {', '.join(sorted(names)[:3])}")
    return modules
