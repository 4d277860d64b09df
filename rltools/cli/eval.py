"""`rltools eval`: one policy of a run, evaluated here (vLLM in this process) or as a Slurm job.

Invariant: light at import, like the rest of the command line; stdout carries the result only.
Evaluated here, vLLM's own output (its warnings, C++ and progress-bar lines that no logging setting
reaches) goes to a log file, which is shown when the evaluation fails; --verbose shows it live.
"""

import contextlib
import os
import sys
import tempfile

from ..config import load_config
from ..config.schema import HELD_OUT
from ..errors import UserError


def add_where_arguments(parser) -> None:
    """--slurm / --local: where a command that runs vLLM runs (`rltools eval`, `rltools export`)."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--slurm", dest="where", action="store_const", const="slurm",
                       help="run as a Slurm job on one generator's resources (default when cluster.launcher is slurm)")
    where.add_argument("--local", dest="where", action="store_const", const="local",
                       help="run here, in this process (default when cluster.launcher is local)")


def cmd_eval(args) -> int:
    import json

    from ..paths import RunPaths

    if args.target.is_dir():
        if args.overrides:
            raise UserError("--set applies to a CONFIG file; a run directory is evaluated with the config it ran with")
        paths = RunPaths(args.target)
        config = load_config(paths.config)
    else:
        config = load_config(args.target, args.overrides)
        paths = RunPaths(config.run.dir)  # its exports, if that run exists; base needs none
    for flag, value in (("--k", args.k), ("--problems", args.problems)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    judged = [name for name, spec in (config.eval.sets or {HELD_OUT: None}).items() if not (spec and spec.reward)]
    if config.reward.uses_judge and judged:
        raise UserError(f"eval set(s) {', '.join(judged)} are scored with the run's reward, which has a judge (reward.judge): "
                        "its engines serve inside the run's job only, and `rltools eval` starts none. The run's own "
                        "evaluations (eval/step_N.json) are scored by it; here, give each set a verifier of its own "
                        "(eval.sets.NAME.reward) in a config file")
    if (args.where or config.cluster.launcher) == "slurm":
        result = _eval_on_slurm(config, paths, args)
    else:
        from ..jobs.eval import (
            run_eval,  # light itself; vLLM is imported only once the checkpoint is found
        )

        print(f"evaluating {args.checkpoint} of {paths.root} ...", file=sys.stderr, flush=True)
        with (contextlib.nullcontext() if args.verbose else _output_to_log()), \
                contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; stdout carries the result only
            result = run_eval(config, args.checkpoint, k=args.k, problems=args.problems, paths=paths)
    if "completions" in result:
        print(f"completions kept in {result['completions']}: rltools samples {paths.root} --eval --adhoc --step "
              f"{result['step']}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
        return 0
    for name, summary in result["sets"].items():
        print(f"{result['checkpoint']} (step {result['step']}), {name}: {describe_set(summary)}")
        print(_per_problem(summary["per_problem_accuracy"], summary["k"]))
    return 0


def describe_set(s: dict) -> str:
    """One eval set's summary on a line: avg@k +- stderr, pass@k, maj@k, sampling, tokens, time."""
    problems = f"{s['n_problems']} problems" + (f" of {s['problems_available']}"
                                                if s.get("problems_available", s["n_problems"]) > s["n_problems"] else "")
    majority = f" maj@{s['k']} {s['maj_at_k']:.3f}" if "maj_at_k" in s else ""
    sampling = "greedy" if s.get("temperature") == 0 else f"T {s.get('temperature')} top-p {s.get('top_p')}"
    return (f"avg@{s['k']} {s['avg_at_k']:.3f} (+- {s['stderr']:.3f}, {problems}) | pass@{s['k']} {s['pass_at_k']:.3f} "
            f"pass@1 {s['pass_at_1']:.3f}{majority} | {sampling}, completion tokens mean "
            f"{s['mean_completion_tokens']:.1f} max {s['max_completion_tokens']}, truncated "
            f"{100 * s['truncated_fraction']:.1f}% | {s['seconds']:.1f} s")


def _eval_on_slurm(config, paths, args) -> dict:
    from ..jobs.eval import run_eval
    from ..launch.slurm import submit_task
    from ..policy_exports import resolve_checkpoint

    resolve_checkpoint(paths, args.checkpoint)  # a wrong name fails here, not in the queue
    job = submit_task(config, paths, "eval", run_eval, config, args.checkpoint, args.k, args.problems, paths)
    print(f"submitted eval job {job.job_id} (log: {job.paths.stdout}); waiting for it", file=sys.stderr)
    return wait_for(job, "eval")


def wait_for(job, what: str):
    """The result of a one-task job (`launch.slurm.submit_task`); a UserError naming its log when it failed."""
    import submitit

    try:
        return job.result()
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
        raise UserError(f"{what} job {job.job_id} failed; its log {job.paths.stdout}:\n{err}") from None


@contextlib.contextmanager
def _output_to_log():
    """File descriptors 1 and 2 into a log file for the duration; on an error its tail is printed."""
    log = tempfile.NamedTemporaryFile("w+b", prefix="rltools-eval-", suffix=".log", delete=False)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        for fd in saved:
            os.dup2(log.fileno(), fd)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
    except BaseException:
        log.seek(0)
        tail = log.read().decode(errors="replace").splitlines()[-30:]
        print("\n".join(tail) + f"\n(vLLM's whole output: {log.name})", file=sys.stderr)
        raise
    else:
        os.unlink(log.name)
    finally:
        for copy in saved.values():
            os.close(copy)
        log.close()


def _per_problem(accuracy: list[float], k: int) -> str:
    """Each problem's accuracy for short sets (AIME: 30), else how many problems got j of k right."""
    if len(accuracy) <= 40:
        return "per-problem accuracy: " + " ".join(f"{a:.2f}" for a in accuracy)
    counts = [0] * (k + 1)
    for a in accuracy:
        counts[round(a * k)] += 1
    return "problems by correct samples: " + ", ".join(f"{j}/{k}: {c}" for j, c in enumerate(counts) if c)
