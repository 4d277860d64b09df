"""Evaluation of the served policy on the run's eval sets (`data.eval_sets`): avg@k, pass@k, maj@k.

Invariants:
- Sampling seeds depend only on (run seed, problem index, k): the same policy gives the same result
  during training and in `rltools eval`, set by set.
- A set is sampled at its own temperature, top_p and length (greedy: temperature 0, one sample), in
  the run's environment (tools included), and scored by its own verifier.
- eval/step_<v>.json holds every set's summary under "sets" (config order; the first is the headline);
  eval.jsonl gets one line per set, TensorBoard `eval/<set>/<metric>` (`eval/<metric>` for the single
  default set, as before sets existed).
- Every completion is kept: eval/samples/step_<v>/<set>.jsonl, a `problem_row` per problem in the
  set's order (`rltools.completions`), complete before the result file appears.
"""

import json
import logging
import time

import numpy as np

from ..completions import write_eval_completions
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


def evaluate(engine, sets: list[EvalSet], env, seed: int) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """Each set's summary with the engine's current weights, and its completions (`problem_row`s),
    both by set name, in order."""
    results, completions = {}, {}
    for s in sets:
        results[s.name], completions[s.name] = evaluate_set(engine, s, env, seed)
    return results, completions


def evaluate_set(engine, s: EvalSet, env, seed: int) -> tuple[dict, list[dict]]:
    """The set's summary and a row per problem with its completions."""
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
    summary = {**summarize(correct, tokens, answers), "problems_available": s.available,
               "truncated_fraction": round(truncated, 4), **tools, **sampling,
               "seconds": round(time.perf_counter() - start, 2)}
    decode = engine.tokenizer.decode if env.type != "single_turn" else None  # a whole episode, tool answers too
    rows = [problem_row(p, group, scores[i * k:(i + 1) * k], None if answers is None else answers[i], decode)
            for i, (p, group) in enumerate(zip(problems, groups))]
    return summary, rows


def problem_row(problem, episodes: list, scores: list[float], answers, decode=None) -> dict:
    """A problem's line of eval/samples/step_<k>/<set>.jsonl: its prompt, reference answer, accuracy and
    each completion with its score, the answer the verifier extracted (where it extracts one), finish
    reason and length; `decode`: a multi-turn episode's whole text beside its last turn (the scored text)."""
    completions = []
    for j, (e, score) in enumerate(zip(episodes, scores)):
        completion = {"completion": e.last_turn, "score": round(float(score), 6), "correct": bool(score > 0.5),
                      "finish_reason": FinishReason(e.finish_reason).name.lower(), "tokens": len(e.token_ids)}
        if answers is not None:
            completion["extracted"] = answers[j]
        if decode is not None:
            completion.update(episode=decode(e.token_ids), turns=e.turns, tool_calls=e.tool_calls)
        completions.append(completion)
    accuracy = sum(c["correct"] for c in completions) / len(completions) if completions else 0.0
    return {"prompt": problem.prompt, "answer": problem.answer, "accuracy": round(accuracy, 4),
            "completions": completions}


def record_eval(paths: RunPaths, results: dict[str, dict], version: int,
                completions: dict[str, list[dict]] | None = None) -> None:
    """-> eval/samples/step_<version>/ (the completions, first: they are there once the result is),
    eval/step_<version>.json (atomically), a line of eval.jsonl per set, TensorBoard scalars."""
    paths.eval_dir.mkdir(exist_ok=True)
    if completions is not None:
        write_eval_completions(paths.eval_samples_dir(version), completions)
    atomic_write(paths.eval_result(version), json.dumps({"step": version, "sets": results}))
    single = list(results) == [HELD_OUT]
    for name, summary in results.items():
        line = {"step": version, "set": name, **{k: v for k, v in summary.items() if k != "per_problem_accuracy"}}
        append_line(paths.eval_log, json.dumps({**line, "time": time.time()}))
        write_scalars(paths, version, line, prefix="eval" if single else f"eval/{name}")
        log.info("eval at policy version %d, %s: avg@%d %.3f +- %.3f", version, name, summary["k"],
                 summary["avg_at_k"], summary["stderr"])
