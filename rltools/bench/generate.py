"""`rltools bench generate`: vLLM generation tokens/s against HF `generate`, same model and prompts.

Both sample `group` completions of each prompt at the demo's temperature and max new tokens, in one
batch, one torch thread; generated tokens are counted up to and including EOS. Median of repeats,
after one warm-up call each.
"""

import os
import statistics
import time

from ..config import load_config
from ..data import arithmetic
from .step import DEMO


def run_generate_bench(prompts: int = 64, group: int = 8, repeats: int = 5) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    import torch

    torch.set_num_threads(1)
    config = load_config(DEMO)
    texts = [arithmetic.model_text(p) for p in arithmetic.problems(config.run.seed, "eval", prompts)]
    ours = _median_rate(_vllm_sampler(config, texts, group), repeats)
    reference = _median_rate(_hf_sampler(config, texts, group), repeats)
    return {
        "ours_tokens_s": round(ours, 1),
        "reference_tokens_s": round(reference, 1),
        "ratio": round(ours / reference, 3),
        "prompts": prompts,
        "group": group,
        "max_new_tokens": config.generator.max_new_tokens,
    }


def _vllm_sampler(config, texts, group):
    from ..generate.vllm_engine import VLLMEngine
    from ..weight_formats import weight_format

    engine = VLLMEngine(config.model, config.generator, config.run.seed, weight_format(config))

    def sample() -> int:
        groups = engine.sample(texts, n=group, seeds=list(range(len(texts))))
        return sum(len(e.token_ids) for g in groups for e in g)

    return sample


def _hf_sampler(config, texts, group):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path, local_files_only=True, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32, local_files_only=True).eval()
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    g = config.generator

    def sample() -> int:
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=True, temperature=g.temperature, top_p=g.top_p,
                                 max_new_tokens=g.max_new_tokens, num_return_sequences=group,
                                 pad_token_id=tokenizer.pad_token_id)
        new = out[:, inputs["input_ids"].shape[1]:]
        finished = new == tokenizer.eos_token_id
        # tokens up to and including the first EOS, as vLLM counts them
        lengths = torch.where(finished.any(1), finished.int().argmax(1) + 1, new.shape[1])
        return int(lengths.sum())

    return sample


def _median_rate(sample, repeats: int) -> float:
    sample()  # warm-up: allocator, kernels, caches
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = sample()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)
