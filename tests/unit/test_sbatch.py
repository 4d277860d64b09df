import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from rltools.cli import main
from rltools.config import RLConfig, load_config
from rltools.config.loader import type_name
from rltools.launch.sbatch import render_sbatch

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
FIXED = ["run.dir=/scratch/rltools/runs/golden", "cluster.python=/opt/rltools/venv/bin/python"]


def render(repo, name, *overrides):
    return render_sbatch(load_config(repo / "configs" / name, [*FIXED, *overrides]))


@pytest.mark.parametrize("name", ["demo", "aime"])
def test_golden_scripts(repo, name, monkeypatch):
    """The rendered scripts match tests/golden; RLTOOLS_UPDATE_GOLDEN=1 rewrites them after a reviewed change."""
    for var in ("RLTOOLS_RUNS", "RLTOOLS_AIME_MODEL", "RLTOOLS_DATA", "RLTOOLS_TINY_MODEL"):
        monkeypatch.delenv(var, raising=False)
    script = render(repo, f"{name}.yaml", "cluster.launcher=slurm")
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("RLTOOLS_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()


@pytest.mark.parametrize("name", ["demo.yaml", "aime.yaml"])
def test_script_is_one_hetjob_with_both_components(repo, name):
    script = render(repo, name)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives.count("#SBATCH hetjob") == 1
    split = directives.index("#SBATCH hetjob")
    for block in (directives[:split], directives[split + 1 :]):
        for option in ("--nodes=", "--ntasks-per-node=", "--cpus-per-task=", "--output=/scratch/", "--error=/scratch/"):
            assert any(option in line for line in block), (option, block)
    assert any("--job-name=" in line for line in directives[:split])
    assert any(line.startswith("#SBATCH --signal=USR2@") for line in directives)
    assert re.search(r"^srun --het-group=0 .*RLTOOLS_ROLE=generator", script, re.M)
    assert re.search(r"^srun --het-group=1 .*RLTOOLS_ROLE=trainer", script, re.M)
    # sbatch stops reading directives at the first command: all of them must come before it.
    first_command = next(i for i, line in enumerate(script.splitlines()) if line and not line.startswith("#"))
    assert all(script.splitlines().index(d) < first_command for d in directives)


def test_optional_sbatch_options(repo):
    script = render(
        repo,
        "demo.yaml",
        "cluster.partition=cpu",
        "cluster.account=proj1",
        "cluster.qos=preempt",
        "cluster.trainers.partition=gpu",
        "cluster.trainers.gpus_per_node=2",
        "cluster.trainers.ntasks_per_node=2",
        "cluster.requeue=false",
        "cluster.sbatch_extra={constraint: 'a100|h100', exclusive: ''}",
    )
    for line in (
        "--account=proj1", "--qos=preempt", "--no-requeue", "--constraint=a100|h100", "--exclusive",
        "--partition=cpu", "--partition=gpu", "--gpus-per-node=2",
    ):
        assert f"#SBATCH {line}\n" in script


def test_samples_must_split_over_trainer_ranks(repo, capsys):
    argv = ["submit", str(repo / "configs/demo.yaml"), "--dry-run", "--set", "cluster.trainers.ntasks_per_node=3"]
    assert main(argv) == 2
    assert "128 samples per step do not split evenly over 3 trainer ranks" in capsys.readouterr().err


def test_topology_mismatch_is_a_user_error(repo, capsys):
    argv = ["submit", str(repo / "configs/aime.yaml"), "--dry-run", "--set", "cluster.trainers.ntasks_per_node=2"]
    assert main(argv) == 2
    assert "cluster.trainers.ntasks_per_node (2) must equal cluster.trainers.gpus_per_node (4)" in capsys.readouterr().err


# ---- hostile strings --------------------------------------------------------------------------

PAYLOADS = [
    "x'; touch pwned; '",
    "$(touch pwned)",
    "`touch pwned`",
    "$(touch${IFS}pwned)",
    '"; touch pwned; "',
    "a\ntouch pwned",
]
# cluster.setup is the user's own shell code by design (like lines in a hand-written sbatch).
VERBATIM = {"cluster.setup"}


def string_fields(model: type[BaseModel] = RLConfig, prefix: str = "") -> list[tuple[str, str]]:
    """Every config key a user can put a string into, with its kind (str, list, dict-value, dict-key)."""
    found = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += string_fields(annotation, key + ".")
        elif key not in VERBATIM:
            kind = type_name(annotation)
            if kind.startswith("dict"):
                found += [(key, "dict-key"), (key, "dict-value")]
            elif kind.startswith("list") and "str" in kind:
                found.append((key, "list"))
            elif "str" in kind:
                found.append((key, "str"))
    return found


def test_every_string_field_is_covered():
    keys = {key for key, _ in string_fields()}
    assert {"run.name", "run.dir", "cluster.python", "cluster.environment", "cluster.sbatch_extra"} <= keys
    assert len(keys) >= 15


def set_nested(raw: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        raw = raw.setdefault(part, {})
    raw[last] = value


@pytest.fixture
def stub_srun(tmp_path):
    """A fake srun that records its argv and environment, so the rendered script can run here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "with open(os.environ['STUB_LOG'], 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}) + '\\n')\n"
    )
    srun.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("key,kind", string_fields())
@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
def test_hostile_string_never_executes(repo, tmp_path, stub_srun, monkeypatch, capsys, key, kind, payload):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    value = {"str": payload, "list": [payload], "dict-value": {"HOSTILE": payload}, "dict-key": {payload: "v"}}[kind]
    if key == "run.dir":
        value = f"{work}/{payload}"
    model = repo / "rltools" / "assets" / "tiny-arith"  # render checks that the model directory is one
    raw = {"run": {"name": "t", "dir": str(work / "run")}, "model": {"path": str(model)}, "cluster": {"launcher": "slurm"}}
    set_nested(raw, key, value)
    config_file = work / "hostile.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    script = work / "job.sbatch"

    if main(["render", str(config_file), "-o", str(script)]) == 2:
        err = capsys.readouterr().err
        assert key.split(".")[-1] in err or "run.dir" in err, err  # the rejection names what to fix
        return
    log = work / "srun.log"
    env = {**os.environ, "PATH": f"{stub_srun}:{os.environ['PATH']}", "STUB_LOG": str(log)}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")} | {"SLURM_JOB_ID": "4242"}
    result = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not list(work.rglob("pwned")), f"{key}={payload!r} executed"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2  # the script ran to its job steps, past every place a value lands
    if key == "cluster.environment" and kind == "dict-value":
        assert all(call["env"]["HOSTILE"] == payload for call in calls)
    if key == "cluster.python":
        assert all(payload in call["argv"] for call in calls)


def test_setup_lines_must_be_single_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run": {"name": "t"}, "model": {"path": "/m"}, "cluster": {"setup": ["a\nb"]}}))
    with pytest.raises(Exception, match="cluster.setup.0: must be a single line"):
        load_config(path)


# ---- run directory ----------------------------------------------------------------------------


def test_render_prepares_private_run_dir(repo, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "demo"
    out = tmp_path / "job.sbatch"
    assert main(["render", str(repo / "configs/demo.yaml"), "--set", f"run.dir={run_dir}", "-o", str(out)]) == 0
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    secret = run_dir / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text()) == 64
    assert load_config(run_dir / "config.yaml") == load_config(repo / "configs/demo.yaml", [f"run.dir={run_dir}"])
    assert out.read_text() == (run_dir / "slurm" / "job.sbatch").read_text()
    assert f"sbatch {out}" in capsys.readouterr().err

    first_secret = secret.read_text()
    assert main(["render", str(repo / "configs/demo.yaml"), "--set", f"run.dir={run_dir}"]) == 0
    assert secret.read_text() == first_secret  # re-rendering keeps the secret peers already use


def test_render_refuses_a_run_dir_with_another_config(repo, tmp_path, capsys):
    run_dir = tmp_path / "run"
    base = ["render", str(repo / "configs/demo.yaml"), "--set", f"run.dir={run_dir}"]
    assert main(base) == 0
    assert main(base + ["--set", "schedule.steps=99"]) == 2
    assert "already holds a different config" in capsys.readouterr().err


def test_dry_run_prints_script_and_topology_and_creates_nothing(repo, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["submit", str(repo / "configs/aime.yaml"), "--dry-run", "--set", f"run.dir={run_dir}"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/bin/bash") and "#SBATCH hetjob" in out
    assert "component 0 generators: 4 node(s)" in err and "component 1 trainers: 4 node(s) x 4 task(s)" in err
    assert not run_dir.exists()
