"""How the Megatron backend's attention memory grows with the sequence: the peak memory of one
forward + backward pass at sequence S and 4S, with the core attention the backend builds
(`rltools/train/megatron/attention.py`: torch's scaled_dot_product_attention, no mask tensor) and,
as the reference measured in the same run, megatron-core's local `DotProductAttention` with the
[B, 1, S, S] mask the backend passed it before (it keeps [B x heads, S, S] float32 scores and their
softmax per layer). Printed: each peak and the 4S/S ratio of each, for a Llama-shaped model
(32 query heads, 8 KV heads) and a DeepSeek-V3-shaped one (MLA: 32 heads, key width 96 =
nope 64 + rope 32, value width 64).

Peak memory is the CPU allocator's live tensor bytes (torch's profiler, `total_allocated` of its
allocation events; tests/integration/test_megatron.py `peak_allocated`), counted from just before
the forward: the weights are not in it. It runs on the CPU, megatron-core through the test shim
(tests/megatron_cpu.py). The weights are random and frozen and the embedding's output asks for a
gradient (as under LoRA), so backward runs through every layer. Default: ~1 minute and ~4 GB on
2 cores (the reference's scores at 4S are most of it).

    .venv/bin/python scripts/bench_megatron_attention.py [--seq 512] [--models llama mla] [--json]
"""

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def models() -> dict:
    """name -> HF config of a 2-layer model with enough heads to show s x s scores."""
    from transformers import DeepseekV3Config, LlamaConfig

    llama = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=32, max_position_embeddings=8192,
                        rms_norm_eps=1e-6)
    mla = DeepseekV3Config(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                           num_attention_heads=32, num_key_value_heads=32, q_lora_rank=256, kv_lora_rank=256,
                           qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, first_k_dense_replace=2,
                           n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=256, num_experts_per_tok=2,
                           n_group=1, topk_group=1, max_position_embeddings=8192, rms_norm_eps=1e-6)
    return {"llama": llama, "mla": mla}


def local_attention() -> type:
    """megatron-core's local attention as the backend built it before (taking MLA's key and value
    widths, which the 0.16.1 module does not accept as keywords)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return LocalAttention


def measure(hf, seq: int, reference: bool) -> dict:
    """Peak bytes and seconds of one forward + backward of a freshly built model at `seq` tokens."""
    from rltools.train.megatron import attention
    from rltools.train.megatron.build import build_gpt
    from rltools.train.megatron.parallel import init_parallel
    from tests.integration.test_megatron import peak_allocated

    init_parallel(1, 1, seed=0)  # also a fresh global memory buffer, which the local attention fills
    patch = mock.patch.object(attention, "core_attention", lambda dtype: local_attention()) if reference \
        else contextlib.nullcontext()
    with patch:
        gpt = build_gpt(hf, torch.float32, 1, 1, pre_process=True, post_process=True)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in gpt.parameters():
            p.normal_(std=0.02) if p.dim() > 1 else p.fill_(1.0)
    gpt.requires_grad_(False)
    gpt.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    ids = torch.randint(hf.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq)[None]
    # the mask the backend passed before (True = not attended); now none
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None] if reference else None

    def step():
        logits = gpt(input_ids=ids, position_ids=positions, attention_mask=mask)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()

    start = time.perf_counter()
    peak = peak_allocated(step)
    return {"peak_bytes": peak, "seconds": time.perf_counter() - start}


def run(names: list[str], seq: int) -> list[dict]:
    from tests.megatron_cpu import megatron_on_cpu

    rows = []
    with megatron_on_cpu():  # a CPU measurement (the CPU allocator's bytes), on any machine
        for name in names:
            hf = models()[name]
            for reference in (True, False):
                print(f"{name}, {'megatron local' if reference else 'sdpa'} attention ...", file=sys.stderr, flush=True)
                short, long = measure(hf, seq, reference), measure(hf, 4 * seq, reference)
                rows.append({"model": name, "attention": "megatron local (reference)" if reference else "sdpa (built)",
                             "heads": hf.num_attention_heads, "seq": seq, "peak_bytes": short["peak_bytes"],
                             "peak_bytes_4x": long["peak_bytes"], "ratio": long["peak_bytes"] / short["peak_bytes"],
                             "seconds_4x": long["seconds"]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=512, help="S: the pass runs at S and at 4S tokens (one sample)")
    parser.add_argument("--models", nargs="+", choices=["llama", "mla"], default=["llama", "mla"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = run(args.models, args.seq)
    if args.json:
        print(json.dumps({"cores": os.cpu_count(), "rows": rows}))
        return 0
    mb = 1 / 2**20
    print(f"fwd+bwd peak memory above the weights, one sample, float32, {os.cpu_count()} cores (1 thread)")
    print(f"{'model':<6} {'attention':<27} {'S':>5} {'peak at S':>10} {'peak at 4S':>11} {'4S/S':>6} {'4S s':>6}")
    for r in rows:
        print(f"{r['model']:<6} {r['attention']:<27} {r['seq']:>5} {r['peak_bytes'] * mb:>7.1f} MB "
              f"{r['peak_bytes_4x'] * mb:>8.1f} MB {r['ratio']:>6.2f} {r['seconds_4x']:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
