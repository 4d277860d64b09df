"""math-verify as a reward (optional extra `rltools[math]`): symbolic equivalence for non-integer answers.

Runs only inside TimeoutPool workers (rltools/reward/pool.py): math-verify's own timeouts use
SIGALRM, which needs a process's main thread, and some inputs hang it without them. math-verify is
imported here, at module level, so that a worker imports it while starting (about 0.5 s, more on a
loaded machine), and the pool's warm-up call (verifiers.MATH_VERIFY_WARMUP) builds its parser:
neither counts against the first call's reward.timeout_s.
"""

from math_verify import parse, verify


def math_verify_score(completion: str, answer) -> float:
    """1.0 iff math-verify finds the completion's final answer equivalent to `answer`."""
    text = str(answer)
    gold = parse(text if "\\boxed" in text or "$" in text else f"${text}$")
    predicted = parse(completion)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted) else 0.0
