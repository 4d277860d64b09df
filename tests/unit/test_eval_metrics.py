import math

import numpy as np
import pytest

from rltools.eval.metrics import avg_at_k, pass_at_k, summarize


def test_avg_at_k_and_stderr_by_hand():
    correct = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    avg, stderr = avg_at_k(correct)
    per = np.array([0.5, 0.25, 0.0])
    assert avg == pytest.approx(0.25)
    assert stderr == pytest.approx(per.std(ddof=1) / math.sqrt(3))


def test_pass_at_k_unbiased_estimator():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    # problem 0: n=4, c=1: pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(correct, 2) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert pass_at_k(correct, 1) == pytest.approx(avg_at_k(correct)[0])
    assert pass_at_k(correct, 4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        pass_at_k(correct, 5)


def test_summary_keys():
    summary = summarize(np.ones((2, 8)), np.array([3, 4]))
    assert {"avg_at_k", "k", "stderr", "pass_at_k", "n_problems"} <= set(summary)
    assert summary["k"] == 8 and summary["avg_at_k"] == 1.0
