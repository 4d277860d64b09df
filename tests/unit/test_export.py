"""`rltools export`: which checkpoint a name means, what is refused before any work, and the merged
model it writes from a checkpoint (small synthetic models; vLLM's check is in tests/integration)."""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from rltools.config import load_config
from rltools.config.loader import dump_config
from rltools.config.schema import LoraConfig
from rltools.errors import UserError
from rltools.paths import CHECKPOINT_MARKER, RunPaths
from rltools.policy_exports import resolve_checkpoint
from tests.conftest import REPO
from tests.unit.test_cli import run_light

PEFT = "base_model.model."


def fake_checkpoint(paths: RunPaths, step: int, complete: bool = True):
    directory = paths.checkpoint_dir(step)
    directory.mkdir(parents=True)
    if complete:
        (directory / CHECKPOINT_MARKER).write_text("")
    return directory


def test_export_resolves_trainer_checkpoints_only_and_latest_is_the_newest_complete_one(tmp_path):
    paths = RunPaths(tmp_path / "run")
    for step in (10, 30):
        fake_checkpoint(paths, step)
    fake_checkpoint(paths, 40, complete=False)  # a save that never finished
    paths.policy_dir(50).mkdir(parents=True)  # an eval-time export: not a trainer checkpoint
    latest = resolve_checkpoint(paths, "latest", exports=False)
    assert (latest.step, latest.kind, latest.checkpoint) == (30, "checkpoint", paths.checkpoint_dir(30))
    assert resolve_checkpoint(paths, "step_10", exports=False).checkpoint == paths.checkpoint_dir(10)
    with pytest.raises(UserError, match=r"step_40: no complete trainer checkpoint of step 40 .* available: "
                                        r"checkpoints: step_10, step_30 \(latest = step_30\)"):
        resolve_checkpoint(paths, "step_40", exports=False)


def test_no_checkpoint_yet_says_so_and_when_one_comes(tmp_path):
    with pytest.raises(UserError, match=r"no trainer checkpoint yet .*schedule.checkpoint_every.* checkpoints: none"):
        resolve_checkpoint(RunPaths(tmp_path / "run"), "latest", exports=False)
    with pytest.raises(UserError, match="expected base, latest or step_N"):
        resolve_checkpoint(RunPaths(tmp_path / "run"), "final", exports=False)


def test_eval_finds_a_step_that_only_a_checkpoint_holds(tmp_path):
    """`rltools eval` and `rltools export` share the resolution: a step with an export is served from
    it (the checkpoint noted beside it); a step only a checkpoint holds is exported first."""
    from rltools.policy_exports import save_policy
    from rltools.weight_formats import format_named

    paths = RunPaths(tmp_path / "run")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    save_policy(paths.policy_dir(20), [("a.weight", torch.zeros(2))], format_named("full", str(base), LoraConfig()), 20)
    fake_checkpoint(paths, 20)
    fake_checkpoint(paths, 25)
    both = resolve_checkpoint(paths, "step_20")
    assert (both.kind, both.path, both.checkpoint) == ("full", paths.policy_dir(20), paths.checkpoint_dir(20))
    latest = resolve_checkpoint(paths, "latest")
    assert (latest.step, latest.kind, latest.path) == (25, "checkpoint", None)


def test_an_existing_output_is_replaced_only_with_force(tmp_path):
    from rltools.export.write import refuse_overwrite

    out = tmp_path / "out"
    refuse_overwrite(out, force=False)  # absent
    out.mkdir()
    refuse_overwrite(out, force=False)  # empty
    (out / "model.safetensors").write_text("x")
    with pytest.raises(UserError, match=f"{out} exists and is not empty; choose another -o DIR, or pass --force"):
        refuse_overwrite(out, force=False)
    refuse_overwrite(out, force=True)


@pytest.fixture
def run_dir(repo, tmp_path):
    """A demo run directory (as `render` leaves it) with one checkpoint directory."""
    run_dir = tmp_path / "run"
    rendered = run_light("render", str(repo / "configs/demo.yaml"), "--set", f"run.dir={run_dir}", cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    return run_dir


def test_the_command_refuses_before_any_heavy_import(run_dir, tmp_path):
    """Each refusal comes from the run directory alone, on a login node without torch or vLLM."""
    result = run_light("export", str(run_dir), "--format", "merged", cwd=tmp_path)
    assert result.returncode == 2 and "no trainer checkpoint yet" in result.stderr, result.stderr
    fake_checkpoint(RunPaths(run_dir), 10)
    result = run_light("export", str(run_dir), "--checkpoint", "step_3", "--format", "merged", cwd=tmp_path)
    assert result.returncode == 2 and "available: checkpoints: step_10 (latest = step_10)" in result.stderr
    result = run_light("export", str(run_dir), "--checkpoint", "base", "--format", "merged", cwd=tmp_path)
    assert result.returncode == 2 and "nothing to export" in result.stderr
    out = RunPaths(run_dir).export_dir("step_10-merged")
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    result = run_light("export", str(run_dir), "--format", "merged", cwd=tmp_path)
    assert result.returncode == 2 and f"{out} exists and is not empty" in result.stderr
    # the demo adapts lm_head, which vLLM's LoRA support cannot serve: its check would fail
    result = run_light("export", str(run_dir), "--format", "adapter", cwd=tmp_path)
    assert result.returncode == 2 and "adapters include lm_head" in result.stderr and "--no-verify" in result.stderr
    result = run_light("export", str(run_dir), "--format", "adapter", "--quantize", "nvfp4", cwd=tmp_path)
    assert result.returncode == 2 and "--quantize applies to --format merged" in result.stderr


def test_without_torch_here_the_command_says_where_to_run_it(run_dir, tmp_path):
    fake_checkpoint(RunPaths(run_dir), 10)
    result = run_light("export", str(run_dir), "--format", "merged", "--no-verify", cwd=tmp_path)
    assert result.returncode == 2 and "with torch, which is not installed here" in result.stderr
    assert "--slurm" in result.stderr
    result = run_light("export", str(run_dir), "--format", "merged", "--slurm", "--no-verify", cwd=tmp_path,
                       env={**os.environ, "PATH": str(tmp_path)})  # no sbatch
    assert result.returncode == 2 and "sbatch not found" in result.stderr and "`rltools export` with --local" in result.stderr


def test_a_checkpoint_without_the_trainers_probe_cannot_be_checked(run_dir, tmp_path):
    """Checkpoints of an rltools before `rltools export` carry no probe; the run's probes/ has the last
    two versions only. The check is refused before anything is written; the probe file found is used."""
    paths = RunPaths(run_dir)
    fake_checkpoint(paths, 10)
    result = run_light("export", str(run_dir), "--format", "merged", cwd=tmp_path)
    assert result.returncode == 2 and "cannot check the export of step_10" in result.stderr
    assert "--no-verify" in result.stderr and not paths.exports.exists()
    from rltools.export.serve import trainer_probe
    from rltools.runtime.probe import write_probe

    write_probe(paths, 10, [1, 2, 3], [-1.0, -2.0])
    assert trainer_probe(paths, resolve_checkpoint(paths, "step_10", exports=False))[2] == paths.probe_file(10)


# -- the merged model, from a checkpoint written as the trainer writes one -------------------------

def tiny_base(directory, tied: bool = False):
    """A two-layer 'model': embedding, one projection per layer, an output layer unless tied."""
    directory.mkdir()
    torch.manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(10, 4), "model.norm.weight": torch.ones(4),
               **{f"model.layers.{i}.self_attn.q_proj.weight": torch.randn(4, 4) for i in range(2)}}
    if not tied:
        tensors["lm_head.weight"] = torch.randn(10, 4)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32",
                                                       "tie_word_embeddings": tied}))
    (directory / "tokenizer.json").write_text("{}")
    (directory / "chat_template.jinja").write_text("{{ messages }}")
    return tensors


def lora_checkpoint(directory, modules, rank=2):
    """A checkpoint's model state as `train.checkpoints.save` writes it for a peft model (DCP)."""
    torch.manual_seed(1)
    state = {}
    for module, (out_features, in_features) in modules.items():
        state[f"{PEFT}{module}.lora_A.default.weight"] = torch.randn(rank, in_features)
        state[f"{PEFT}{module}.lora_B.default.weight"] = torch.randn(out_features, rank)
    dcp.save({"model": state, "optim": {"state": {}}}, checkpoint_id=directory, no_dist=True)
    (directory / CHECKPOINT_MARKER).write_text("")
    return state


def merged_by_hand(base: dict, state: dict, scale: float) -> dict:
    out = dict(base)
    for name in state:
        if ".lora_A." in name:
            module = name.removeprefix(PEFT).split(".lora_A.")[0]
            a, b = state[name], state[name.replace(".lora_A.", ".lora_B.")]
            weight = base.get(f"{module}.weight", base["model.embed_tokens.weight"])
            out[f"{module}.weight"] = weight + scale * b @ a
    return out


def export_run(tmp_path, base_dir, lora: LoraConfig, chat_template="model"):
    config = load_config(REPO / "configs" / "demo.yaml", [f"run.dir={tmp_path / 'run'}", f"model.path={base_dir}", f"lora.rank={lora.rank}",
                                f"lora.alpha={lora.alpha}", f"lora.target_modules=[{','.join(lora.target_modules)}]",
                                f"data.chat_template={chat_template}"])
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.config.write_text(dump_config(config))
    return config, paths


@pytest.mark.parametrize("tied", [False, True])
def test_the_merged_model_adds_each_adapter_to_its_weight(tmp_path, tied):
    from rltools.export.write import EXPORT_INFO, export_policy

    base = tiny_base(tmp_path / "base", tied)
    lora = LoraConfig(rank=2, alpha=4, target_modules=["q_proj", "lm_head"])
    config, paths = export_run(tmp_path, tmp_path / "base", lora)
    modules = {"model.layers.0.self_attn.q_proj": (4, 4), "model.layers.1.self_attn.q_proj": (4, 4), "lm_head": (10, 4)}
    state = lora_checkpoint(paths.checkpoint_dir(7), modules)
    out = tmp_path / "merged"
    result = export_policy(config, paths.root, resolve_checkpoint(paths, "latest", exports=False), "merged", out,
                           shard_bytes=200, progress=False)  # several shards: the index maps each tensor
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    written = {name: load_file(out / file)[name] for name, file in index.items()}
    expected = merged_by_hand(base, state, lora.alpha / lora.rank)
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(written[name], tensor, rtol=0, atol=1e-6)
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["tie_word_embeddings"] is False  # a tied base's output layer got its own merged copy
    assert result["untied_output_layer"] is tied and result["changed"] == 3 and result["verified"] is None
    assert {"tokenizer.json", "chat_template.jinja", EXPORT_INFO} <= {p.name for p in out.iterdir()}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temporary left behind"


def test_the_adapter_is_peft_named_and_carries_the_runs_chat_template(tmp_path):
    from rltools.export.write import export_policy

    tiny_base(tmp_path / "base")
    template = tmp_path / "run.jinja"
    template.write_text("{{ 'the run template' }}")
    lora = LoraConfig(rank=2, alpha=4, target_modules=["q_proj"])
    config, paths = export_run(tmp_path, tmp_path / "base", lora, chat_template=str(template))
    state = lora_checkpoint(paths.checkpoint_dir(3), {"model.layers.0.self_attn.q_proj": (4, 4)})
    out = tmp_path / "adapter"
    export_policy(config, paths.root, resolve_checkpoint(paths, "step_3", exports=False), "adapter", out, progress=False)
    tensors = load_file(out / "adapter_model.safetensors")
    assert sorted(tensors) == [f"{PEFT}model.layers.0.self_attn.q_proj.lora_{m}.weight" for m in "AB"]
    assert torch.equal(tensors[f"{PEFT}model.layers.0.self_attn.q_proj.lora_A.weight"],
                       state[f"{PEFT}model.layers.0.self_attn.q_proj.lora_A.default.weight"])
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["peft_type"]) == (2, 4.0, "LORA")
    assert (out / "chat_template.jinja").read_text() == template.read_text()
    assert not (out / "config.json").exists()  # an adapter directory is not a model directory


def test_a_failed_check_leaves_nothing_in_place(tmp_path):
    from rltools.export.write import export_policy

    tiny_base(tmp_path / "base")
    config, paths = export_run(tmp_path, tmp_path / "base", LoraConfig(rank=2, alpha=4, target_modules=["q_proj"]))
    lora_checkpoint(paths.checkpoint_dir(3), {"model.layers.0.self_attn.q_proj": (4, 4)})

    def failing(directory):
        assert (directory / "model.safetensors").is_file()  # the check sees the complete export
        raise UserError("the probe disagrees")

    out = tmp_path / "out"
    with pytest.raises(UserError, match="the probe disagrees"):
        export_policy(config, paths.root, resolve_checkpoint(paths, "latest", exports=False), "merged", out,
                      verify=failing, progress=False)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_checkpoint_for_another_model_is_refused_naming_the_weights(tmp_path):
    from rltools.export.write import export_policy

    tiny_base(tmp_path / "base")
    config, paths = export_run(tmp_path, tmp_path / "base", LoraConfig(rank=2, alpha=4, target_modules=["v_proj"]))
    lora_checkpoint(paths.checkpoint_dir(3), {"model.layers.0.self_attn.v_proj": (4, 4)})
    with pytest.raises(UserError, match=r"changes model.layers.0.self_attn.v_proj, which .* has no weight of that name"):
        export_policy(config, paths.root, resolve_checkpoint(paths, "latest", exports=False), "merged",
                      tmp_path / "out", progress=False)


def test_a_checkpoint_carries_the_trainers_probe_of_its_policy(tmp_path):
    from rltools.runtime.probe import write_probe
    from rltools.train import checkpoints

    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    write_probe(paths, 4, [1, 5, 6], [-0.5, -1.5])
    directory = checkpoints.save(paths, 4, model, optimizer, rank=0, keep=2)
    assert json.loads((directory / checkpoints.PROBE).read_text())["logprobs"] == [-0.5, -1.5]
    assert checkpoints.PROBE in json.loads((directory / checkpoints.MANIFEST).read_text())  # checked like the rest
    assert checkpoints.verify(directory) == []
