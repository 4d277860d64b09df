"""avg@k and pass@k from a [problems x samples] matrix of 0/1 correctness. Pure numpy.

avg@k is the mean accuracy over all k samples of all problems (the seed's headline metric); its
standard error is taken over problems (samples of one problem are not independent). pass@k uses the
unbiased estimator 1 - C(n-c, k) / C(n, k) with n samples per problem, c of them correct.
"""

import math

import numpy as np


def avg_at_k(correct: np.ndarray) -> tuple[float, float]:
    """(avg@k, standard error over problems) for a [P, k] correctness matrix."""
    per_problem = correct.mean(axis=1)
    stderr = per_problem.std(ddof=1) / math.sqrt(len(per_problem)) if len(per_problem) > 1 else 0.0
    return float(per_problem.mean()), float(stderr)


def pass_at_k(correct: np.ndarray, k: int) -> float:
    """Unbiased pass@k averaged over problems; needs k <= samples per problem."""
    n = correct.shape[1]
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    values = []
    for c in correct.sum(axis=1).astype(int):
        values.append(1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k))
    return float(np.mean(values))


def summarize(correct: np.ndarray, completion_tokens: np.ndarray) -> dict:
    avg, stderr = avg_at_k(correct)
    k = correct.shape[1]
    return {
        "avg_at_k": round(avg, 4),
        "k": k,
        "stderr": round(stderr, 4),
        "pass_at_k": round(pass_at_k(correct, k), 4),
        "pass_at_1": round(pass_at_k(correct, 1), 4),
        "n_problems": int(correct.shape[0]),
        "per_problem_accuracy": [round(float(a), 4) for a in correct.mean(axis=1)],
        "mean_completion_tokens": round(float(completion_tokens.mean()), 2) if completion_tokens.size else 0.0,
        "median_completion_tokens": float(np.median(completion_tokens)) if completion_tokens.size else 0.0,
        "max_completion_tokens": int(completion_tokens.max()) if completion_tokens.size else 0,
    }
