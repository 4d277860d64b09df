"""Request seeds: no two samples of a step (or of an evaluation) draw the same random numbers."""

from rltools.generate.vllm_engine import request_seed


def test_sample_seeds_of_a_step_are_all_distinct():
    # vLLM seeds sample j of a request `seed + j`: with seeds one apart, prompt i's sample j+1 and
    # prompt i+1's sample j drew identical random numbers (16 x 8 samples used only 23 streams).
    for step, prompts, n in ((0, 16, 8), (7, 64, 16), (-1, 256, 8)):
        seeds = [request_seed(0, step, i, n) + j for i in range(prompts) for j in range(n)]
        assert len(set(seeds)) == prompts * n


def test_request_seeds_differ_across_steps_and_runs():
    first = {request_seed(0, 0, i, 8) + j for i in range(16) for j in range(8)}
    assert first.isdisjoint(request_seed(0, 1, i, 8) + j for i in range(16) for j in range(8))
    assert first.isdisjoint(request_seed(0, -1, i, 8) + j for i in range(256) for j in range(8))
    assert request_seed(0, 0, 0, 8) != request_seed(1, 0, 0, 8)
