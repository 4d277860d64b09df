"""The `rltools` command line.

Invariant: this module and everything it imports at start-up are light (no torch, no vLLM), so
`submit --dry-run` and `render` work on a login node; heavy modules are imported inside the
commands that run a role.
"""

import argparse
import sys
from pathlib import Path

from ..config import load_config
from ..errors import UserError
from ..launch.plan import describe, plan
from ..launch.run_dir import prepare_run_dir
from ..launch.sbatch import render_sbatch
from ..paths import ROLES
from . import check_model, export, quantize, samples
from .eval import add_where_arguments, cmd_eval


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
    submit.add_argument(
        "--wait", action="store_true", help="Slurm: follow the job's progress until it ends; exit 1 unless it completes"
    )
    submit.set_defaults(func=cmd_submit)

    resume = commands.add_parser("resume", help="continue a stopped or failed run from its latest checkpoint, or "
                                 "extend a completed one (--set schedule.steps=N)")
    resume.add_argument("run_dir", type=Path, help="the run directory (run.dir)")
    resume.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="change where or how long the job runs, e.g. --set cluster.time=04:00:00, or extend it: --set "
        "schedule.steps=N (cluster.*, schedule.steps, cadences, retention and deadlines only: the error lists them)",
    )
    resume.add_argument("--wait", action="store_true", help="Slurm: follow the job until it ends")
    resume.set_defaults(func=cmd_resume)

    status = commands.add_parser("status", help="state, progress, ETA and failures of a run")
    status.add_argument("run_dir", type=Path, help="the run directory (run.dir)")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=cmd_status)

    logs = commands.add_parser("logs", help="print (or follow) a run's task logs from its latest attempt")
    logs.add_argument("run_dir", type=Path, help="the run directory (run.dir)")
    logs.add_argument("--role", choices=list(ROLES), help="one role's tasks only")
    logs.add_argument("--rank", type=int, help="one task of the role (with --role)")
    logs.add_argument("--attempt", type=int, help="an earlier attempt (0 = first start; default: the latest)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    logs.set_defaults(func=cmd_logs)

    join = commands.add_parser("join", help="add generator engines to a running Slurm run, as a job of their own")
    join.add_argument("run_dir", type=Path, help="the run directory (run.dir) of a running run")
    join.add_argument("--nodes", type=int, required=True, help="nodes of engines (cluster.generators.ntasks_per_node each)")
    join.add_argument("--time", dest="time_limit", metavar="TIME", help="the join job's time limit (default: cluster.time); its "
                      "engines leave the run when it ends")
    join.add_argument("--partition", help="the join job's partition (default: the generators')")
    join.set_defaults(func=cmd_join)

    cancel = commands.add_parser("cancel", help="stop a run's Slurm job (all components)")
    cancel.add_argument("run_dir", type=Path, help="the run directory (run.dir)")
    cancel.set_defaults(func=cmd_cancel)

    plot = commands.add_parser("plot", help="draw reward, accuracy, KL and timing curves to a PNG")
    plot.add_argument("run_dir", type=Path, help="the run directory (run.dir)")
    plot.add_argument("-o", "--output", type=Path, required=True, help="image file to write, e.g. run.png")
    plot.set_defaults(func=cmd_plot)

    render = commands.add_parser("render", help="prepare the run directory and write the sbatch script")
    _config_arguments(render)
    render.add_argument("-o", "--output", type=Path, help="script path (default: RUN_DIR/slurm/job.sbatch)")
    render.set_defaults(func=cmd_render)

    evaluate = commands.add_parser("eval", help="avg@k / pass@k / maj@k of a policy of a run, on each of its eval sets")
    evaluate.add_argument("target", type=Path, metavar="CONFIG_OR_RUN_DIR", help="a run directory or a YAML config")
    evaluate.add_argument("--checkpoint", default="latest", help="base, latest (default) or step_N")
    evaluate.add_argument("--k", type=int, help="samples per problem of every eval set (default: each set's k, eval.k)")
    evaluate.add_argument("--problems", type=int, help="problems of every eval set to evaluate (default: each set's, eval.problems)")
    evaluate.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                          help="override a key of a CONFIG (not of a run directory's config)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.add_argument("--verbose", action="store_true",
                          help="show vLLM's output (default: kept in a log file, printed only if the evaluation fails)")
    add_where_arguments(evaluate)
    evaluate.set_defaults(func=cmd_eval)

    samples.add_parser(commands)
    check_model.add_parser(commands)
    export.add_parser(commands)

    bench = commands.add_parser("bench", help="measure a data plane against its raw reference")
    kinds = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    handoff = kinds.add_parser("handoff", help="rollout shards through the store vs raw file write+fsync+read")
    handoff.add_argument("--dir", help="directory to measure in (default: here; use your run directory's filesystem)")
    handoff.add_argument("--repeats", type=int, default=9)
    weights = kinds.add_parser("weights", help="weight-sync broadcast vs one contiguous broadcast (gloo or NCCL)")
    weights.add_argument("--mb", type=int, default=256, help="size of the model-like tensor set")
    weights.add_argument("--receivers", type=int, default=2, help="generator-like receiving processes")
    weights.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                         help="nccl: process r on GPU r, so receivers + 1 GPUs (default: gloo on CPU)")
    step = kinds.add_parser("step", help="our RL step (demo job) vs TRL's GRPOTrainer, same model and shape")
    step.add_argument("--steps", type=int, default=14)
    generate = kinds.add_parser("generate", help="vLLM generation tokens/s vs HF generate, same model and prompts")
    moe = kinds.add_parser("moe", help="trainer memory and step time: NVFP4-packed routed experts vs bf16, same MoE")
    for sub in (handoff, weights, step, generate, moe):
        sub.add_argument("--json", action="store_true", help="print one JSON object")
        sub.set_defaults(func=cmd_bench)

    quantize.add_parser(commands)
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
        from ..launch.preflight import preflight

        notes = preflight(config)  # reads only: what submit would refuse, --dry-run refuses too
        print(_summary(config, notes), file=sys.stderr)
        sys.stdout.write(script)
        return 0
    return launch(config, script, args.wait, by="rltools submit")


def _summary(config, notes: list[str]) -> str:
    """The job's topology and memory estimate, then preflight's notes: what it could not check from here, the
    data format it inferred, the first prompt as the model will see it."""
    return "\n".join([describe(config, plan(config)), *(f"note: {note}" for note in notes)])


def cmd_resume(args) -> int:
    from ..launch.run_dir import RESUMABLE, may_change, recorded_run_dir
    from ..monitor.status import open_run

    paths = open_run(args.run_dir)
    others = [o for o in args.overrides if not may_change(o.partition("=")[0].strip(), RESUMABLE)]
    if others:
        raise UserError(f"resume cannot change {others}: those keys made the run's checkpoints, rollouts or "
                        f"evaluations; start a new run (another run.dir) to change them. A resume may change: "
                        f"{', '.join(f'{key}.*' if '.' not in key else key for key in RESUMABLE)}")
    # The run continues where its directory is now: a moved or copied run must not run in the old place.
    before = load_config(paths.config, [f"run.dir={paths.root}"])
    config = load_config(paths.config, [*args.overrides, f"run.dir={paths.root}"])
    recorded = recorded_run_dir(paths)
    if recorded is not None and recorded.resolve() != paths.root:
        print(f"note: {paths.root} was moved or copied from {recorded} (its config's run.dir); the run continues "
              f"in {paths.root}", file=sys.stderr)
    done = paths.latest_checkpoint()
    if config.schedule.steps < done:
        raise UserError(f"schedule.steps {config.schedule.steps} is below the {done} steps {paths.checkpoint_dir(done)} "
                        f"holds: a run cannot be shortened past its latest checkpoint (set schedule.steps >= {done})")
    if done >= config.schedule.steps:
        print(f"{paths.root} is complete: its checkpoint holds all {done} steps; extend it with "
              f"--set schedule.steps=N (N > {done})", file=sys.stderr)
        return 0
    if config.schedule.steps != before.schedule.steps:
        print(f"note: {_length_note(before, config, done)}", file=sys.stderr)
    print(f"resuming {paths.root}: its latest checkpoint holds {done} of {config.schedule.steps} steps (the trainers "
          "check it before they load it, and say which one they loaded)" if done else
          f"no checkpoint in {paths.root}: starting from step 0", file=sys.stderr)
    return launch(config, render_sbatch(config), args.wait, by="rltools resume", may_change=RESUMABLE)


def _length_note(before, config, done: int) -> str:
    """What a new schedule.steps does to the run, the learning rate's schedule included."""
    from ..config.lr_schedule import rate_at

    old, new = before.schedule.steps, config.schedule.steps
    text = f"schedule.steps {old} -> {new}"
    algorithm = config.algorithm
    if algorithm.lr_schedule == "constant":
        return text
    update = done * algorithm.mini_batches
    return (f"{text}: the {algorithm.lr_schedule} learning-rate schedule is re-derived over {new} steps from step "
            f"{done} on: its rate there is {rate_at(algorithm, new, update):.3g} ({rate_at(algorithm, old, update):.3g} "
            f"over {old} steps)")


def launch(config, script: str, wait: bool, by: str, may_change: tuple[str, ...] = ()) -> int:
    """Check what the job will read, lock and prepare its run directory, and run the job with its
    launcher (its trainers resume from the latest checkpoint there, if any)."""
    from ..launch.preflight import preflight
    from ..launch.run_dir import create_run_dir
    from ..launch.run_lock import RunLock
    from ..launch.run_lock import describe as describe_holder
    from ..launch.slurm import refuse_if_active

    notes = preflight(config)
    local = config.cluster.launcher == "local"
    paths = create_run_dir(config)
    with RunLock.acquire(paths, by=f"{by} (local launcher)" if local else f"{by} (submitting)") as lock:
        if lock.previous:
            print(f"note: {describe_holder(lock.previous)} ended without releasing {paths.lock_file}; taking it over",
                  file=sys.stderr)
        refuse_if_active(paths)  # a requeued Slurm job between attempts holds no lock but owns the run
        prepare_run_dir(config, script, may_change)
        print(_summary(config, notes), file=sys.stderr)
        if local:
            from ..launch.local import run_local
            from ..monitor.progress import Progress

            return run_local(config, paths, lock, Progress(config, paths))  # built before the children start
    return _submit_to_slurm(config, paths, wait)  # the job script holds the lock while the job runs


def _submit_to_slurm(config, paths, wait: bool) -> int:
    from ..jobs.common import run_submitted
    from ..launch.slurm import submit_job
    from ..monitor.progress import Progress
    from ..monitor.status import format_status, wait_for_end

    progress = Progress(config, paths) if wait else None  # before the job: all it writes is new
    job = submit_job(config, paths, run_submitted)
    print(f"submitted job {job.job_id}; follow it with: rltools status {paths.root}  |  rltools logs {paths.root} -f",
          file=sys.stderr)
    if not wait:
        return 0
    status = wait_for_end(paths, progress=progress)
    progress.update()
    progress.finish()
    print(format_status(status), file=sys.stderr)
    return 0 if status.state == "COMPLETED" else 1


def cmd_render(args) -> int:
    from ..launch.preflight import preflight
    from ..launch.run_dir import create_run_dir
    from ..launch.run_lock import RunLock

    config = load_config(args.config, args.overrides)
    script = render_sbatch(config)
    notes = preflight(config)
    with RunLock.acquire(create_run_dir(config), by="rltools render"):  # never rewrite a running job's files
        paths = prepare_run_dir(config, script)
    target = args.output or paths.sbatch_script
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(script)
    print(_summary(config, notes), file=sys.stderr)
    print(f"wrote {target}; submit it with: sbatch {target}", file=sys.stderr)
    return 0


def cmd_status(args) -> int:
    import json

    from ..monitor.status import format_status, open_run, run_status

    status = run_status(open_run(args.run_dir))
    print(json.dumps(status.to_json()) if args.json else format_status(status))
    return 0


def cmd_logs(args) -> int:
    from ..monitor.logs import show_logs
    from ..monitor.status import open_run

    if args.rank is not None and args.role is None:
        raise UserError("--rank needs --role (generator or trainer): both roles have a rank 0")
    try:
        show_logs(open_run(args.run_dir), args.role, args.rank, args.follow, args.attempt)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_join(args) -> int:
    from ..jobs.common import run_submitted
    from ..launch.join import join_logs, join_run
    from ..monitor.status import open_run

    paths = open_run(args.run_dir)
    join = join_run(paths, args.nodes, run_submitted, time_limit=args.time_limit, partition=args.partition)
    last = join.first_engine + join.engines - 1
    print(f"submitted join job {join.job_id}: generator engine(s) {join.first_engine}"
          + (f"-{last}" if last > join.first_engine else "") + f" join {paths.root} at its next weight sync; "
          f"`rltools status {paths.root}` lists them, `scancel {join.job_id}` takes them out again; "
          f"their logs: {join_logs(paths, join.first_engine)}", file=sys.stderr)
    return 0


def cmd_cancel(args) -> int:
    from ..launch.slurm import ACTIVE, cancel_job
    from ..monitor.status import open_run, wait_for_end

    paths = open_run(args.run_dir)
    if not paths.job_id_file.exists():
        raise UserError(f"{paths.root} has no Slurm job (no {paths.job_id_file}); a local run stops with Ctrl-C")
    job_id = paths.job_id_file.read_text().strip()
    cancel_job(job_id)
    status = wait_for_end(paths, timeout_s=120)
    print(f"job {job_id}: {status.state} at step {status.step}/{status.total_steps}")
    return 0 if status.state not in ACTIVE else 1


def cmd_plot(args) -> int:
    from ..monitor.status import open_run
    from ..plot import plot_run

    plot_run(open_run(args.run_dir), args.output)
    print(f"wrote {args.output}")
    return 0


def cmd_bench(args) -> int:
    import json

    if args.kind == "handoff":
        from ..bench.handoff import run_handoff_bench

        result = run_handoff_bench(repeats=args.repeats, directory=args.dir)
        summary = (
            f"hand-off of {result['shard_mb']} MB shards: ours {result['ours_mb_s']} MB/s, raw files "
            f"{result['reference_mb_s']} MB/s, ratio {result['ratio']}; p50 visible {result['p50_visible_s']} s"
        )
    elif args.kind == "step":
        from ..bench.step import run_step_bench

        result = run_step_bench(steps=args.steps)
        summary = (
            f"RL step ({result['shape']}): ours {result['ours_s']} s, TRL GRPOTrainer {result['reference_s']} s, "
            f"ratio {result['ratio']}"
        )
    elif args.kind == "generate":
        from ..bench.generate import run_generate_bench

        result = run_generate_bench()
        summary = (
            f"generation: vLLM {result['ours_tokens_s']} tokens/s, HF generate {result['reference_tokens_s']} "
            f"tokens/s, ratio {result['ratio']}"
        )
    elif args.kind == "moe":
        from ..bench.moe import run_moe_bench

        result = run_moe_bench()
        summary = (
            f"MoE trainer ({result['model']}): routed experts {result['experts_mb']['nvfp4']} MB NVFP4 vs "
            f"{result['experts_mb']['bf16']} MB bf16 (ratio {result['experts_ratio']}); weights + saved for backward "
            f"ratio {result['footprint_ratio']}; step {result['step_s']['nvfp4']} s vs {result['step_s']['bf16']} s "
            f"(ratio {result['step_ratio']})"
        )
    else:
        from ..bench.weights import run_weights_bench

        result = run_weights_bench(total_mb=args.mb, receivers=args.receivers, backend=args.backend)
        summary = (
            f"weight broadcast ({result['backend']}) of {result['total_mb']} MB to {result['receivers']} receivers: "
            f"ours {result['ours_gb_s']} GB/s, one contiguous buffer {result['reference_gb_s']} GB/s, "
            f"ratio {result['ratio']}"
        )
    print(json.dumps(result) if args.json else summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
