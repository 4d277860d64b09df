"""math-verify as a reward (optional extra `rltools[math]`): symbolic equivalence for non-integer answers.

Runs only inside TimeoutPool workers (rltools/reward/pool.py): math-verify's own timeouts use
SIGALRM, which needs a process's main thread, and some inputs hang it without them.
"""

from ..errors import UserError


def require_math_verify() -> None:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        raise UserError(
            "reward.type math_verify needs the math-verify package: pip install 'rltools[math]'"
        ) from None


def math_verify_score(completion: str, answer) -> float:
    """1.0 iff math-verify finds the completion's final answer equivalent to `answer`."""
    from math_verify import parse, verify

    text = str(answer)
    gold = parse(text if "\\boxed" in text or "$" in text else f"${text}$")
    predicted = parse(completion)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted) else 0.0
