"""Checks before a job is launched: what would otherwise fail only after both roles started.

Invariant: light (no torch, no vLLM: it runs on a login node); every failure is a UserError that
names the key and the file and says what to change. It reads the model directory's file list and
config.json, and parses the data files the roles will read (problems, keys, answers, templates).
"""

import json
from pathlib import Path

from ..config.schema import RLConfig
from ..errors import UserError

WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def preflight(config: RLConfig) -> None:
    check_model_dir(Path(config.model.path))
    check_data(config)


def check_model_dir(path: Path) -> None:
    where = f"model.path {path}"
    if not path.exists():
        raise UserError(f"{where} does not exist; point model.path (or the environment variable it expands) at a "
                        "Hugging Face model directory")
    if not path.is_dir():
        raise UserError(f"{where} is a file; model.path must be a Hugging Face model directory")
    config_file = path / "config.json"
    try:
        model_config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise UserError(f"{where} has no config.json: not a Hugging Face model directory "
                        "(expected config.json, the weights as *.safetensors and the tokenizer files)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{config_file}: not valid JSON ({err}); the model directory is damaged") from None
    if not isinstance(model_config, dict) or "model_type" not in model_config:
        raise UserError(f"{config_file} has no model_type: not a Hugging Face model config")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
        raise UserError(f"{where} holds no weights (no *.safetensors or *.bin files); did the download or copy finish?")
    if not any((path / name).is_file() for name in TOKENIZER):
        raise UserError(f"{where} has no tokenizer ({', '.join(TOKENIZER)}): copy the tokenizer files of the model "
                        "into it")


def check_data(config: RLConfig) -> None:
    """Parse the problem files as the generators will (the same function): a bad line stops the
    launch here, with its file and line named, instead of after the job started."""
    data = config.data
    if data.type == "arithmetic":
        return
    from ..data.files import load_problems
    from ..reward.verifiers import INTEGER_TYPES

    for path in dict.fromkeys((data.train_path, data.eval_path)):
        load_problems(path, data.type, data.prompt_key, data.answer_key, data.prompt_template, data.dedupe,
                      config.reward.type in INTEGER_TYPES)
