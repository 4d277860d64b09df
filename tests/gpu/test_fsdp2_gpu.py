"""GRPO steps on CUDA give the CPU run's losses: plain, under FSDP2, over two GPUs (skipped without one).

Not run on the CPU machines this project is developed on: whether it passes is unverified until a
GPU runs it. Every run is its own spawned process, so process groups and CUDA state never leak into
the other GPU tests; the CPU run is the reference. Process groups are NCCL-only, as
`train.loop.init_trainer_group` makes them on CUDA.
"""

import math
import socket
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"
STEPS = 3
# float32 on both sides. PyTorch keeps TF32 off for float32 matmuls by default, but CUDA kernels sum
# in another order; 1e-2 relative also holds if TF32 is on (~1e-3 relative per matmul).
REL, ABS = 1e-2, 1e-4


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> dict:
    return run(tmp_path_factory.mktemp("cpu"), "cpu", world=1)


@pytest.mark.parametrize("mode", ["cuda", "fsdp2"])
def test_grpo_steps_on_one_gpu_match_cpu(cpu_run, tmp_path, record_property, mode):
    """cuda: what one trainer rank runs (build_backend shards only with 2+ ranks); fsdp2: the same
    model under fully_shard on a one-rank NCCL group."""
    compare(run(tmp_path, mode, world=1), cpu_run, record_property)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 over NCCL needs 2+ GPUs (one per rank)")
def test_fsdp2_on_two_gpus_matches_cpu(cpu_run, tmp_path, record_property):
    compare(run(tmp_path, "fsdp2", world=2), cpu_run, record_property)


def compare(gpu: dict, cpu: dict, record_property) -> None:
    for step, (ours, reference) in enumerate(zip(gpu["metrics"], cpu["metrics"], strict=True)):
        assert math.isfinite(ours["loss"]) and math.isfinite(ours["grad_norm"]), (step, ours)
        assert ours["loss"] == pytest.approx(reference["loss"], rel=REL, abs=ABS), step
        assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=REL), step
        record_property(f"loss_{step}", ours["loss"])
        record_property(f"loss_{step}_cpu", reference["loss"])
    assert gpu["metrics"][0]["grad_norm"] > 0
    assert gpu["weights"].keys() == cpu["weights"].keys()
    assert all(torch.isfinite(t).all() for t in gpu["weights"].values())


def run(tmp_path: Path, mode: str, world: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"{mode}-{world}.pt"
    mp.spawn(train, args=(world, mode, port, str(out)), nprocs=world)
    return torch.load(out)


def train(rank: int, world: int, mode: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from rltools.config.schema import AlgorithmConfig, ModelConfig
    from rltools.train.model import export_weights, load_policy, shard_model
    from rltools.train.trainer import Trainer
    from tests.integration.test_trainer import LORA, synthetic_batch

    torch.set_num_threads(1)
    device = torch.device("cpu") if mode == "cpu" else torch.device("cuda", rank)
    if mode == "fsdp2":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # the LoRA A init: the same on every rank and in every mode
    model = load_policy(ModelConfig(path=str(TINY), dtype="float32"), LORA).to(device)
    if mode == "fsdp2":
        shard_model(model)
    trainer = Trainer(model, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=2, max_new_tokens=6, pad_id=0,
                      device=device, rank=rank, world_size=world)
    metrics = [trainer.step(synthetic_batch(seed=s)) for s in range(STEPS)]
    weights = {name: t.cpu() for name, t in export_weights(model, LORA.alpha / LORA.rank)}
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, out)
    if mode == "fsdp2":
        dist.destroy_process_group()
