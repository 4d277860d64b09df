"""The layering of docs/architecture.md holds: every import in rltools/ is an edge its table allows,
no two packages (or modules) import each other in a cycle, and the login side loads no torch.

Imports inside functions count like module-level ones: a lazy import is still a dependency, it only
moves the cost. A package is `rltools.<name>` (a top-level module counts as its own package).
"""

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
LOGIN_SIDE = ["rltools.cli", "rltools.completions", "rltools.config", "rltools.config.reference",
              "rltools.launch.local", "rltools.launch.preflight", "rltools.launch.run_dir", "rltools.launch.run_lock",
              "rltools.launch.sbatch", "rltools.launch.slurm", "rltools.monitor.logs", "rltools.monitor.progress",
              "rltools.monitor.status", "rltools.plot", "rltools.policy_exports", "rltools.weight_formats"]
HEAVY = ("torch", "vllm", "transformers", "megatron", "peft", "wandb", "mlflow")


def allowed_edges() -> dict[str, set[str]]:
    """package -> packages it may import, from the table in docs/architecture.md."""
    rows = re.findall(r"^\| `(\w+)` \|[^|]*\|[^|]*\| ?([^|\n]*)\|$", DOC.read_text(), re.MULTILINE)
    return {name: set(re.findall(r"`(\w+)`", may)) for name, may in rows}


def module_imports() -> dict[str, set[str]]:
    """module -> rltools modules it imports (at any depth of its code)."""
    files = {_module(p): p for p in (ROOT / "rltools").rglob("*.py")}
    edges = defaultdict(set)
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, module, path.name == "__init__.py"):
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != module and target != "rltools":
                    edges[module].add(target)
    return {module: edges[module] for module in files}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.startswith("rltools")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if not source.startswith("rltools"):
        return []
    return [f"{source}.{alias.name}" for alias in node.names]  # a module or a name in `source`: trimmed above


def package(module: str) -> str:
    return module.split(".")[1]


def package_edges() -> dict[str, set[str]]:
    edges = defaultdict(set)
    for module, targets in module_imports().items():
        for target in targets:
            if package(target) != package(module):
                edges[package(module)].add(package(target))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def test_every_import_is_an_edge_the_architecture_allows():
    allowed = allowed_edges()
    assert {"launch", "runtime", "train", "jobs", "cli"} <= set(allowed)  # the table was read
    packages = {package(m) for m in module_imports() if m != "rltools"}
    assert packages - set(allowed) == set(), "packages missing from the table in docs/architecture.md"
    forbidden = sorted(f"{a} -> {b}" for a, targets in package_edges().items() for b in targets if b not in allowed[a])
    assert forbidden == [], "imports docs/architecture.md does not allow (fix the import, or the table with a reason)"


def test_no_import_cycles_between_packages_or_modules():
    assert cycles(package_edges()) == []
    assert cycles(module_imports()) == []


def test_the_rules_the_table_encodes():
    allowed = allowed_edges()
    for login in ("launch", "monitor", "plot"):
        assert allowed[login] & {"train", "generate", "weight_sync", "eval", "jobs"} == set(), login
    for job in ("train", "generate", "weight_sync", "rollout", "reward", "algorithms", "runtime"):
        assert "launch" not in allowed[job], job


def test_the_checker_sees_a_forbidden_edge_and_a_cycle(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    lazy = ast.parse("def f():\n    from ..launch.plan import plan\n")
    (node,) = [n for n in ast.walk(lazy) if isinstance(n, ast.ImportFrom)]
    assert _targets(node, "rltools.train.loop", False) == ["rltools.launch.plan.plan"]


def test_the_login_side_imports_no_torch_or_vllm():
    code = (f"import importlib, sys\nfor m in {LOGIN_SIDE!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


VLLM_SEAM = {"rltools.generate.vllm_engine", "rltools.generate.worker_ext"}


def vllm_importers(root: Path) -> set[str]:
    """The modules under `root`/rltools that import vLLM (at any depth of their code)."""
    found = set()
    for path in (root / "rltools").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(name == "vllm" or name.startswith("vllm.") for name in names):
                found.add(".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"))
    return found


def test_only_the_vllm_seam_imports_vllm():
    """Every private vLLM call is listed in generate/vllm_engine.py with the release it was checked
    against; an import of vLLM elsewhere would bypass that list."""
    assert vllm_importers(ROOT) <= VLLM_SEAM, sorted(vllm_importers(ROOT) - VLLM_SEAM)


def test_the_seam_check_sees_a_stray_vllm_import(tmp_path):
    stray = tmp_path / "rltools" / "eval"
    stray.mkdir(parents=True)
    (stray / "score.py").write_text("def f():\n    from vllm.lora.request import LoRARequest\n")
    (stray / "fine.py").write_text("from .vllm_helpers import x\nimport vllmish\n")
    assert vllm_importers(tmp_path) == {"rltools.eval.score"}
