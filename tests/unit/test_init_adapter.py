"""`submit`'s check of lora.init_from: a PEFT adapter of the run's rank, alpha and target modules."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from rltools.config import load_config
from rltools.errors import UserError
from rltools.launch.preflight import preflight

MODULES = ["q_proj", "v_proj"]


def write_adapter(directory, r=8, alpha=16, modules=MODULES, names=None, **extra):
    directory.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": modules, **extra}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    names = names or [f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight" for m in modules for ab in "AB"]
    save_file({name: np.zeros((r, 4), dtype=np.float32) for name in names}, str(directory / "adapter_model.safetensors"))
    return directory


def config(repo, adapter, *overrides):
    # the demo: lora rank 8, alpha 16, every projection and lm_head adapted
    return load_config(repo / "configs/demo.yaml", [f"lora.init_from={adapter}", *overrides])


def test_an_adapter_of_the_runs_shape_passes(repo, tmp_path):
    assert not [note for note in preflight(config(repo, write_adapter(tmp_path / "a"))) if "lora.init_from" in note]


@pytest.mark.parametrize("setup,message", [
    (lambda d: d, r"lora.init_from \S+/missing is not a directory: point it at a PEFT adapter directory"),
    (lambda d: write_adapter(d, r=4), r"the adapter has r 4 \(\S+adapter_config.json\) where lora.rank is 8: set lora.rank: 4"),
    (lambda d: write_adapter(d, alpha=32), r"the adapter has lora_alpha 32 .* where lora.alpha is 16.0"),
    (lambda d: write_adapter(d, use_dora=True), r"describes no plain LoRA adapter"),
    (lambda d: write_adapter(d, names=["model.layers.0.mlp.w1.lora_A.weight"]),
     r"the adapter adapts w1 \(\S+adapter_model.safetensors\), which lora.target_modules \(q_proj, .*\) leaves out"),
    (lambda d: write_adapter(d, names=["model.layers.0.q_proj.weight"]), r"holds no LoRA weights named as peft saves them"),
])
def test_an_adapter_that_does_not_fit_is_refused_naming_the_key_and_file(repo, tmp_path, setup, message):
    directory = tmp_path / "missing"
    setup(directory)
    with pytest.raises(UserError, match=message):
        preflight(config(repo, directory))


def test_a_policy_export_of_merged_weights_says_how_to_get_adapters(repo, tmp_path):
    export = tmp_path / "weights" / "step_10"
    export.mkdir(parents=True)
    (export / "policy.json").write_text(json.dumps({"step": 10, "kind": "full", "base_model": "/m"}))
    with pytest.raises(UserError, match=r"has no adapter_config.json: not a PEFT adapter directory \(it is a policy "
                                        r"export of a complete model: generator.weight_sync full; a run exports its "
                                        r"adapters with generator.weight_sync: lora\)"):
        preflight(config(repo, export))


def test_under_slurm_an_adapter_this_node_cannot_see_is_left_to_the_job(repo, tmp_path):
    notes = preflight(config(repo, tmp_path / "scratch-only", "cluster.launcher=slurm"))
    assert any(note.startswith(f"lora.init_from {tmp_path / 'scratch-only'} is not visible from this node") for note in notes)
