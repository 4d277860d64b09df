"""Evaluation of the served policy on the run's eval sets (`data.eval_sets`): avg@k, pass@k, maj@k.

Invariants:
- Sampling seeds depend only on (run seed, problem index, k): the same policy gives the same result
  during training and in `rltools eval`, set by set.
- A set is sampled at its own temperature, top_p and length (greedy: temperature 0, one sample), in
  the run's environment (tools included), and scored by its own verifier.
- eval/step_<v>.json holds every set's summary under "sets" (config order; the first is the headline);
  eval.jsonl gets one line per set, TensorBoard `eval/<set>/<metric>` (`eval/<metric>` for the single
  default set, as before sets existed).
"""

import json
import logging
import time

import numpy as np

from ..config.schema import HELD_OUT
from ..data.eval_sets import EvalSet
from ..durable import append_line, atomic_write
from ..eval.metrics import summarize
from ..metrics import write_scalars
from ..paths import RunPaths
from ..reward import answer_extractor
from ..rollout import FinishReason
from .vllm_engine import request_seed

log = logging.getLogger("rltools.generator")


def evaluate(engine, sets: list[EvalSet], env, seed: int) -> dict[str, dict]:
    """Each set's summary with the engine's current weights, by set name, in order."""
    return {s.name: evaluate_set(engine, s, env, seed) for s in sets}


def evaluate_set(engine, s: EvalSet, env, seed: int) -> dict:
    start = time.perf_counter()
    problems, k = s.problems, s.k
    groups = engine.sample(problems, n=k, seeds=[request_seed(seed, -1, i, k) for i in range(len(problems))], env=env,
                           max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p)
    completions = [e for group in groups for e in group]
    rows = [p for p in problems for _ in range(k)]
    scores = s.reward.score([c.last_turn for c in completions], [p.answer for p in rows], rows)
    correct = np.array(scores).reshape(len(problems), k) > 0.5
    extract = answer_extractor(s.reward_type)
    answers = None if extract is None else np.array([extract(c.last_turn) for c in completions],
                                                    dtype=object).reshape(len(problems), k)
    tokens = np.array([len(c.token_ids) for c in completions])
    truncated = float(np.mean([c.finish_reason == FinishReason.LENGTH for c in completions]))
    tools = {}
    if env.type == "tools":  # how often the policy reached for its tools, and how often they failed
        calls = sum(c.tool_calls for c in completions)
        tools = {"tool_call_rate": round(float(np.mean([c.tool_calls > 0 for c in completions])), 4),
                 "tool_error_rate": round(sum(c.tool_errors for c in completions) / calls, 4) if calls else 0.0}
    sampling = {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": s.max_tokens}
    return {**summarize(correct, tokens, answers), "problems_available": s.available,
            "truncated_fraction": round(truncated, 4), **tools, **sampling,
            "seconds": round(time.perf_counter() - start, 2)}


def record_eval(paths: RunPaths, results: dict[str, dict], version: int) -> None:
    """-> eval/step_<version>.json (atomically), a line of eval.jsonl per set, TensorBoard scalars."""
    paths.eval_dir.mkdir(exist_ok=True)
    atomic_write(paths.eval_result(version), json.dumps({"step": version, "sets": results}))
    single = list(results) == [HELD_OUT]
    for name, summary in results.items():
        line = {"step": version, "set": name, **{k: v for k, v in summary.items() if k != "per_problem_accuracy"}}
        append_line(paths.eval_log, json.dumps({**line, "time": time.time()}))
        write_scalars(paths, version, line, prefix="eval" if single else f"eval/{name}")
        log.info("eval at policy version %d, %s: avg@%d %.3f +- %.3f", version, name, summary["k"],
                 summary["avg_at_k"], summary["stderr"])
