"""One weight-sync peer in its own OS process, driven by tests/integration/test_weight_sync.py.

    python sync_peer.py host|join RUN_DIR --rank R --world W --scenario NAME --out RESULT.json

Writes what it saw (per-version tensor digests, errors with their type, message and elapsed time)
to RESULT.json; the test compares peers' files. Tensors are made from a seed on the sender, and
receivers hash the exact bytes they were handed, so equal digests mean bitwise-equal tensors.
"""

import argparse
import hashlib
import json
import logging
import os
import sys
import time

import torch

from rltools.paths import RunPaths
from rltools.weight_sync import (StaleVersionError, SyncOptions, TensorStream, WeightReceiver, WeightSender, host_group,
                                 join_group)

SMALL = {"bucket_bytes": 64 << 10, "alone_bytes": 16 << 10}  # tiny pieces: several buckets and alone pieces


def model(seed: int, device: str) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes, incl. 0-dim, empty, odd sizes and a non-contiguous tensor."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "embed.weight": torch.randn(300, 64, generator=g),  # 75 KiB float32: alone
        "mlp.up.weight": torch.randn(96, 200, generator=g).to(torch.bfloat16),  # alone
        "head.weight_t": torch.randn(90, 70, generator=g).t(),  # non-contiguous
        "step": torch.tensor(123456789012345, dtype=torch.int64),  # 0-dim
        "scale": torch.tensor(0.3, dtype=torch.bfloat16),  # 0-dim, 2 bytes
        "empty.bias": torch.empty(0),
        "empty.matrix": torch.empty(3, 0, dtype=torch.bfloat16),
        "ids": torch.randint(-2**62, 2**62, (7, 3), generator=g, dtype=torch.int64),
        "mask": torch.rand(17, generator=g) > 0.5,
    }
    for i in range(12):
        t[f"layers.{i}.attn.o.weight"] = torch.randn(64, 64, generator=g).to(torch.bfloat16)
        t[f"layers.{i}.attn.q.bias"] = torch.randn(33, generator=g).to(torch.float16)
        t[f"layers.{i}.norm.weight"] = torch.randn(64, generator=g)
    return {k: v.to(device) for k, v in t.items()}


def lora(seed: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.attn.q.lora_{ab}": torch.randn(*shape, generator=g).to(torch.bfloat16).to(device)
            for i in range(2) for ab, shape in (("A", (8, 64)), ("B", (64, 8)))}


def _produced(tensors: dict[str, torch.Tensor], out: dict):
    """Yield a copy of each tensor, recording in out["most_alive"] how many copies' memory was alive
    at once (each copy's bytes live in a numpy array, which is freed with the last view of it)."""
    import weakref

    import numpy as np

    alive = [0]

    def released():
        alive[0] -= 1

    out["most_alive"] = 0
    for name, tensor in tensors.items():
        data = tensor.detach().cpu().contiguous()
        if data.numel() == 0:  # no memory to track
            yield name, tensor.clone()
            continue
        buffer = np.empty(data.numel() * data.element_size(), dtype=np.uint8)
        copy = torch.from_numpy(buffer).view(data.dtype).reshape(data.shape)
        copy.copy_(data)
        alive[0] += 1
        weakref.finalize(buffer, released)
        del buffer, data
        out["most_alive"] = max(out["most_alive"], alive[0])
        yield name, copy.to(tensor.device)
        del copy


def digests(pairs) -> dict[str, list]:
    return {name: [str(t.dtype), list(t.shape), hashlib.sha256(t.detach().cpu().contiguous().reshape(-1)
                                                                 .view(torch.uint8).numpy().tobytes()).hexdigest()]
            for name, t in pairs}


def error(e: BaseException, started: float) -> dict:
    return {"type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - started}


def host(group, scenario: str, device: str, out: dict) -> None:
    sender = WeightSender(group, **SMALL)
    if scenario == "roundtrip":
        for version, kind, tensors in ((1, "full", model(1, device)), (2, "lora", lora(2, device)), (3, "full", model(3, device))):
            sent = sender.broadcast(tensors, version, kind)
            out["sent"].append({"version": version, "kind": kind, "pieces": sent.pieces, "tensors": digests(tensors.items())})
        tensors = model(4, device)  # version 4 streams: produced on demand, never all held by the sender
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
        sent = sender.broadcast(TensorStream(specs, _produced(tensors, out)), 4, "full")
        out["sent"].append({"version": 4, "kind": "full", "pieces": sent.pieces, "tensors": digests(tensors.items())})
    elif scenario == "stale":
        sender.broadcast(model(1, device), 5)
        started = time.monotonic()
        try:
            sender.broadcast(model(1, device), 4)  # refused locally, nothing on the wire
        except ValueError as e:
            out["local"] = error(e, started)
        restarted = WeightSender(group, **SMALL)  # e.g. trainer rank 0 restarted from an older checkpoint
        started = time.monotonic()
        try:
            restarted.broadcast(model(2, device), 3)
        except Exception as e:
            out["remote"] = error(e, started)
        restarted.broadcast(model(3, device), 6)  # the group survived the refusal
        out["sent"].append({"version": 6})
    elif scenario == "consumer-fails":
        started = time.monotonic()
        try:
            sender.broadcast(model(1, device), 1)
        except Exception as e:
            out["error"] = error(e, started)
        sender.broadcast(model(2, device), 2)  # the group survived; version 1 was not recorded as sent
        out["sent"].append({"version": 2})
    else:  # one message: die, die-after-header, stall, intruder
        big = {f"w{i}": torch.randn(256, 1024) for i in range(24)} if scenario != "intruder" else model(1, device)
        started = time.monotonic()
        try:
            sender.broadcast(big, 1)
            out["sent"].append({"version": 1})
        except Exception as e:
            out["error"] = error(e, started)


def join(group, scenario: str, rank: int, out: dict) -> None:
    receiver = WeightReceiver(group)
    if scenario == "die-after-header" and rank == 2:
        receiver._pieces = lambda *args: os._exit(17)  # header and metadata in, no piece yet
    expected = {"roundtrip": 4, "stale": 3, "consumer-fails": 2}.get(scenario, 1)
    for _ in range(expected):
        seen: list = []

        def consumer(pairs):
            if scenario == "die" and rank == 2:
                os._exit(17)  # mid-transfer: the first piece is in, the next ones are on the wire
            if scenario == "stall" and rank == 2:
                time.sleep(30)
            if scenario == "consumer-fails" and rank == 2 and not out.get("raised"):
                out["raised"] = True
                raise ValueError("engine rejected the shapes")
            seen.extend(digests(pairs).items())
            out.setdefault("calls", []).append(len(pairs))

        started = time.monotonic()
        try:
            got = receiver.receive(consumer, timeout_s=20)
        except Exception as e:
            out["errors"].append(error(e, started))
            if not isinstance(e, StaleVersionError) and scenario != "consumer-fails":
                return
            continue
        out["received"].append({"version": got.version, "kind": got.kind, "pieces": got.pieces, "tensors": dict(seen)})
    out["buffer_bytes"] = receiver.buffer_bytes


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("host", "join"))
    p.add_argument("run_dir")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--scenario", default="roundtrip")
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    device = "cpu"
    if a.backend == "nccl":
        device = f"cuda:{a.rank}"
        torch.cuda.set_device(a.rank)
    options = SyncOptions(backend=a.backend, join_timeout_s=15, collective_timeout_s=a.timeout)
    paths = RunPaths(a.run_dir)
    out: dict = {"sent": [], "received": [], "errors": []}
    started = time.monotonic()
    try:
        if a.role == "host":
            group = host_group(paths, world_size=a.world, address="127.0.0.1", attempt=a.attempt, options=options)
            host(group, a.scenario, device, out)
        else:
            group = join_group(paths, rank=a.rank, world_size=a.world, attempt=a.attempt, options=options)
            join(group, a.scenario, a.rank, out)
    except Exception as e:
        out["setup_error"] = error(e, started)
    with open(a.out, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: a broken group's background threads must not hang the exit


if __name__ == "__main__":
    sys.exit(main())
