"""`rltools samples RUN`: what the policy wrote, readable — a trained step's kept samples (prompt,
completion, reward, advantage, finish reason) or an evaluation's completions per problem.

Invariant: login-side light: the files are JSON lines (`rltools.completions`) read with the standard
library; stdout carries the samples only (errors go to stderr with what exists instead).
"""

import argparse
import json
import re
from pathlib import Path

from ..completions import eval_set_names, read_rows
from ..errors import UserError
from ..records import read_json, set_results
from ..monitor.status import open_run
from ..paths import RunPaths

SHOWN = {"train": 8, "eval": 3}  # samples, problems: when -n is not given


def add_parser(commands) -> None:
    sub = commands.add_parser("samples", help="print a step's kept samples or an evaluation's completions, readably")
    sub.add_argument("run_dir", type=Path, help="the run directory (run.dir)")
    sub.add_argument("--step", type=int, help="the trained step (metrics.jsonl's step), or with --eval the steps "
                     "done when it evaluated (default: the latest with samples)")
    sub.add_argument("--eval", nargs="?", const="", metavar="SET",
                     help="an evaluation's completions, of one eval set (default: every set)")
    sub.add_argument("--adhoc", action="store_true", help="with --eval: those the last `rltools eval` of that "
                     "policy kept (eval/adhoc/), not the run's own evaluation")
    order = sub.add_mutually_exclusive_group()
    order.add_argument("--worst", action="store_true", help="lowest reward first (--eval: problems by accuracy, "
                       "completions by score)")
    order.add_argument("--best", action="store_true", help="highest reward first")
    sub.add_argument("--grep", metavar="REGEX", help="only completions that match REGEX (Python re, searched anywhere)")
    sub.add_argument("-n", type=int, metavar="N", help=f"show N samples (default {SHOWN['train']}) or, with --eval, "
                     f"N problems (default {SHOWN['eval']})")
    sub.add_argument("--chars", type=int, default=2000, metavar="N",
                     help="cut texts longer than N characters in the middle (default 2000; 0: never)")
    sub.add_argument("--json", action="store_true", help="print the selected rows as JSON lines")
    sub.set_defaults(func=cmd_samples)


def cmd_samples(args: argparse.Namespace) -> int:
    paths = open_run(args.run_dir)
    if args.adhoc and args.eval is None:
        raise UserError("--adhoc reads what `rltools eval` kept: add --eval")
    if args.n is not None and args.n < 1:
        raise UserError(f"-n must be >= 1, got {args.n}")
    pattern = _pattern(args.grep)
    lines = (_eval_lines if args.eval is not None else _train_lines)(paths, args, pattern)
    print("\n".join(lines))
    return 0


def _pattern(grep: str | None) -> re.Pattern | None:
    try:
        return re.compile(grep) if grep is not None else None
    except re.error as err:
        raise UserError(f"--grep {grep!r} is not a regular expression: {err}") from None


def _matches(pattern: re.Pattern | None, completion: dict) -> bool:
    return pattern is None or any(pattern.search(completion.get(key) or "") for key in ("completion", "episode"))


def _pick_step(steps: dict[int, Path], wanted: int | None, what: str, where: Path) -> int:
    step = max(steps) if wanted is None else wanted
    if step not in steps:
        raise UserError(f"no {what} of step {step} in {where}; steps that have some: {_ranges(sorted(steps))}")
    return step


def _ranges(steps: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


# -- a trained step's samples ------------------------------------------------------------------
def _train_lines(paths: RunPaths, args, pattern) -> list[str]:
    steps = paths.sample_steps()
    if not steps:
        raise UserError(f"{paths.root} keeps no step samples (no {paths.samples_dir}/step_N.jsonl): it trained no step "
                        "yet, its run.samples_per_step is 0, or an older rltools ran it; its evaluations' completions: "
                        "--eval")
    step = _pick_step(steps, args.step, "samples", paths.samples_dir)
    rows = read_rows(steps[step])
    chosen = [r for r in rows if _matches(pattern, r)]
    if args.worst or args.best:
        chosen.sort(key=lambda r: (r["reward"], r.get("advantage", 0.0)), reverse=args.best)
    shown = chosen[: args.n or SHOWN["train"]]
    if args.json:
        return [json.dumps({"step": step, **row}) for row in shown]
    groups = len({r["group"] for r in rows})
    order = ", worst reward first" if args.worst else ", best reward first" if args.best else ""
    matching = f", {len(chosen)} matching {args.grep!r}" if pattern else ""
    lines = [f"step {step} ({paths.relative(steps[step])}): {len(rows)} samples of {groups} groups kept{matching}; "
             f"showing {len(shown)}{order}"]
    prompt = None
    for row in shown:
        lines += _sample_lines(row, show_prompt=row["prompt"] != prompt, chars=args.chars)
        prompt = row["prompt"]
    return lines + _more(len(shown), len(chosen), "samples")


def _sample_lines(row: dict, show_prompt: bool, chars: int) -> list[str]:
    scores = "".join(f" {name} {value:.3f}" for name, value in row.get("scores", {}).items())
    where = f"engine {row['engine']}, " if row.get("engine") is not None else ""
    head = (f"-- group {row['group']} sample {row['index']} | reward {row['reward']:.3f}{scores} | advantage "
            f"{row['advantage']:+.3f} | {row['finish_reason']}, {row['completion_tokens']} tokens | {where}"
            f"policy version {row['policy_version']}")
    lines = ["", head] + (_block("prompt", row["prompt"], chars) if show_prompt else [])
    lines += _block("completion", row["completion"], chars)
    if "episode" in row:
        lines += _block(f"episode ({row['turns']} turns, {row['tool_calls']} tool calls)", row["episode"], chars)
    return lines


# -- an evaluation's completions ----------------------------------------------------------------
def _eval_lines(paths: RunPaths, args, pattern) -> list[str]:
    root = paths.eval_samples_root(args.adhoc)
    steps = paths.eval_sample_steps(args.adhoc)
    if not steps:
        how = ("`rltools eval RUN` keeps its completions there" if args.adhoc else
               "the run has not evaluated yet, or an older rltools ran it; `rltools eval` keeps its own in "
               "eval/adhoc/ (--adhoc)")
        raise UserError(f"{paths.root} keeps no evaluation completions (no {root}/step_N): {how}")
    step = _pick_step(steps, args.step, "evaluation completions", root)
    names = _set_order(paths, step, eval_set_names(steps[step]), args.adhoc)
    if args.eval and args.eval not in names:
        raise UserError(f"no eval set {args.eval!r} in {steps[step]}; its sets: {', '.join(names)}")
    lines = []
    for name in [args.eval] if args.eval else names:
        lines += _set_lines(paths, steps[step] / f"{name}.jsonl", step, name, args, pattern)
    return lines


def _set_order(paths: RunPaths, step: int, names: list[str], adhoc: bool) -> list[str]:
    """The sets in config order (the headline first), as the run's result file lists them."""
    result = None if adhoc else read_json(paths.eval_result(step))
    order = list(set_results(result)) if result else []
    return [n for n in order if n in names] + [n for n in names if n not in order]


def _set_lines(paths: RunPaths, path: Path, step: int, name: str, args, pattern) -> list[str]:
    problems = [{"problem": i, **row} for i, row in enumerate(read_rows(path))]
    chosen = []  # (problem, its completions to show)
    for row in problems:
        completions = [(j, c) for j, c in enumerate(row["completions"]) if _matches(pattern, c)]
        if args.worst or args.best:
            completions.sort(key=lambda pair: pair[1]["score"], reverse=args.best)
        if completions:
            chosen.append((row, completions))
    if args.worst or args.best:
        chosen.sort(key=lambda pair: pair[0]["accuracy"], reverse=args.best)
    shown = chosen[: args.n or SHOWN["eval"]]
    if args.json:
        return [json.dumps({"step": step, "set": name, **row, "completions": [c for _, c in completions]})
                for row, completions in shown]
    mean = sum(row["accuracy"] for row in problems) / len(problems) if problems else 0.0
    order = ", lowest accuracy first" if args.worst else ", highest accuracy first" if args.best else ""
    matching = f", {len(chosen)} with a completion matching {args.grep!r}" if pattern else ""
    lines = [f"eval after {step} steps, {name} ({paths.relative(path)}): {len(problems)} problems, mean accuracy "
             f"{mean:.3f}{matching}; showing {len(shown)}{order}"]
    for row, completions in shown:
        lines += _problem_lines(row, completions, args.chars)
    return lines + _more(len(shown), len(chosen), "problems") + [""]


def _problem_lines(row: dict, completions: list[tuple[int, dict]], chars: int) -> list[str]:
    k = len(row["completions"])
    right = sum(c["correct"] for c in row["completions"])
    some = f", {len(completions)} shown" if len(completions) < k else ""
    lines = ["", f"-- problem {row['problem']} | accuracy {row['accuracy']:.3f} ({right} of {k} correct{some}) | "
                 f"answer {row['answer']}"] + _block("prompt", row["prompt"], chars)
    for j, c in completions:
        extracted = f" | extracted {c['extracted']}" if "extracted" in c else ""
        lines += _block(f"sample {j}: score {c['score']:.3f}{extracted} | {c['finish_reason']}, {c['tokens']} tokens",
                        c.get("episode", c["completion"]), chars)
    return lines


# -- text ---------------------------------------------------------------------------------------
def _block(label: str, text: str, chars: int) -> list[str]:
    """`label:` and the text below it, indented, cut in the middle past `chars` characters."""
    if chars and len(text) > chars:
        half = chars // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut: --chars 0 shows all ...]\n{text[-half:]}"
    return [f"  {label}:"] + [f"    {line}" for line in text.splitlines() or [""]]


def _more(shown: int, total: int, what: str) -> list[str]:
    return [f"\n({shown} of {total} {what} shown: -n {total} shows all)"] if shown < total else []
