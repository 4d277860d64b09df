"""Every `algorithm.type` and the mini-batch update on the shipped tiny model (one trainer rank):
the objectives train, mini-batches take one optimizer step each, the proximal logprobs anchor every
mini-batch, and DAPO's overlong options reach the loss."""

import dataclasses

import numpy as np
import pytest
import torch

from rltools.config.schema import AlgorithmConfig, ModelConfig
from rltools.rollout import FinishReason, RolloutBatch
from rltools.train.logprobs import completion_logprobs, pack
from rltools.train.model import load_policy
from rltools.train.trainer import Trainer

from .test_trainer import LORA, synthetic_batch


def trainer(tiny_model, **algorithm) -> Trainer:
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_model), dtype="float32"), LORA)
    with torch.no_grad():  # adapters that already matter: ratios move off 1 after an update
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.01)
    return Trainer(model, AlgorithmConfig(learning_rate=1e-2, **algorithm), micro_batch_size=4, max_new_tokens=6,
                   pad_id=0, device=torch.device("cpu"))


def on_policy(trainer_: Trainer, batch: RolloutBatch) -> RolloutBatch:
    """The batch with the trainer's own logprobs as the generator's (an on-policy step)."""
    packed = pack(batch, np.arange(len(batch)), 0, torch.device("cpu"))
    with torch.no_grad():
        ours = completion_logprobs(trainer_.model, packed)[0].numpy()
    logprobs = np.concatenate([ours[i, : len(batch.completion(i))] for i in range(len(batch))]).astype(np.float32)
    return dataclasses.replace(batch, completion_logprobs=logprobs)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_each_objective_raises_the_rewarded_completions_logprobs(tiny_model, kind):
    t = trainer(tiny_model, type=kind, clip_eps_low=0.2, clip_eps_high=0.28)  # gspo's 3e-4 would clip at once
    batch = on_policy(t, synthetic_batch(n=8, seed=3))
    packed = pack(batch, np.arange(len(batch)), 0, torch.device("cpu"))
    rewarded = torch.from_numpy(batch.rewards > 0.5)
    metrics = t.step(batch)
    with torch.no_grad():
        after = completion_logprobs(t.model, packed)[0]
    gain = ((after - packed.old_logprobs) * packed.mask).sum(1) / packed.mask.sum(1)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the first ratio is 1
    assert gain[rewarded].mean() > gain[~rewarded].mean(), (kind, gain)


def test_mini_batches_take_one_step_each_anchored_at_the_proximal_policy(tiny_model):
    """4 mini-batches: 4 optimizer steps. With tis_cap, every mini-batch's ratio is taken against the
    trainer before the first step, so the later mini-batches see ratios off 1 although each sample is
    trained once; the behaviour weight is 1 (the batch is on-policy)."""
    t = trainer(tiny_model, type="grpo", mini_batches=4, tis_cap=2.0)
    batch = on_policy(t, synthetic_batch(n=8, seed=4))
    metrics = t.step(batch)
    state = next(iter(t.optimizer.state.values()))
    assert int(state["step"]) == 4
    assert metrics["tis_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["tis_capped_frac"] == 0.0
    assert abs(metrics["ratio_mean"] - 1.0) > 1e-4  # mini-batches 2-4 ran after updates


def test_dapo_overlong_penalty_and_mask_reach_the_loss(tiny_model):
    batch = synthetic_batch(n=8, seed=5)
    truncated = np.array([FinishReason.LENGTH if i % 2 else FinishReason.STOP for i in range(8)], dtype=np.uint8)
    batch = dataclasses.replace(batch, finish_reasons=truncated)
    masked = trainer(tiny_model, type="dapo", overlong="mask")
    packed = masked._pack(batch, np.arange(8))
    assert packed.mask[1::2].sum() == 0 and packed.mask[0::2].sum() > 0
    metrics = masked.step(on_policy(masked, batch))
    assert metrics["truncated_frac"] == 0.5
    plain, penalised = (trainer(tiny_model, type="dapo", overlong=o, overlong_buffer=3) for o in ("none", "penalty"))
    long_batch = on_policy(plain, batch)
    assert plain.step(long_batch)["loss"] != pytest.approx(penalised.step(long_batch)["loss"], abs=1e-7)


def test_three_steps_of_staleness_survive_a_trainer_crash_and_resume(repo, tmp_path, one_process_vllm):
    """max_staleness 3 (the generator up to three policy versions ahead) with the decoupled-PPO
    correction: a trainer killed at step 9 resumes from its checkpoint; every step is trained once,
    none on rollouts more than 3 versions old, and the staleness histogram reaches 3."""
    import json
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    sets = [w for key in ("schedule.max_staleness=3", "algorithm.tis_cap=2.0", "schedule.steps=16",
                          "schedule.checkpoint_every=4", "eval.problems=16", "schedule.eval_every=0",
                          f"run.dir={run_dir}") for w in ("--set", key)]

    def rltools(*argv, env=None):
        return subprocess.run([sys.executable, "-m", "rltools", *argv], capture_output=True, text=True, timeout=600,
                              cwd=repo, env={**os.environ, **(env or {})})

    crashed = rltools("submit", str(repo / "configs" / "demo.yaml"), *sets, env={"RLTOOLS_FAULT": "trainer.train@9=kill"})
    assert crashed.returncode != 0 and (run_dir / "checkpoints" / "step_8").is_dir(), crashed.stderr[-3000:]
    resumed = rltools("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(16))
    assert max(m["staleness"] for m in lines) == 3 and all(0 <= m["staleness"] <= 3 for m in lines)
    assert all(m["tis_mean"] > 0 for m in lines)
    status = rltools("status", str(run_dir), "--json")
    histogram = json.loads(status.stdout)["staleness"]
    assert sum(histogram.values()) == 16 and histogram["3"] >= 10, histogram
    assert "steps trained on rollouts k versions behind:" in rltools("status", str(run_dir)).stdout


def test_dynamic_sampling_replaces_groups_that_teach_nothing(repo, tmp_path, one_process_vllm):
    """DAPO's dynamic sampling on the demo: a step keeps a group whose rewards are all equal only once
    the generator has drawn its last extra round; the control run (same seed, without it) has such
    groups at steps where dynamic sampling had none."""
    import json
    import os
    import subprocess
    import sys

    def run(name: str, *overrides: str) -> list[dict]:
        run_dir = tmp_path / name
        sets = [w for key in ("schedule.steps=6", "eval.problems=16", "schedule.eval_every=0", f"run.dir={run_dir}",
                              *overrides) for w in ("--set", key)]
        result = subprocess.run([sys.executable, "-m", "rltools", "submit", str(repo / "configs" / "demo.yaml"), *sets],
                                capture_output=True, text=True, timeout=600, cwd=repo, env=dict(os.environ))
        assert result.returncode == 0, result.stderr[-3000:]
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    dynamic = run("dynamic", "algorithm.dynamic_sampling=true", "algorithm.max_extra_draws=2")
    plain = run("plain")
    assert all(m["prompts_drawn"] == 16 for m in plain)
    assert all(m["prompts_drawn"] in (16, 32, 48) and m["samples"] == 128 for m in dynamic)
    assert all(m["zero_std_groups"] == 0 or m["prompts_drawn"] == 48 for m in dynamic), dynamic
    assert any(m["prompts_drawn"] > 16 for m in dynamic)
    assert sum(m["zero_std_groups"] for m in dynamic) < sum(m["zero_std_groups"] for m in plain)
