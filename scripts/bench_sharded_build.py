"""Host memory of the FSDP2 policy on N trainer ranks, on models big enough to see (>= 1.5 GB in the
training dtype), printed from the same run next to the model's bytes:

- build: each rank's peak host memory growth while it builds the policy (`load_policy(shard=True)`:
  meta device, FSDP2, each rank reading its rows), and what it settles at; next to the reference,
  the whole-model load every rank did before (`load_policy()` then `shard_model`), in the same run;
- export: each rank's peak growth while it iterates a `full` sync's export (the stream, as the
  weight sender takes it), next to the largest layer's exported bytes.

Two models, made here with random weights: a dense Llama stored in bfloat16 and trained in float32 (a
checkpoint already in the training dtype is memory-mapped, and a CPU rank would touch only its
pages whatever the code did), and a DeepSeek-V3-class MoE quantised by `rltools quantize` (NVFP4
routed experts and linears, packed in memory). Peak growth is VmHWM (reset through
/proc/self/clear_refs) minus the RSS before the build: file pages of the checkpoint that a rank
touches count too.

    .venv/bin/python scripts/bench_sharded_build.py [--ranks 4] [--model dense moe] [--glibc-default] [--json]
"""

import argparse
import json
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GB = 1e9
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj"]


def dense_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False)


def moe_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=5,
                            first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=4, n_shared_experts=1,
                            num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=512,
                            qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, vocab_size=32000, n_group=1,
                            topk_group=1, topk_method="noaux_tc", tie_word_embeddings=False)


def write_checkpoint(config, directory: Path) -> None:
    """Random bfloat16 weights under the checkpoint names transformers saves, one tensor at a time."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from rltools.safetensors_shards import ShardWriter

    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    shapes = revert_weight_conversion(model, {n: t for n, t in model.state_dict().items()})
    writer = ShardWriter(directory, 2**30)
    generator = torch.Generator().manual_seed(0)
    for name, meta in shapes.items():
        writer.add(name, (torch.randn(meta.shape, generator=generator) * 0.02).to(torch.bfloat16))
    writer.close()


def _peak_bytes() -> int:
    return _status("VmHWM")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status("VmRSS")


def rank_main(rank: int, world: int, port: int, path: str, quantization: str, mode: str, out: str) -> None:
    import torch.distributed as dist

    from rltools.config.schema import LoraConfig, ModelConfig
    from rltools.train.model import export_weights, load_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import peft  # noqa: F401  (imports are not the build: loaded before the baseline)
    from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM  # noqa: F401

    model_cfg = ModelConfig(path=path, dtype="float32", quantization=quantization)
    lora = LoraConfig(rank=16, alpha=32, target_modules=TARGETS)
    base = _reset_peak()
    torch.manual_seed(0)
    if mode == "sharded":
        model = load_policy(model_cfg, lora, shard=True)
    else:  # the build before: the whole model loaded on every rank (transformers' loader), then sharded
        model = whole_then_sharded(model_cfg, lora)
    build_peak, settled = _peak_bytes() - base, _status("VmRSS") - base
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())  # DTensor: whole shape
    result = {"build_peak": build_peak, "settled": settled, "model_bytes": model_bytes}
    if mode == "sharded":
        base = _reset_peak()
        layer_bytes: dict[str, int] = {}
        stream = export_weights(model, lora.alpha / lora.rank)
        for name, tensor in stream:
            key = (re.match(r".*?\.layers\.\d+\.", name) or re.match(".*", name)).group(0)  # a decoder layer
            layer_bytes[key] = layer_bytes.get(key, 0) + tensor.numel() * tensor.element_size()
            del tensor  # as the weight sender, once its piece is on the wire
        result.update(export_peak=_peak_bytes() - base, largest_layer=max(layer_bytes.values()),
                      exported=sum(layer_bytes.values()))
    dist.barrier()
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def whole_then_sharded(model_cfg, lora):
    """The FSDP2 build before the sharded one: transformers loads the whole model on each rank (an
    NVFP4 base: the meta build, unsharded), peft wraps it, and only then FSDP2 shards it."""
    from transformers import AutoModelForCausalLM

    from rltools.train.model import DTYPES, _with_lora, load_policy, shard_model

    if model_cfg.quantization == "nvfp4":
        model = load_policy(model_cfg, lora)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=DTYPES[model_cfg.dtype], local_files_only=True)
        model = _with_lora(model, lora, nvfp4=False)
    shard_model(model)
    return model


def run(world: int, path: Path, quantization: str, mode: str, work: Path) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / f"{path.name}-{mode}"
    mp.start_processes(rank_main, args=(world, port, str(path), quantization, mode, str(out)), nprocs=world,
                       start_method="spawn")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--model", nargs="+", choices=["dense", "moe"], default=["dense", "moe"])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # glibc raises its mmap threshold to the size of each mmapped block freed (up to 32 MiB), after
    # which blocks of 1-32 MiB come from the heap and stay in the process when freed: that measures
    # the allocator, not what the code holds. A fixed threshold (the ranks inherit it) turns that off;
    # --glibc-default measures as a plain process runs.
    if not args.glibc_default:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    report = {}
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as tmp:
        work = Path(tmp)
        for kind in args.model:
            path = work / kind
            print(f"bench: writing the {kind} checkpoint", file=sys.stderr)
            write_checkpoint(dense_config() if kind == "dense" else moe_config(), path)
            quantization = "none"
            if kind == "moe":
                from rltools.quant.nvfp4_checkpoint import quantize_checkpoint

                quantize_checkpoint(path, work / "moe-nvfp4", progress=False)
                path, quantization = work / "moe-nvfp4", "nvfp4"
            report[kind] = {mode: run(args.ranks, path, quantization, mode, work) for mode in ("whole", "sharded")}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for kind, modes in report.items():
        model = modes["sharded"][0]["model_bytes"]
        malloc = "glibc's default mmap threshold" if args.glibc_default else "mmap threshold 1 MiB"
        print(f"{kind}: model {model / GB:.2f} GB in memory (training dtype float32; NVFP4 layers packed), "
              f"{args.ranks} ranks, {malloc}")
        for mode, ranks in modes.items():
            peaks = " ".join(f"{r['build_peak'] / GB:.2f}" for r in ranks)
            worst = max(r["build_peak"] for r in ranks)
            print(f"  build {mode:8s} peak per rank GB [{peaks}]  worst {worst / model:.3f}x the model, "
                  f"settles at {max(r['settled'] for r in ranks) / model:.3f}x")
        ranks = modes["sharded"]
        worst = max(ranks, key=lambda r: r["export_peak"])
        peaks = " ".join(f"{r['export_peak'] / GB:.2f}" for r in ranks)
        print(f"  export full sync peak growth per rank GB [{peaks}]"
              f"  worst {worst['export_peak'] / worst['largest_layer']:.2f}x the largest layer "
              f"({worst['largest_layer'] / GB:.3f} GB; all exported {worst['exported'] / GB:.2f} GB)")


if __name__ == "__main__":
    main()
