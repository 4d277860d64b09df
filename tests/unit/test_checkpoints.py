import json

import pytest
import torch
from safetensors.torch import load_file

from rltools.config.schema import LoraConfig, RLConfig
from rltools.errors import UserError
from rltools.paths import RunPaths
from rltools.policy_exports import (
    EXPORT_MARKER,
    PolicyWriter,
    resolve_checkpoint,
    save_policy,
)
from rltools.runtime.roles import eval_due
from rltools.weight_formats import FullWeights, format_named


def make_config(**schedule) -> RLConfig:
    return RLConfig.model_validate({"run": {"name": "t"}, "model": {"path": "m"}, "schedule": schedule})


def export(paths, step, base, kind="full"):
    tensors = [("model.embed_tokens.weight", torch.full((2, 3), float(step)))]
    save_policy(paths.policy_dir(step), tensors, format_named(kind, str(base), LoraConfig(rank=4, target_modules=["q_proj"])), step)


@pytest.fixture
def base(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "tokenizer.json").write_text("{}")
    (base / "model.safetensors").write_text("base weights: never copied")
    return base


def test_a_full_export_larger_than_a_shard_is_written_shard_by_shard(tmp_path, base):
    """The trainer adds tensors as they are broadcast; each shard is written once it fills, so the
    writer holds one shard's tensors, and the result is a sharded HF checkpoint with its index."""
    target = tmp_path / "run" / "weights" / "step_3"
    writer = PolicyWriter(target, FullWeights(str(base), LoraConfig()), 3, shard_bytes=100)
    tensors = {f"model.layers.{i}.mlp.down_proj.weight": torch.full((4, 4), float(i)) for i in range(5)}  # 64 B each
    for i, (name, tensor) in enumerate(tensors.items()):
        writer.add(name, tensor)
        assert len(writer.files.shards.batch) <= 1, "a full shard is written at once"
    assert not target.exists(), "nothing a reader takes for a policy before close"
    writer.close()
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for name, tensor in tensors.items():
        assert torch.equal(load_file(target / index[name])[name], tensor)
    assert (target / EXPORT_MARKER).is_file() and not target.with_name("step_3.tmp").exists()


def test_full_export_is_a_complete_model_directory(tmp_path, base):
    paths = RunPaths(tmp_path / "run")
    export(paths, 5, base)
    files = sorted(p.name for p in paths.policy_dir(5).iterdir())
    assert files == sorted(["config.json", EXPORT_MARKER, "model.safetensors", "tokenizer.json"])
    assert torch.equal(load_file(paths.policy_dir(5) / "model.safetensors")["model.embed_tokens.weight"], torch.full((2, 3), 5.0))


def test_lora_export_is_a_peft_adapter(tmp_path, base):
    paths = RunPaths(tmp_path / "run")
    export(paths, 2, base, kind="lora")
    config = json.loads((paths.policy_dir(2) / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 32.0, ["q_proj"])
    assert resolve_checkpoint(paths, "step_2").kind == "lora"


def test_latest_step_and_base_resolve(tmp_path, base):
    paths = RunPaths(tmp_path / "run")
    for step in (10, 2, 30):
        export(paths, step, base)
    assert resolve_checkpoint(paths, "latest").step == 30
    assert resolve_checkpoint(paths, "step_10").path == paths.policy_dir(10)
    assert resolve_checkpoint(paths, "base").kind == "base" and resolve_checkpoint(RunPaths(tmp_path / "none"), "base").step == 0


def test_incomplete_exports_do_not_count(tmp_path, base):
    paths = RunPaths(tmp_path / "run")
    export(paths, 2, base)
    export(paths, 4, base)
    (paths.policy_dir(4) / EXPORT_MARKER).unlink()  # as if the trainer died mid-write
    paths.policy_dir(6).with_name("step_6.tmp").mkdir()
    assert resolve_checkpoint(paths, "latest").step == 2
    with pytest.raises(UserError, match=r"step_4: no complete policy export or trainer checkpoint of step 4 .* "
                       r"available: base; exports: step_2; checkpoints: none \(latest = step_2\)"):
        resolve_checkpoint(paths, "step_4")


def test_missing_checkpoints_say_what_exists(tmp_path):
    paths = RunPaths(tmp_path / "run")
    with pytest.raises(UserError, match="no policy export or trainer checkpoint yet .* available: base; exports: none"):
        resolve_checkpoint(paths, "latest")
    with pytest.raises(UserError, match="expected base, latest or step_N"):
        resolve_checkpoint(paths, "final")


def test_evaluations_and_exports_happen_before_every_n_and_at_the_end():
    assert [v for v in range(0, 21) if eval_due(make_config(steps=20, eval_every=0), v)] == [0, 20]
    assert [v for v in range(0, 21) if eval_due(make_config(steps=20, eval_every=8), v)] == [0, 8, 16, 20]


def test_only_the_newest_full_exports_are_kept_and_every_adapter(tmp_path, base):
    from rltools.policy_exports import available, prune_full_exports

    paths = RunPaths(tmp_path / "run")
    for step, kind in ((10, "full"), (20, "lora"), (30, "full"), (40, "full")):
        export(paths, step, base, kind)
    assert prune_full_exports(paths, keep=2) == [paths.policy_dir(10)]
    assert list(available(paths)) == [20, 30, 40]
