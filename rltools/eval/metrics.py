"""avg@k, pass@k and maj@k from [problems x samples] matrices. Pure numpy.

Invariants:
- Every standard error is taken over problems (samples of one problem are not independent): the
  sample standard deviation (ddof=1) of the per-problem scores over sqrt(problems), 0.0 for one problem.
- avg@k is the mean accuracy over all k samples of all problems (the seed's headline metric).
- pass@k uses the unbiased estimator 1 - C(n-c, k) / C(n, k) with n samples per problem, c of them correct.
- maj@k scores a problem 1 iff its most frequent extracted answer was judged correct (a sample giving
  it is correct). Ties go to the answer that reached the top count first, in sample order; None (no
  answer extracted) never wins; a problem with no extracted answer scores 0.
"""

import math
from collections.abc import Hashable, Sequence

import numpy as np


def _stderr(per_problem: np.ndarray) -> float:
    return float(per_problem.std(ddof=1) / math.sqrt(len(per_problem))) if len(per_problem) > 1 else 0.0


def avg_at_k(correct: np.ndarray) -> tuple[float, float]:
    """(avg@k, standard error over problems) for a [P, k] correctness matrix."""
    per_problem = correct.mean(axis=1)
    return float(per_problem.mean()), _stderr(per_problem)


def pass_at_k_per_problem(correct: np.ndarray, k: int) -> np.ndarray:
    """Unbiased pass@k of each problem, [P]; needs k <= samples per problem."""
    n = correct.shape[1]
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    counts = correct.sum(axis=1).astype(int)
    return np.array([1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k) for c in counts])


def pass_at_k(correct: np.ndarray, k: int) -> float:
    """Unbiased pass@k averaged over problems; needs k <= samples per problem."""
    return float(pass_at_k_per_problem(correct, k).mean())


def pass_at_k_stderr(correct: np.ndarray, k: int) -> float:
    """Standard error over problems of pass@k."""
    return _stderr(pass_at_k_per_problem(correct, k))


def majority(answers: Sequence[Hashable | None]) -> Hashable | None:
    """The most frequent non-None answer; of those tied, the first to reach the top count. None if all are None."""
    counts: dict = {}
    winner, top = None, 0
    for answer in answers:
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        if counts[answer] > top:  # strictly more: a tie keeps the answer that got there first
            winner, top = answer, counts[answer]
    return winner


def maj_at_k_per_problem(answers: Sequence[Sequence[Hashable | None]], correct: np.ndarray) -> np.ndarray:
    """1.0 where a problem's majority answer is a correct one, [P]; `answers` is [P, k] like `correct`."""
    if len(answers) != correct.shape[0] or any(len(row) != correct.shape[1] for row in answers):
        raise ValueError(f"answers must be [{correct.shape[0]} x {correct.shape[1]}] like the correctness matrix")
    scores = []
    for row, row_correct in zip(answers, correct):
        winner = majority(row)
        scores.append(float(winner is not None and any(c for a, c in zip(row, row_correct) if a == winner)))
    return np.array(scores)


def maj_at_k(answers: Sequence[Sequence[Hashable | None]], correct: np.ndarray) -> tuple[float, float]:
    """(maj@k, standard error over problems) for [P, k] extracted answers and correctness."""
    per_problem = maj_at_k_per_problem(answers, correct)
    return float(per_problem.mean()), _stderr(per_problem)


def summarize(correct: np.ndarray, completion_tokens: np.ndarray,
              answers: Sequence[Sequence[Hashable | None]] | None = None) -> dict:
    """The eval result's metrics; `maj_at_k`/`maj_stderr` only when the extracted `answers` are given."""
    avg, stderr = avg_at_k(correct)
    k = correct.shape[1]
    summary = {
        "avg_at_k": round(avg, 4),
        "k": k,
        "stderr": round(stderr, 4),
        "pass_at_k": round(pass_at_k(correct, k), 4),
        "pass_stderr": round(pass_at_k_stderr(correct, k), 4),
        "pass_at_1": round(pass_at_k(correct, 1), 4),
        "n_problems": int(correct.shape[0]),
        "per_problem_accuracy": [round(float(a), 4) for a in correct.mean(axis=1)],
        "mean_completion_tokens": round(float(completion_tokens.mean()), 2) if completion_tokens.size else 0.0,
        "median_completion_tokens": float(np.median(completion_tokens)) if completion_tokens.size else 0.0,
        "max_completion_tokens": int(completion_tokens.max()) if completion_tokens.size else 0,
    }
    if answers is not None:
        maj, maj_stderr = maj_at_k(answers, correct)
        summary.update(maj_at_k=round(maj, 4), maj_stderr=round(maj_stderr, 4))
    return summary
