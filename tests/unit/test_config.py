import subprocess
import sys
import textwrap

import pytest

from rltools.cli import main
from rltools.config import dump_config, load_config
from rltools.errors import UserError

MINIMAL = """\
run:
  name: t
model:
  path: /models/m
"""


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def cli_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_every_shipped_config_validates_and_renders(repo, tmp_path, capsys):
    names = sorted(path.name for path in (repo / "configs").glob("*.yaml"))
    assert {"demo.yaml", "aime.yaml", "moe-demo.yaml", "tool-demo.yaml", "aime-tools.yaml"} <= set(names)
    for name in names:
        config = load_config(repo / "configs" / name)
        assert config.run.name and config.schedule.group_size == 8
        assert main(["submit", str(repo / "configs" / name), "--dry-run", "--set", f"run.dir={tmp_path / name}"]) == 0
        assert capsys.readouterr().out.startswith("#!/bin/bash"), name


def test_the_tool_configs_use_their_tools(repo):
    demo, aime = (load_config(repo / "configs" / name) for name in ("tool-demo.yaml", "aime-tools.yaml"))
    assert (demo.env.type, demo.env.tools, demo.data.type) == ("tools", ["calculator"], "products")
    assert (aime.env.type, aime.env.tools, aime.reward.type) == ("tools", ["python"], "boxed_integer")
    assert "<tool_call>" in aime.data.prompt_template and "{observation}" in aime.env.observation_template


def test_aime_is_the_seed_scenario(repo):
    c = load_config(repo / "configs" / "aime.yaml")
    assert c.model.quantization == "nvfp4" and c.lora.enabled
    assert c.schedule.steps == 75 and c.cluster.launcher == "slurm"
    assert c.cluster.generators.nodes + c.cluster.trainers.nodes == 8
    assert c.cluster.generators.gpus_per_node == c.cluster.trainers.gpus_per_node == 4
    assert c.reward.type == "boxed_integer"


def test_unknown_key_names_dotted_path_and_closest_key(tmp_path, capsys):
    path = write(tmp_path, MINIMAL + "cluster:\n  generators:\n    gpu_per_node: 4\n")
    err = cli_error(capsys, "submit", str(path), "--dry-run")
    assert "unknown key 'cluster.generators.gpu_per_node'" in err
    assert "did you mean 'cluster.generators.gpus_per_node'?" in err


def test_unknown_key_from_set_override(tmp_path, capsys):
    path = write(tmp_path, MINIMAL)
    err = cli_error(capsys, "submit", str(path), "--dry-run", "--set", "schedule.step=3")
    assert "unknown key 'schedule.step'" in err and "did you mean 'schedule.steps'?" in err


def test_wrong_type_names_key_expected_type_and_value(tmp_path, capsys):
    path = write(tmp_path, MINIMAL + "schedule:\n  steps: many\n")
    err = cli_error(capsys, "submit", str(path), "--dry-run")
    assert "schedule.steps" in err and "expected int" in err and "'many'" in err


def test_wrong_choice_lists_choices(tmp_path):
    with pytest.raises(UserError, match=r"cluster\.launcher.*'slurm' \| 'local'.*got 'pbs'"):
        load_config(write(tmp_path, MINIMAL), ["cluster.launcher=pbs"])


def test_missing_required_key(tmp_path):
    with pytest.raises(UserError, match=r"missing required key 'model.path'"):
        load_config(write(tmp_path, "run: {name: t}\nmodel: {}\n"))


def test_missing_file_names_path(tmp_path, capsys):
    err = cli_error(capsys, "submit", str(tmp_path / "nope.yaml"), "--dry-run")
    assert f"config file not found: {tmp_path / 'nope.yaml'}" in err


def test_yaml_syntax_error_names_line(tmp_path, capsys):
    path = write(tmp_path, "run:\n  name: t\nmodel:\n  path: [unclosed\n  dtype: float32\n")
    err = cli_error(capsys, "render", str(path))
    assert str(path) in err and "YAML syntax error at line" in err
    line = int(err.split("line ")[1].split(",")[0])
    assert 4 <= line <= 5


def test_cross_field_error_names_the_keys(tmp_path):
    with pytest.raises(UserError, match=r"trainer.tensor_parallel needs trainer.backend: megatron"):
        load_config(write(tmp_path, MINIMAL), ["trainer.tensor_parallel=2"])


def test_set_overrides_parse_yaml_values(tmp_path):
    c = load_config(
        write(tmp_path, MINIMAL),
        ["schedule.steps=7", "lora.target_modules=[q_proj, v_proj]", "cluster.requeue=false", "run.seed=3"],
    )
    assert c.schedule.steps == 7 and c.lora.target_modules == ["q_proj", "v_proj"]
    assert c.cluster.requeue is False and c.run.seed == 3


def test_set_without_equals_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="expected dotted.key=value"):
        load_config(write(tmp_path, MINIMAL), ["schedule.steps"])


def test_env_expansion_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("RLT_MODELS", "/lustre/models")
    monkeypatch.delenv("RLT_UNSET", raising=False)
    c = load_config(write(tmp_path, "run: {name: t, dir: '${RLT_UNSET:-/scratch}/runs/t'}\nmodel: {path: '${RLT_MODELS}/m'}\n"))
    assert c.model.path == "/lustre/models/m"
    assert c.run.dir == "/scratch/runs/t"


def test_unset_env_var_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("RLT_UNSET", raising=False)
    with pytest.raises(UserError, match=r"model.path: environment variable RLT_UNSET is not set"):
        load_config(write(tmp_path, "run: {name: t}\nmodel: {path: '${RLT_UNSET}/m'}\n"))


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (tmp_path / "configs").mkdir()
    c = load_config(write(tmp_path / "configs", "run: {name: t}\nmodel: {path: ../models/m}\n"))
    assert c.run.dir == str(work / "runs" / "t")  # like sbatch: relative to where you submit
    assert c.model.path == str(tmp_path / "models" / "m")  # relative to the config file
    assert c.cluster.python == sys.executable
    c = load_config(write(tmp_path / "configs", "run: {name: t}\nmodel: {path: m}\nlora: {init_from: a/step_2}\n"
                          "data: {train_mix: [{path: d/x.parquet}], eval_path: d/e.jsonl, chat_template: t.jinja}\n"
                          "eval: {sets: {s: {path: d/s.jsonl}}}\n"))
    configs = tmp_path / "configs"  # every file the job reads, relative to the config file
    assert (c.data.train_mix[0].path, c.data.eval_path, c.data.chat_template) == \
        (str(configs / "d/x.parquet"), str(configs / "d/e.jsonl"), str(configs / "t.jinja"))
    assert (c.eval.sets["s"].path, c.lora.init_from) == (str(configs / "d/s.jsonl"), str(configs / "a/step_2"))


def test_resolved_config_round_trips(repo, tmp_path):
    config = load_config(repo / "configs" / "aime.yaml")
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_cli_module_entry_exits_2_on_bad_input(tmp_path):
    path = write(tmp_path, MINIMAL + "bogus: 1\n")
    result = subprocess.run([sys.executable, "-m", "rltools", "submit", str(path), "--dry-run"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown key 'bogus'" in result.stderr and "Traceback" not in result.stderr
