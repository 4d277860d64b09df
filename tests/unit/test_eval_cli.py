"""`rltools eval` argument handling: bad input is refused before any heavy import (vLLM, torch)."""

import os

import pytest

from tests.unit.test_cli import run_light


def test_eval_names_the_checkpoints_that_exist(repo, tmp_path):
    run_dir = tmp_path / "run"
    rendered = run_light("render", str(repo / "configs/demo.yaml"), "--set", f"run.dir={run_dir}", cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    result = run_light("eval", str(run_dir), "--checkpoint", "latest", cwd=tmp_path)
    assert result.returncode == 2
    assert f"no policy export or trainer checkpoint yet in {run_dir}" in result.stderr
    assert "available: base; exports: none; checkpoints: none" in result.stderr
    result = run_light("eval", str(run_dir), "--checkpoint", "step_7", cwd=tmp_path)
    assert result.returncode == 2 and "step_7: no complete policy export or trainer checkpoint of step 7" in result.stderr


def test_eval_refuses_overrides_of_a_run_directory_and_bad_k(repo, tmp_path):
    run_dir = tmp_path / "run"
    run_light("render", str(repo / "configs/demo.yaml"), "--set", f"run.dir={run_dir}", cwd=tmp_path)
    result = run_light("eval", str(run_dir), "--set", "eval.k=4", cwd=tmp_path)
    assert result.returncode == 2 and "--set applies to a CONFIG file" in result.stderr
    result = run_light("eval", str(repo / "configs/demo.yaml"), "--k", "0", cwd=tmp_path)
    assert result.returncode == 2 and "--k must be >= 1" in result.stderr


def test_eval_of_a_config_without_a_run_has_only_base(repo, tmp_path):
    result = run_light("eval", str(repo / "configs/demo.yaml"), "--set", f"run.dir={tmp_path}/none", cwd=tmp_path)
    assert result.returncode == 2 and f"no policy export or trainer checkpoint yet in {tmp_path}/none" in result.stderr


def test_vllms_output_is_kept_out_of_sight_and_shown_when_the_evaluation_fails(capfd):
    from rltools.cli.eval import _output_to_log

    with _output_to_log():
        os.write(2, b"INFO engine chatter\n")
        os.write(1, b"more chatter\n")
    assert capfd.readouterr() == ("", ""), "a clean evaluation shows none of it"
    with pytest.raises(RuntimeError), _output_to_log():
        os.write(2, b"the engine's last words\n")
        raise RuntimeError("engine failed")
    err = capfd.readouterr().err
    assert "the engine's last words" in err and "vLLM's whole output: " in err
    os.unlink(err.split("vLLM's whole output: ")[1].split(")")[0])
