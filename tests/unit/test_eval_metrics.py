import math

import numpy as np
import pytest

from rltools.eval.metrics import avg_at_k, maj_at_k, majority, pass_at_k, pass_at_k_stderr, summarize


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


def test_pass_at_k_stderr_is_over_problems():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    per = np.array([0.5, 0.0, 1.0])  # pass@2 of each problem, as above
    assert pass_at_k_stderr(correct, 2) == pytest.approx(per.std(ddof=1) / math.sqrt(3))
    assert pass_at_k_stderr(correct, 1) == pytest.approx(avg_at_k(correct)[1])
    assert pass_at_k_stderr(correct[:1], 2) == 0.0  # one problem: no spread to estimate


@pytest.mark.parametrize("answers, winner", [
    ([3, 5, 5, 3], 5),  # 5 reaches two votes first
    ([3, 5, 3, 5], 3),
    ([None, None, 7, 8], 7),
    ([None, None, None, 2], 2),  # None never wins, however many
    ([None, None], None),
    (["\\frac{1}{2}", "0.5", "0.5"], "0.5"),
])
def test_majority_breaks_ties_by_first_to_the_top_count(answers, winner):
    assert majority(answers) == winner


def test_maj_at_k_by_hand():
    answers = [
        [5, 3, 5, 3],           # tie 5/3: 5 reached 2 first; one sample with 5 was judged correct
        [7, 7, 1, None],        # 7 wins but is wrong; the right 1 is in the minority
        [None, None, None, None],  # nothing extracted: 0
        [None, 4, None, None],  # one answer is a majority of one
    ]
    correct = np.array([[0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0]])
    maj, stderr = maj_at_k(answers, correct)
    per = np.array([1.0, 0.0, 0.0, 1.0])
    assert maj == pytest.approx(0.5)
    assert stderr == pytest.approx(per.std(ddof=1) / math.sqrt(4))


def test_maj_at_k_refuses_a_matrix_of_another_shape():
    with pytest.raises(ValueError, match="2 x 3"):
        maj_at_k([[1, 2, 3], [1, 2]], np.zeros((2, 3)))
    with pytest.raises(ValueError):
        maj_at_k([[1, 2, 3]], np.zeros((2, 3)))


def test_summary_adds_maj_only_with_answers():
    correct = np.array([[1, 0, 1], [0, 0, 0]])
    plain = summarize(correct, np.array([3, 4]))
    assert "maj_at_k" not in plain and "maj_stderr" not in plain
    assert plain["pass_stderr"] == pytest.approx(0.5)  # pass@3 per problem: 1, 0
    voted = summarize(correct, np.array([3, 4]), answers=np.array([[2, 9, 2], [4, 4, None]], dtype=object))
    assert voted["maj_at_k"] == 0.5 and voted["maj_stderr"] == pytest.approx(0.5)
    assert {key: voted[key] for key in plain} == plain  # the other keys keep their meaning
