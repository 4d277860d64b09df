"""The real RL job as a plain-sbatch user runs it: `rltools render`, then `sbatch` the script; in
the shape of configs/aime.yaml, scaled down to what this machine holds."""

import json
import re

from .conftest import cli, demo_run, sbatch, wait_for_job

MAX_GAP = 1e-4
"""float32 on both sides, bitwise-equal dequantised weights: ~2e-6 is measured (numerics only)."""


def test_production_shape_hetjob_trains_across_nodes(slurm, repo, tmp_path):
    """configs/aime.yaml's shape: the MLA + MoE model class on a mixed NVFP4 base (experts NVFP4,
    other linears FP8), two generator engines on two nodes each with vLLM's default engine-core
    process and two tensor-parallel workers, two trainer nodes of two FSDP2 ranks, weight_sync
    adapted, checkpoints and evals."""
    base = tmp_path / "nvfp4"
    quantized = cli("quantize", repo / "rltools/assets/tiny-moe-arith", "-o", base, "--format", "nvfp4-experts-fp8",
                    "--quiet")
    assert quantized.returncode == 0, quantized.stderr
    steps = 4
    paths = demo_run(repo, tmp_path, f"model.path={base}", "model.quantization=nvfp4", f"schedule.steps={steps}",
                     "schedule.checkpoint_every=2", "schedule.eval_every=2", "eval.problems=16", "cluster.time=00:15:00",
                     "cluster.generators.nodes=2", "generator.tensor_parallel_size=2",
                     "cluster.generators.cpus_per_task=2", "cluster.trainers.nodes=2", "cluster.trainers.ntasks_per_node=2",
                     config_name="moe-demo.yaml")
    job_id = sbatch(paths.sbatch_script)
    states = wait_for_job(job_id, timeout_s=600)
    logs = {p.name: p.read_text() for p in paths.attempt_log_dir(0).glob("*.log")}
    assert set(states.values()) == {"COMPLETED"}, (states, {k: v[-1500:] for k, v in logs.items()})
    assert sorted(logs) == [*(f"generator_{i}.log" for i in range(2)), *(f"trainer_{i}.log" for i in range(4))]

    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps)), "every step exactly once"
    # each engine proved after every sync that it serves the trained policy
    gaps = [m["logprob_gap_engines"] for m in metrics]
    assert all(len(g) == 2 and max(g) < MAX_GAP for g in gaps), gaps
    assert sorted(p.name for p in paths.eval_dir.glob("step_*.json")) == ["step_0.json", "step_2.json", "step_4.json"]
    assert sorted(p.name for p in paths.checkpoints.iterdir() if p.name.startswith("step_")) == ["step_2", "step_4"]
    assert sorted(p.name for p in paths.checkpoint_dir(steps).glob("rng_*")) == [f"rng_{r}.pkl" for r in range(4)]
    for i in range(2):  # both engines generated every step and loaded every version
        log = logs[f"generator_{i}.log"]
        assert re.search(r"\(EngineCore[^)]* pid=\d+\)", log), "vLLM's engine-core process"
        assert "vLLM's 2 CPU workers bound to CPUs" in log  # vLLM's own binding needs a NUMA node each
        assert all(f"step {step}: " in log for step in range(steps)), log[-2000:]
        assert all(f"policy version {v} loaded" in log for v in range(1, steps)), log[-2000:]
    # trainer rank 0 hosted the weight-sync store on its own node's address, not a generator's
    address = json.loads(paths.sync_address.read_text())
    assert address["host"].startswith("127.0.1.") and "admitted generator worker(s) [1, 2, 3, 4]" in logs["trainer_0.log"]

    # the run directory of a hand-submitted job works with the same commands
    status = json.loads(cli("status", paths.root, "--json").stdout)
    assert (status["job_id"], status["state"], status["step"]) == (job_id, "COMPLETED", steps)
    assert "admitted generator worker(s)" in cli("logs", paths.root, "--role", "trainer").stdout
