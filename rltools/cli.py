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

    quant = commands.add_parser("quantize", help="convert a Hugging Face checkpoint to NVFP4 (compressed-tensors)")
    quant.add_argument("model_dir", type=Path, help="Hugging Face model directory (safetensors, bf16/fp16/fp32)")
    quant.add_argument("-o", "--output", type=Path, required=True, help="new output directory")
    quant.add_argument("--format", choices=["nvfp4"], default="nvfp4", help="target format (default: nvfp4)")
    quant.add_argument(
        "--ignore", action="append", default=[], metavar="PATTERN",
        help="keep matching linear layers in high precision: a module name or re:REGEX (repeatable); "
        "embeddings, lm_head, norms and routers are always kept",
    )
    quant.add_argument("--shard-gb", type=float, default=1.0, help="output shard size in GB (default 1)")
    quant.add_argument("--quiet", action="store_true", help="no progress bar")
    quant.set_defaults(func=cmd_quantize)
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


def cmd_quantize(args) -> int:
    if not (args.model_dir / "config.json").exists():
        raise UserError(f"{args.model_dir}: not a Hugging Face model directory (no config.json)")
    from .quant.checkpoint import quantize_checkpoint

    try:
        summary = quantize_checkpoint(
            args.model_dir, args.output, ignore=args.ignore, shard_bytes=int(args.shard_gb * 1e9), progress=not args.quiet
        )
    except ValueError as err:
        raise UserError(str(err)) from err
    for line in summary.lines():
        print(line)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
