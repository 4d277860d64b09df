"""What expert parallelism gives the Megatron backend on a MoE model: the same GRPO batch trained at
EP 1, 2 and 4 (as many trainer ranks, data-parallel for the rest of the model) on the shipped
tiny-moe-arith, printed from the same run:

- bytes of routed-expert weights and of all weights per rank, next to EP 1's (the reference);
- the median seconds of a GRPO step (after one warm-up step), next to EP 1's.

On a host without CUDA megatron-core runs through the test shim (tests/megatron_cpu.py) on gloo;
there, more ranks than cores share them, so the step-time ratio measures contention as much as
parallelism (the bytes are exact anywhere).

    .venv/bin/python scripts/bench_megatron_ep.py [--ep 1 2 4] [--samples 64] [--steps 4] [--json]
"""

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODEL = REPO / "rltools" / "assets" / "tiny-moe-arith"
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rollouts(samples: int, seed: int = 0):
    """`samples` rollouts shaped like the MoE demo's (groups of 8, ~32-token prompts, 6 new tokens)."""
    from rltools.rollout.batch import FinishReason, RolloutBatch, Sample

    rng = np.random.default_rng(seed)
    batch = []
    for group in range(samples // 8):
        prompt = rng.integers(3, 100, rng.integers(24, 33)).tolist()
        for i in range(8):
            completion = rng.integers(3, 100, 6).tolist()
            batch.append(Sample(prompt, completion, (-rng.random(6)).tolist(), float(rng.random() < 0.5), group, i,
                                FinishReason.STOP))
    return RolloutBatch.from_samples(batch, policy_version=0)


def worker(rank: int, world: int, port: int, samples: int, steps: int, out: str) -> None:
    import contextlib

    import torch.distributed as dist
    from megatron.core import parallel_state

    from rltools.config.schema import AlgorithmConfig, LoraConfig, ModelConfig
    from rltools.train.megatron.model import load_megatron_policy
    from rltools.train.megatron.parallel import init_parallel
    from rltools.train.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if torch.cuda.is_available():
        shim = contextlib.nullcontext()
    else:
        from tests.megatron_cpu import megatron_on_cpu

        shim = megatron_on_cpu()
    with shim:
        init_parallel(1, 1, seed=0, expert_parallel=world)
        policy = load_megatron_policy(ModelConfig(path=str(MODEL), dtype="float32"),
                                      LoraConfig(rank=8, alpha=16, target_modules=TARGETS))
        trainer = MegatronTrainer(policy, AlgorithmConfig(learning_rate=1e-3), micro_batch_size=8, max_new_tokens=6,
                                  pad_id=0, device=torch.device("cpu"), rank=parallel_state.get_data_parallel_rank(),
                                  world_size=parallel_state.get_data_parallel_world_size())
        params = list(policy.gpt.named_parameters())
        expert_bytes = sum(p.numel() * p.element_size() for n, p in params if ".mlp.experts." in n)
        all_bytes = sum(p.numel() * p.element_size() for _, p in params)
        seconds = []
        for step in range(steps + 1):  # step 0 warms up
            dist.barrier()
            start = time.perf_counter()
            trainer.step(rollouts(samples, seed=step))
            seconds.append(time.perf_counter() - start)
        slowest = torch.tensor(seconds[1:])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its last rank is done
    if rank == 0:
        Path(out).write_text(json.dumps({"expert_bytes": expert_bytes, "bytes": all_bytes,
                                         "step_s": statistics.median(slowest.tolist())}))
    dist.destroy_process_group()


def measure(ep: int, samples: int, steps: int) -> dict:
    from tests.spawn import spawn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn(worker, args=(ep, port, samples, steps, out), nprocs=ep)
        return {"ep": ep, **json.loads(Path(out).read_text())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--samples", type=int, default=64, help="rollouts per step (a multiple of 8 x every EP)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if any(args.samples % (8 * ep) for ep in args.ep):
        parser.error(f"--samples {args.samples} must be a multiple of 8 x each --ep (micro batches of 8 per rank)")
    rows = []
    for ep in args.ep:
        print(f"EP {ep}: {ep} trainer rank(s) ...", file=sys.stderr, flush=True)
        rows.append(measure(ep, args.samples, args.steps))
    reference = rows[0]
    for row in rows:
        row["expert_bytes_ratio"] = row["expert_bytes"] / reference["expert_bytes"]
        row["step_ratio"] = row["step_s"] / reference["step_s"]
    if args.json:
        print(json.dumps({"cores": os.cpu_count(), "samples": args.samples, "rows": rows}))
        return 0
    print(f"{args.samples} rollouts a step, micro batches of 8, {os.cpu_count()} cores; reference: EP {reference['ep']}")
    print(f"{'EP':>3} {'expert bytes/rank':>18} {'ratio':>6} {'all bytes/rank':>15} {'step s':>7} {'ratio':>6}")
    for row in rows:
        print(f"{row['ep']:>3} {row['expert_bytes']:>18,} {row['expert_bytes_ratio']:>6.3f} {row['bytes']:>15,} "
              f"{row['step_s']:>7.3f} {row['step_ratio']:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
