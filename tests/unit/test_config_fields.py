"""Every config field is read by the code that runs: a field that is declared, documented and set in
a config but read nowhere (as `trainer.gradient_checkpointing` once was) is a setting silently ignored.

How strong the check is. A field `<section>.<field>` counts as read when rltools/ (outside
the schema, loader and reference modules, which only declare, parse and document fields) or a
template under templates/ reads `<ref>.<field>` or `getattr(<ref>, "<field>")`, where `<ref>` is a
reference to that section:

- an attribute named after the section: `config.trainer.gradient_checkpointing`, `self.algorithm.kl_coef`,
  `config.cluster.generators.nodes`;
- or a field that a class declares with the section's type (`resources: ComponentConfig` in a
  dataclass), in any file: `component.resources.mem`;
- or a name the same file binds to the section: annotated with its class (`lora_cfg: LoraConfig`),
  or assigned from another reference (`t = config.trainer`, `r = component.resources`,
  `gens, trainers = config.cluster.generators, config.cluster.trainers`).

A bare attribute name is not enough: `config.gradient_checkpointing` on TRL's GRPOConfig in
rltools/bench would otherwise have hidden the unread trainer field. What is left is static and
per file, not a type checker: a name bound to a section in one function of a file counts in every
function of that file, and a field read but then ignored (`_ = config.trainer.x`) passes. Fields of
a class used in two places (`cluster.generators` and `cluster.trainers`, both ComponentConfig) are
checked per class.
"""

import ast
from pathlib import Path
from types import UnionType
from typing import get_args

import jinja2
from jinja2 import nodes
from pydantic import BaseModel

from rltools.config.schema import RLConfig

ROOT = Path(__file__).resolve().parents[2]
DECLARE_ONLY = {"rltools/config/schema.py", "rltools/config/cluster.py", "rltools/config/inputs.py", "rltools/config/rewards.py",
                "rltools/config/trackers.py", "rltools/config/loader.py", "rltools/config/reference.py"}


def section_type(annotation) -> type[BaseModel] | None:
    """The section class of a field: `TrainerConfig`, or an optional one (`WandbConfig | None`: absent = off)."""
    if isinstance(annotation, UnionType):
        models = [a for a in get_args(annotation) if a is not type(None)]
        annotation = models[0] if len(models) == 1 else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def config_fields(model: type[BaseModel] = RLConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, section class name, field name) of every leaf field, e.g.
    ("cluster.generators.nodes", "ComponentConfig", "nodes")."""
    fields = []
    for name, field in model.model_fields.items():
        kind = section_type(field.annotation)
        if kind is not None:
            fields += config_fields(kind, f"{prefix}{name}.")
        else:
            fields.append((f"{prefix}{name}", model.__name__, name))
    return fields


def section_keys(model: type[BaseModel] = RLConfig) -> dict[str, str]:
    """Attribute name -> section class name: {"trainer": "TrainerConfig", "generators": "ComponentConfig", ...}."""
    keys = {}
    for name, field in model.model_fields.items():
        kind = section_type(field.annotation)
        if kind is not None:
            keys[name] = kind.__name__
            keys.update(section_keys(kind))
    return keys


def _terminal(node: ast.expr) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def _section_type(annotation: ast.expr | None, classes: set[str]) -> str | None:
    """The section class an annotation names (`LoraConfig`, `ComponentConfig | None`), if one."""
    named = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} & classes if annotation else set()
    return named.pop() if len(named) == 1 else None


def _assignments(tree: ast.AST):
    """(target, value) of every assignment, tuples unpacked: `a, b = x, y` gives (a, x) and (b, y)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    yield from zip(target.elts, node.value.elts)
                else:
                    yield target, node.value


def python_reads(tree: ast.AST, keys: dict[str, str]) -> set[tuple[str, str]]:
    """(section class name, field) of every section field the module reads."""
    classes = set(keys.values())
    bound: dict[str, str] = {}  # names this file binds to a section

    def section_of(node: ast.expr) -> str | None:
        name = _terminal(node)
        return (keys.get(name) if isinstance(node, ast.Attribute) else None) or bound.get(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _section_type(node.annotation, classes):
            bound[node.arg] = _section_type(node.annotation, classes)
        elif isinstance(node, ast.AnnAssign) and _section_type(node.annotation, classes) and _terminal(node.target):
            bound[_terminal(node.target)] = _section_type(node.annotation, classes)
    assignments = list(_assignments(tree))
    for _ in range(3):  # chains: `cluster = config.cluster; gens = cluster.generators; r = gens`
        for target, value in assignments:
            if _terminal(target) and section_of(value):
                bound[_terminal(target)] = section_of(value)
    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and section_of(node.value):
            reads.add((section_of(node.value), node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and section_of(node.args[0])):
            reads.add((section_of(node.args[0]), node.args[1].value))
    return reads


def template_reads(source: str, keys: dict[str, str]) -> set[tuple[str, str]]:
    """(section class name, field) of every `{{ ... <section>.<field> }}` in a Jinja template."""
    reads = set()
    for node in jinja2.Environment().parse(source).find_all(nodes.Getattr):
        holder = node.node.name if isinstance(node.node, nodes.Name) else getattr(node.node, "attr", None)
        if holder in keys:
            reads.add((keys[holder], node.attr))
    return reads


def holder_fields(trees: list[ast.AST], classes: set[str]) -> dict[str, str]:
    """Attribute name -> section class name of class-body fields declared with a section's type
    (`resources: ComponentConfig` in a dataclass): `component.resources` is a reference in any file."""
    holders = {}
    for tree in trees:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in cls.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    if _section_type(node.annotation, classes):
                        holders[node.target.id] = _section_type(node.annotation, classes)
    return holders


def all_reads() -> set[tuple[str, str]]:
    files = sorted((ROOT / "rltools").rglob("*.py"))
    trees = [ast.parse(p.read_text(), str(p)) for p in files if p.relative_to(ROOT).as_posix() not in DECLARE_ONLY]
    keys = section_keys()
    keys |= holder_fields(trees, set(keys.values()))
    reads = set()
    for tree in trees:
        reads |= python_reads(tree, keys)
    for path in sorted((ROOT / "templates").rglob("*.j2")):
        reads |= template_reads(path.read_text(), keys)
    return reads


def test_every_config_field_is_read_somewhere():
    reads = all_reads()
    unread = [key for key, section, field in config_fields() if (section, field) not in reads]
    assert not unread, (
        f"config fields read nowhere outside rltools/config: {', '.join(unread)} — a user setting them "
        "changes nothing: pass each to the component that should honour it, or remove it from the schema"
    )


def test_the_check_sees_section_references_and_not_bare_names():
    keys = section_keys()
    code = """
def build(config, lora_cfg: LoraConfig, other):
    t = config.trainer
    gens, _ = config.cluster.generators, None
    use(t.micro_batch_size, lora_cfg.rank, gens.mem, getattr(config.algorithm, "kl_coef"), config.model.path)
    use(other.gradient_checkpointing, config.dropout)  # bare names: not a section's fields
"""
    assert python_reads(ast.parse(code), keys) == {
        ("TrainerConfig", "micro_batch_size"), ("LoraConfig", "rank"), ("ComponentConfig", "mem"),
        ("AlgorithmConfig", "kl_coef"), ("ModelConfig", "path"), ("ClusterConfig", "generators"),
    }
    assert template_reads("{{ cluster.qos }} {{ run_name }}", keys) == {("ClusterConfig", "qos")}
