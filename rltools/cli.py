"""The `rltools` command line.

Invariant: this module and everything it imports at start-up are light (no torch, no vLLM), so
`submit --dry-run` and `render` work on a login node; heavy modules are imported inside the
commands that run a role.
"""

import argparse
import sys
from pathlib import Path

from .config import load_config
from .errors import UserError
from .launch.plan import describe, plan
from .launch.run_dir import prepare_run_dir
from .launch.sbatch import render_sbatch


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return UserError.exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rltools", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    submit = commands.add_parser("submit", help="run the RL job described by CONFIG")
    _config_arguments(submit)
    submit.add_argument(
        "--dry-run", action="store_true", help="print the job script (stdout) and topology (stderr); change nothing"
    )
    submit.set_defaults(func=cmd_submit)

    render = commands.add_parser("render", help="prepare the run directory and write the sbatch script")
    _config_arguments(render)
    render.add_argument("-o", "--output", type=Path, help="script path (default: RUN_DIR/slurm/job.sbatch)")
    render.set_defaults(func=cmd_render)

    evaluate = commands.add_parser("eval", help="avg@k / pass@k of a policy of a run, on its held-out problems")
    evaluate.add_argument("target", type=Path, metavar="CONFIG_OR_RUN_DIR", help="a run directory or a YAML config")
    evaluate.add_argument("--checkpoint", default="latest", help="base, latest (default) or step_N")
    evaluate.add_argument("--k", type=int, help="samples per problem (default: eval.k)")
    evaluate.add_argument("--problems", type=int, help="held-out problems to evaluate (default: eval.problems)")
    evaluate.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                          help="override a key of a CONFIG (not of a run directory's config)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.set_defaults(func=cmd_eval)

    bench = commands.add_parser("bench", help="measure a data plane against its raw reference")
    kinds = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    handoff = kinds.add_parser("handoff", help="rollout shards through the store vs raw file write+fsync+read")
    handoff.add_argument("--dir", help="directory to measure in (default: here; use your run directory's filesystem)")
    handoff.add_argument("--repeats", type=int, default=9)
    weights = kinds.add_parser("weights", help="weight-sync broadcast vs one contiguous gloo broadcast")
    weights.add_argument("--mb", type=int, default=256, help="size of the model-like tensor set")
    step = kinds.add_parser("step", help="our RL step (demo job) vs TRL's GRPOTrainer, same model and shape")
    step.add_argument("--steps", type=int, default=14)
    generate = kinds.add_parser("generate", help="vLLM generation tokens/s vs HF generate, same model and prompts")
    for sub in (handoff, weights, step, generate):
        sub.add_argument("--json", action="store_true", help="print one JSON object")
        sub.set_defaults(func=cmd_bench)
    return parser


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="YAML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set schedule.steps=10 (repeatable)",
    )


def cmd_submit(args) -> int:
    config = load_config(args.config, args.overrides)
    script = render_sbatch(config)
    if args.dry_run:
        print(describe(config, plan(config)), file=sys.stderr)
        sys.stdout.write(script)
        return 0
    paths = prepare_run_dir(config, script)
    if config.cluster.launcher == "local":
        from .launch.local import run_local

        print(describe(config, plan(config)), file=sys.stderr)
        return run_local(config, paths)
    raise UserError(
        "submitting through Slurm from rltools is not built yet; the job script is ready: "
        f"sbatch {paths.sbatch_script}  (then follow {paths.root}/slurm/logs)"
    )


def cmd_render(args) -> int:
    config = load_config(args.config, args.overrides)
    script = render_sbatch(config)
    paths = prepare_run_dir(config, script)
    target = args.output or paths.sbatch_script
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(script)
    print(describe(config, plan(config)), file=sys.stderr)
    print(f"wrote {target}; submit it with: sbatch {target}", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    import contextlib
    import json

    from .paths import RunPaths

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
    from .eval.run import run_eval  # light itself; vLLM is imported only once the checkpoint is found

    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; stdout carries the result only
        result = run_eval(config, args.checkpoint, k=args.k, problems=args.problems, paths=paths)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['checkpoint']} (step {result['step']}): avg@{result['k']} {result['avg_at_k']:.3f} "
        f"(+- {result['stderr']:.3f}, {result['n_problems']} problems) | pass@{result['k']} {result['pass_at_k']:.3f} "
        f"pass@1 {result['pass_at_1']:.3f} | completion tokens mean {result['mean_completion_tokens']:.1f} "
        f"max {result['max_completion_tokens']}, truncated {100 * result['truncated_fraction']:.1f}% | {result['seconds']:.1f} s"
    )
    print(_per_problem(result["per_problem_accuracy"], result["k"]))
    return 0


def _per_problem(accuracy: list[float], k: int) -> str:
    """Each problem's accuracy for short sets (AIME: 30), else how many problems got j of k right."""
    if len(accuracy) <= 40:
        return "per-problem accuracy: " + " ".join(f"{a:.2f}" for a in accuracy)
    counts = [0] * (k + 1)
    for a in accuracy:
        counts[round(a * k)] += 1
    return "problems by correct samples: " + ", ".join(f"{j}/{k}: {c}" for j, c in enumerate(counts) if c)


def cmd_bench(args) -> int:
    import json

    if args.kind == "handoff":
        from .bench.handoff import run_handoff_bench

        result = run_handoff_bench(repeats=args.repeats, directory=args.dir)
        summary = (
            f"hand-off of {result['shard_mb']} MB shards: ours {result['ours_mb_s']} MB/s, raw files "
            f"{result['reference_mb_s']} MB/s, ratio {result['ratio']}; p50 visible {result['p50_visible_s']} s"
        )
    elif args.kind == "step":
        from .bench.step import run_step_bench

        result = run_step_bench(steps=args.steps)
        summary = (
            f"RL step ({result['shape']}): ours {result['ours_s']} s, TRL GRPOTrainer {result['reference_s']} s, "
            f"ratio {result['ratio']}"
        )
    elif args.kind == "generate":
        from .bench.generate import run_generate_bench

        result = run_generate_bench()
        summary = (
            f"generation: vLLM {result['ours_tokens_s']} tokens/s, HF generate {result['reference_tokens_s']} "
            f"tokens/s, ratio {result['ratio']}"
        )
    else:
        from .bench.weights import run_weights_bench

        result = run_weights_bench(total_mb=args.mb)
        summary = (
            f"weight broadcast of {result['total_mb']} MB to {result['receivers']} receivers: ours "
            f"{result['ours_gb_s']} GB/s, one contiguous buffer {result['reference_gb_s']} GB/s, ratio {result['ratio']}"
        )
    print(json.dumps(result) if args.json else summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
