"""GRPO steps on CUDA give the CPU run's losses: plain, under FSDP2, over two GPUs (skipped without
one), on the dense demo model, on the MLA + MoE one and on the MoE one's mixed NVFP4 checkpoint
(routed experts packed NVFP4, the other linears FP8, as `rltools quantize --format
nvfp4-experts-fp8` writes it); the logprob probe (`runtime.probe`) scores alike on both devices;
each step's peak GPU memory is recorded.

Not run on the CPU machines this project is developed on: whether it passes is unverified until a
GPU runs it. Every run is its own spawned process, so process groups and CUDA state never leak into
the other GPU tests; the CPU run is the reference. Each rank takes its device as a trainer does
(`train.loop.trainer_device`), and process groups are NCCL-only, as `train.loop.init_trainer_group`
makes them on CUDA.
"""

import math
import socket
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ASSETS = Path(__file__).resolve().parents[2] / "rltools" / "assets"
MODELS = {"dense": "tiny-arith", "moe": "tiny-moe-arith", "moe-nvfp4": "tiny-moe-arith"}
STEPS = 3
# float32 on both sides. PyTorch keeps TF32 off for float32 matmuls by default, but CUDA kernels sum
# in another order; 1e-2 relative also holds if TF32 is on (~1e-3 relative per matmul).
REL, ABS = 1e-2, 1e-4
PROBE_GAP = 1e-3
"""Mean absolute logprob difference of the probe, CUDA vs CPU in float32 (generator.max_logprob_gap
is 0.1: a GPU run must stay far below it on numerics alone)."""


@pytest.fixture(scope="module", params=sorted(MODELS))
def cpu_run(request, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("base")
    if request.param.endswith("-nvfp4"):
        from rltools.quant.nvfp4_checkpoint import quantize_checkpoint

        quantize_checkpoint(ASSETS / MODELS[request.param], base / "nvfp4", progress=False, fp8_outside_experts=True)
    return run(tmp_path_factory.mktemp("cpu"), "cpu", world=1, model=request.param, base=base)


@pytest.mark.parametrize("mode", ["cuda", "fsdp2"])
def test_grpo_steps_on_one_gpu_match_cpu(cpu_run, tmp_path, record_property, mode):
    """cuda: what one trainer rank runs (build_backend shards only with 2+ ranks); fsdp2: the same
    model under fully_shard on a one-rank NCCL group."""
    compare(run(tmp_path, mode, world=1, model=cpu_run["model"], base=cpu_run["base"]), cpu_run, record_property)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP2 over NCCL needs 2+ GPUs (one per rank)")
def test_fsdp2_on_two_gpus_matches_cpu(cpu_run, tmp_path, record_property):
    compare(run(tmp_path, "fsdp2", world=2, model=cpu_run["model"], base=cpu_run["base"]), cpu_run, record_property)


def compare(gpu: dict, cpu: dict, record_property) -> None:
    from rltools.runtime.probe import probe_gap

    mean, worst = probe_gap(cpu["probe"], gpu["probe"])
    record_property("probe_gap_mean", mean)
    record_property("probe_gap_max", worst)
    for step, peak in enumerate(gpu["peak_mib"]):
        record_property(f"peak_gpu_mib_{step}", round(peak, 1))
    assert mean < PROBE_GAP, (mean, worst)
    for step, (ours, reference) in enumerate(zip(gpu["metrics"], cpu["metrics"], strict=True)):
        assert math.isfinite(ours["loss"]) and math.isfinite(ours["grad_norm"]), (step, ours)
        assert ours["loss"] == pytest.approx(reference["loss"], rel=REL, abs=ABS), step
        assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=REL), step
        record_property(f"loss_{step}", ours["loss"])
        record_property(f"loss_{step}_cpu", reference["loss"])
    assert gpu["metrics"][0]["grad_norm"] > 0
    assert gpu["weights"].keys() == cpu["weights"].keys()
    assert all(torch.isfinite(t).all() for t in gpu["weights"].values())


def run(tmp_path: Path, mode: str, world: int, model: str, base: Path) -> dict:
    """`base`: where the fixture wrote the quantised checkpoint of an -nvfp4 model."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"{model}-{mode}-{world}.pt"
    mp.spawn(train, args=(world, mode, port, str(out), model, str(base)), nprocs=world)
    return torch.load(out) | {"model": model, "base": base}


def train(rank: int, world: int, mode: str, port: int, out: str, model_name: str = "dense", base: str = "") -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rltools.config.schema import AlgorithmConfig, ModelConfig
    from rltools.runtime.probe import probe_tokens
    from rltools.train.loop import trainer_device
    from rltools.train.model import export_weights, load_policy
    from rltools.train.trainer import Trainer
    from tests.integration import test_moe, test_trainer

    torch.set_num_threads(1)
    nvfp4 = model_name.endswith("-nvfp4")
    path = Path(base) / "nvfp4" if nvfp4 else ASSETS / MODELS[model_name]
    lora = test_moe.LORA if model_name.startswith("moe") else test_trainer.LORA
    device = torch.device("cpu") if mode == "cpu" else trainer_device(rank)  # every rank sees every GPU here
    if mode != "cpu":
        assert device == torch.device("cuda", rank) and torch.cuda.current_device() == rank
    if mode == "fsdp2":
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=device)
    torch.manual_seed(0)  # the LoRA A init: the same on every rank and in every mode
    config = ModelConfig(path=str(path), dtype="float32", quantization="nvfp4" if nvfp4 else "none")
    # As the backend builds it: on the meta device, sharded there, each rank given memory for its rows only.
    model = load_policy(config, lora, device=device, shard=mode == "fsdp2")
    if nvfp4:  # the frozen experts stay packed on the device: dequantised one expert at a time
        from rltools.quant.linear import NVFP4Experts

        experts = [m for m in model.modules() if isinstance(m, NVFP4Experts)]
        assert experts and all(b.device.type == device.type for m in experts for b in m.buffers())
    trainer = Trainer(model, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=2, max_new_tokens=6, pad_id=0,
                      device=device, rank=rank, world_size=world)
    metrics, peaks = [], []
    for seed in range(STEPS):
        if mode != "cpu":
            torch.cuda.reset_peak_memory_stats(device)
        metrics.append(trainer.step(test_trainer.synthetic_batch(seed=seed)))
        peaks.append(torch.cuda.max_memory_allocated(device) / 2**20 if mode != "cpu" else 0.0)
    probe = trainer.probe_logprobs(probe_tokens(AutoTokenizer.from_pretrained(path, local_files_only=True)))
    weights = {name: t.cpu() for name, t in export_weights(model, lora.alpha / lora.rank)}
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights, "probe": probe, "peak_mib": peaks}, out)
    if mode == "fsdp2":
        dist.destroy_process_group()
