"""vLLM's routed experts of one sequence, as a rollout stores them (routing replay)."""

import numpy as np
import pytest

from rltools.generate.episodes import _moe_routes


def test_vllm_routes_become_one_row_per_token_run_and_one_column_per_moe_layer():
    routes = np.arange(7 * 3 * 2).reshape(7, 3, 2)  # 4 prompt + 3 completion tokens, 3 layers
    stored = _moe_routes(routes, prompt_len=4, completion_len=3, moe_layers=[1, 2])  # layer 0 is dense
    assert stored.dtype == np.int16 and stored.shape == (6, 2, 2)  # the last sampled token never ran
    assert np.array_equal(stored, routes[:6, 1:])
    assert np.array_equal(_moe_routes(routes[:, 1:], 4, 3, [1, 2]), routes[:6, 1:])  # MoE layers only
    with pytest.raises(RuntimeError, match="for a sequence of 4 prompt and 5 completion tokens"):
        _moe_routes(routes, prompt_len=4, completion_len=5, moe_layers=[1, 2])
