"""Weight-sync benchmark: the channel against one plain broadcast of the same bytes.

Invariant: both sides of the comparison move the same byte count between the same processes in the
same run, each measured to the same end point (every receiver holds the bytes: our acknowledgement,
the reference's trailing all-reduce), after the same warm-up, with preallocated buffers on both
sides, alternating which goes first; the figure is the median of the repetitions.

The payload is shaped like a small LLM (SmolLM2-135M's layer shapes, layer count scaled to
`total_mb`): two big embedding matrices, many attention and MLP matrices in bfloat16, many small
float32 norms and bfloat16 biases, an int64 buffer.

On gloo every process works on CPU tensors over loopback; on nccl process r uses GPU r (NCCL
wants one GPU per process), so `receivers` + 1 GPUs are needed.

    python -m rltools.bench.weights [total_mb] [receivers] [gloo|nccl]     # prints JSON
"""

import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta

import torch

from ..errors import UserError
from ..paths import RunPaths
from ..weight_sync.channel import WeightSender
from ..weight_sync.receiver import WeightReceiver
from ..weight_sync.rendezvous import SyncGroup, SyncOptions, host_group, join_group

HIDDEN, INTERMEDIATE, KV = 576, 1536, 192
OPTIONS = SyncOptions(join_timeout_s=120, collective_timeout_s=120)
WARMUP, REPETITIONS = 2, 7


def model_like(total_mb: int) -> dict[str, torch.Tensor]:
    """Named tensors of about `total_mb` MiB, filled (untouched pages would make reads free)."""
    total = total_mb << 20
    vocab = max(1024, round(total * 0.21 / (HIDDEN * 2)))
    per_layer = 2 * (2 * HIDDEN * HIDDEN + 2 * KV * HIDDEN + 3 * HIDDEN * INTERMEDIATE + HIDDEN + 2 * KV) + 8 * HIDDEN
    layers = max(1, round((total - 4 * vocab * HIDDEN) / per_layer))
    bf16, f32 = torch.bfloat16, torch.float32
    shapes = {"model.embed_tokens.weight": ((vocab, HIDDEN), bf16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": ((HIDDEN,), f32),
            p + "self_attn.q_proj.weight": ((HIDDEN, HIDDEN), bf16), p + "self_attn.q_proj.bias": ((HIDDEN,), bf16),
            p + "self_attn.k_proj.weight": ((KV, HIDDEN), bf16), p + "self_attn.k_proj.bias": ((KV,), bf16),
            p + "self_attn.v_proj.weight": ((KV, HIDDEN), bf16), p + "self_attn.v_proj.bias": ((KV,), bf16),
            p + "self_attn.o_proj.weight": ((HIDDEN, HIDDEN), bf16),
            p + "post_attention_layernorm.weight": ((HIDDEN,), f32),
            p + "mlp.gate_proj.weight": ((INTERMEDIATE, HIDDEN), bf16),
            p + "mlp.up_proj.weight": ((INTERMEDIATE, HIDDEN), bf16),
            p + "mlp.down_proj.weight": ((HIDDEN, INTERMEDIATE), bf16),
        }
    shapes |= {"model.norm.weight": ((HIDDEN,), f32), "model.rotary_emb.position_ids": ((4096,), torch.int64),
               "lm_head.weight": ((vocab, HIDDEN), bf16)}
    tensors = {}
    for name, (shape, dtype) in shapes.items():
        t = torch.empty(shape, dtype=dtype)
        tensors[name] = t.fill_(1) if dtype == torch.int64 else t.uniform_(-0.02, 0.02)
    return tensors


def run_weights_bench(total_mb: int = 256, receivers: int = 2, backend: str = "gloo") -> dict:
    """Spawn `receivers` generator-like processes, send from this one over `backend`, time both."""
    gpus = torch.cuda.device_count()
    if backend == "nccl" and gpus < receivers + 1:
        fix = f"pass --receivers {gpus - 1}" if gpus > 1 else "use --backend gloo"
        raise UserError(f"bench weights --backend nccl with {receivers} receiver(s) needs {receivers + 1} GPUs (NCCL "
                        f"wants one per process); this machine has {gpus}: {fix}")
    options = replace(OPTIONS, backend=backend)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 1 + receivers processes share the cores: intra-op threads only contend
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="rltools-bench-") as root:
        paths = RunPaths(root)
        paths.create()
        workers = [context.Process(target=_receiver, args=(root, r, receivers + 1, options, results), daemon=True)
                   for r in range(1, receivers + 1)]
        for w in workers:
            w.start()
        try:
            if backend == "nccl":
                torch.cuda.set_device(0)
            group = host_group(paths, world_size=receivers + 1, address="127.0.0.1", options=options)
            report = _send(group, {name: t.to(group.device) for name, t in model_like(total_mb).items()})
            counts = [results.get(timeout=OPTIONS.collective_timeout_s) for _ in workers]
        finally:
            for w in workers:
                w.join(timeout=30)
                if w.is_alive():
                    w.kill()
            torch.set_num_threads(threads)
    expected = (report["n_tensors"], report["nbytes"])
    if any(tuple(c) != expected for c in counts):
        raise RuntimeError(f"weight-sync bench: receivers saw (tensors, bytes) {counts}, the sender sent {expected}")
    return {"backend": backend, "receivers": receivers, **report}


def _send(group: SyncGroup, tensors: dict[str, torch.Tensor]) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    reference = torch.empty(nbytes, dtype=torch.uint8, device=group.device).fill_(7)
    sender = WeightSender(group)
    ours, plain, pieces = [], [], 0
    for rep in range(WARMUP + REPETITIONS):
        for which in _order(rep):
            _barrier(group)
            started = time.perf_counter()
            if which == "ours":
                pieces = sender.broadcast(tensors, version=rep + 1).pieces
            else:
                _reference(group, reference)
            (ours if which == "ours" else plain).append(time.perf_counter() - started)
    ours_s, plain_s = statistics.median(ours[WARMUP:]), statistics.median(plain[WARMUP:])
    return {
        "ours_gb_s": round(nbytes / ours_s / 1e9, 3),
        "reference_gb_s": round(nbytes / plain_s / 1e9, 3),
        "ratio": round(plain_s / ours_s, 3),
        "total_mb": round(nbytes / (1 << 20), 1),
        "n_tensors": len(tensors),
        "nbytes": nbytes,
        "pieces": pieces,
        "repetitions": REPETITIONS,
        "ours_s": [round(t, 4) for t in ours[WARMUP:]],
        "reference_s": [round(t, 4) for t in plain[WARMUP:]],
    }


def _receiver(root: str, rank: int, world_size: int, options: SyncOptions, results) -> None:
    torch.set_num_threads(1)
    if options.backend == "nccl":
        torch.cuda.set_device(rank)
    group = join_group(RunPaths(root), rank=rank, world_size=world_size, options=options)
    receiver = WeightReceiver(group)
    reference = None
    seen = [0, 0]

    def consumer(pairs):  # what a generator does minus its copy into the engine: count, keep nothing
        seen[0] += len(pairs)
        seen[1] += sum(t.numel() * t.element_size() for _, t in pairs)

    for rep in range(WARMUP + REPETITIONS):
        for which in _order(rep):
            _barrier(group)
            if which == "ours":
                seen[:] = [0, 0]
                got = receiver.receive(consumer)
                if reference is None:
                    reference = torch.zeros(got.nbytes, dtype=torch.uint8, device=group.device)
            else:
                _reference(group, reference)
    results.put(seen)


def _order(rep: int) -> tuple[str, str]:
    # Rep 0 starts with ours so receivers learn the byte count for their reference buffer.
    return ("ours", "reference") if rep % 2 == 0 else ("reference", "ours")


def _reference(group: SyncGroup, buffer: torch.Tensor) -> None:
    """One plain broadcast of a preallocated buffer, then the same kind of completion as our ack."""
    group.pg.broadcast(buffer, 0, timeout=group.timeout).wait(group.timeout)
    _barrier(group)


def _barrier(group: SyncGroup) -> None:
    flag = torch.zeros(1, device=group.device)
    group.pg.allreduce([flag]).wait(timedelta(seconds=OPTIONS.collective_timeout_s))
    flag.item()  # on CUDA, wait() only orders streams: this waits for the collective, so timings end here


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]] + sys.argv[3:4]
    print(json.dumps(run_weights_bench(*args), indent=2))
