"""YAML file + `--set` overrides -> a validated `RLConfig`, or a `UserError` that says what to fix.

Invariant: every way a config can be wrong (missing file, YAML syntax, unknown key, wrong type,
bad value) ends in one `UserError` whose message names the file, line or dotted key.
"""

import difflib
import os
import sys
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import UserError
from .schema import RLConfig


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> RLConfig:
    """Read `path`, apply `key.sub=value` overrides in order, validate, and resolve defaults."""
    raw = read_yaml(Path(path))
    for override in overrides:
        apply_override(raw, override)
    return resolve(validate(raw, source=str(path)), config_dir=Path(path).parent)


def read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise UserError(f"{path}: YAML syntax error at {where}: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path}: YAML syntax error: {err}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of sections (run:, model:, ...), got {type(data).__name__}")
    return data


def apply_override(raw: dict, override: str) -> None:
    """Apply one `dotted.key=value`; the value is parsed as YAML (3 -> int, [a, b] -> list)."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {override!r}: expected dotted.key=value, e.g. --set schedule.steps=10")
    try:
        value = yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.strip().split(".")
    for depth, part in enumerate(parts[:-1]):
        if node.get(part) is None:  # absent, or null as a dumped config has an optional section that is off
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise UserError(f"--set {override!r}: {'.'.join(parts[:depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: dict, source: str) -> RLConfig:
    try:
        return RLConfig.model_validate(raw)
    except ValidationError as err:
        lines = [_describe(e) for e in err.errors()]
        raise UserError(f"{source}: invalid config:\n  " + "\n  ".join(lines)) from None


def resolve(config: RLConfig, config_dir: Path) -> RLConfig:
    """Fill what depends on where rltools runs: absolute paths (job steps may start elsewhere) and
    the interpreter. Relative model, judge model, data, eval set, chat template and lora.init_from
    paths are relative to the config file, so a config works from any directory; run.dir is relative to the current directory, like sbatch's output.
    Resolving a resolved config changes nothing."""
    run_dir = _absolute(config.run.dir or str(Path("runs") / config.run.name))
    python = config.cluster.python or sys.executable
    if os.sep in python:  # a bare name like python3 is looked up on PATH by each task
        python = _absolute(python)
    return config.model_copy(
        update={
            "run": config.run.model_copy(update={"dir": run_dir}),
            "model": config.model.model_copy(update={"path": _absolute(config.model.path, config_dir)}),
            "data": _absolute_data(config.data, config_dir),
            "eval": config.eval.model_copy(update={"sets": {
                name: spec.model_copy(update={"path": _absolute(spec.path, config_dir)}) if spec.path else spec
                for name, spec in config.eval.sets.items()}}),
            "lora": config.lora.model_copy(update={"init_from": _absolute(config.lora.init_from, config_dir)})
            if config.lora.init_from else config.lora,
            "cluster": config.cluster.model_copy(update={"python": python}),
            "reward": config.reward.model_copy(update={"judge": config.reward.judge.model_copy(
                update={"model": _absolute(config.reward.judge.model, config_dir)})})
            if config.reward.judge.model else config.reward,
        }
    )


def _absolute_data(data, config_dir: Path):
    """The data section with its files (and a chat template file) relative to the config file."""
    update = {key: _absolute(getattr(data, key), config_dir) for key in ("train_path", "eval_path") if getattr(data, key)}
    update["train_mix"] = [s.model_copy(update={"path": _absolute(s.path, config_dir)}) for s in data.train_mix]
    if data.chat_template not in ("model", "none"):
        update["chat_template"] = _absolute(data.chat_template, config_dir)
    return data.model_copy(update=update)


def _absolute(path: str, base: Path | None = None) -> str:
    """`path` made absolute against `base` (default: the current directory), normalised."""
    return os.path.normpath((base or Path.cwd()).absolute() / path)


def dump_config(config: RLConfig) -> str:
    """The resolved config as YAML, in schema order; load_config reads it back unchanged."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _describe(error: dict) -> str:
    loc = [str(p) for p in error["loc"] if not str(p).startswith("function-")]
    key = ".".join(loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        valid = _fields_at(error["loc"][:-1])
        close = difflib.get_close_matches(str(error["loc"][-1]), valid, n=1, cutoff=0.5)
        hint = f"; did you mean '{'.'.join(loc[:-1] + close)}'?" if close else ""
        return f"unknown key '{key}'{hint} (valid keys here: {', '.join(valid)})"
    if error["type"] == "missing":
        return f"missing required key '{key}'"
    message = error["msg"].removeprefix("Value error, ")
    if "[key]" in loc:  # a bad mapping key: say which one
        return f"{'.'.join(loc[:loc.index('[key]') - 1])}: key {error['input']!r} {message}"
    if isinstance(error["input"], dict):  # a check across fields: the message names them
        return f"{key}: {message}"
    expected = _annotation_at(error["loc"])
    expected_text = f" (expected {expected})" if expected else ""
    return f"{key}: {message}{expected_text}; got {error['input']!r}"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = RLConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        model = _first_model(field.annotation)
        if model is None:
            return None
    return model


def _fields_at(loc: tuple) -> list[str]:
    model = _model_at(tuple(loc))
    return list(model.model_fields) if model else []


def _annotation_at(loc: tuple) -> str | None:
    model = _model_at(tuple(loc[:-1]))
    field = model.model_fields.get(loc[-1]) if model and loc and isinstance(loc[-1], str) else None
    return type_name(field.annotation) if field else None


def _first_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _first_model(arg)
        if found:
            return found
    return None


def type_name(annotation: Any) -> str:
    """A readable type name: int, str or null, one of 'a' | 'b', list of str."""
    origin = getattr(annotation, "__origin__", None)
    args = get_args(annotation)
    if origin is not None and getattr(origin, "_name", "") == "Literal" or str(origin) == "typing.Literal":
        return "one of " + " | ".join(repr(a) for a in args)
    if args and origin in (list, dict):
        inner = " -> ".join(type_name(a) for a in args)
        return f"{origin.__name__} of {inner}"
    if args and type(annotation).__name__ in ("UnionType", "_UnionGenericAlias"):
        return " or ".join(type_name(a) for a in args)
    if args:  # Annotated[str, ...]
        return type_name(args[0])
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))
