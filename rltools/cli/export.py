"""`rltools export`: a trainer checkpoint of a run as a PEFT adapter or a merged Hugging Face model,
checked with vLLM, written here or by a Slurm job on one generator's resources.

Invariants:
- Light at import, like the rest of the command line. Everything that can be refused from the run
  directory alone (an unknown step, no checkpoint, an existing output, an adapter vLLM could not
  serve for the check, no torch or vLLM here) is refused before any work or any job.
- The check runs where vLLM runs: in this process with --local (the default of a local run), in the
  job with --slurm (the default of a Slurm run: a login node may have neither vLLM nor the GPUs the
  model needs). --no-verify writes the export unchecked, and needs torch only.
- stdout carries the result only; the progress bar and vLLM's output (kept in a log file unless
  --verbose, shown when the check fails) go to stderr.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ..config import load_config
from ..errors import UserError
from ..export.write import FORMATS, QUANTIZE
from .eval import add_where_arguments

EXAMPLES = """examples:
  rltools export runs/demo --format merged                      # latest checkpoint -> runs/demo/exports/step_N-merged
  rltools export runs/demo --checkpoint step_40 --format adapter -o /models/demo-step40-lora
  rltools export runs/aime --format merged --quantize nvfp4     # merged, then NVFP4 as `rltools quantize` writes it
"""


def add_parser(commands) -> None:
    export = commands.add_parser(
        "export", help="a trainer checkpoint as a PEFT adapter or a merged Hugging Face model, checked with vLLM",
        description="Write a trainer checkpoint of a run as a PEFT adapter or a merged Hugging Face model.\nvLLM "
        "loads it and must score the run's probe sequence as the trainer did before it is put in place.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory (run.dir)")
    export.add_argument("--checkpoint", default="latest", help="latest (default) or step_N: a trainer checkpoint "
                        "in RUN_DIR/checkpoints")
    export.add_argument("--format", required=True, choices=FORMATS,
                        help="adapter: a PEFT adapter (adapter_config.json, adapter_model.safetensors) over the base "
                        "model; merged: a complete Hugging Face model with the adapters merged into the base weights")
    export.add_argument("-o", "--output", type=Path, help="output directory (default: RUN_DIR/exports/step_N-FORMAT)")
    export.add_argument("--force", action="store_true", help="replace an existing non-empty output directory")
    export.add_argument("--quantize", choices=QUANTIZE, help="merged only: convert the merged model to NVFP4 as "
                        "`rltools quantize --format` does")
    export.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the check that vLLM, loading the export, scores the run's probe sequence as the "
                        "trainer did (it needs vLLM and the model's GPUs)")
    export.add_argument("--shard-gb", type=float, default=1.0, help="merged: safetensors shard size in GB (default 1); "
                        "memory holds about one shard")
    export.add_argument("--quiet", action="store_true", help="no progress bar")
    export.add_argument("--json", action="store_true", help="print the export's summary as one JSON object")
    export.add_argument("--verbose", action="store_true", help="show vLLM's output during the check")
    add_where_arguments(export)
    export.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from ..export.write import default_name, refuse_overwrite
    from ..monitor.status import open_run
    from ..policy_exports import resolve_checkpoint

    paths = open_run(args.run_dir)
    config = load_config(paths.config)
    policy = resolve_checkpoint(paths, args.checkpoint, exports=False)
    if policy.kind == "base":
        raise UserError(f"--checkpoint {args.checkpoint} is the base model ({config.model.path}) itself: nothing to "
                        "export; name a trainer checkpoint (latest or step_N)")
    check_request(config, args)
    output = args.output or paths.export_dir(default_name(policy, args.format, args.quantize))
    refuse_overwrite(output, args.force)
    if args.verify:
        from ..export.serve import trainer_probe

        trainer_probe(paths, policy)  # the check needs it: refused now rather than after the export is written
    request = dict(force=args.force, verify=args.verify, quantize=args.quantize, shard_bytes=int(args.shard_gb * 1e9))
    step = f"step_{policy.step}"  # what `latest` meant now: a trainer still running may write a newer one
    if (args.where or config.cluster.launcher) == "slurm":
        result = _export_on_slurm(config, paths, step, args.format, output, request)
    else:
        result = _export_here(config, paths, step, args.format, output, request, args)
    print(json.dumps(result) if args.json else describe(result))
    return 0


def check_request(config, args) -> None:
    """What makes the export impossible or its check fail, known from the config alone."""
    if args.shard_gb <= 0:
        raise UserError(f"--shard-gb must be > 0, got {args.shard_gb}")
    if args.format == "adapter" and not config.lora.enabled:
        raise UserError("--format adapter: the run trained every weight (lora.enabled: false); there is no adapter to "
                        "export: use --format merged")
    if args.quantize and args.format != "merged":
        raise UserError("--quantize applies to --format merged (an adapter holds no base weights to quantise)")
    if args.verify and args.format == "adapter":
        from ..launch.preflight import adapter_unservable, check_model_dir

        reasons = adapter_unservable(config, check_model_dir(Path(config.model.path)))
        if reasons:
            raise UserError(f"the check of an adapter export loads it with vLLM's LoRA support on the run's generators, "
                            f"which cannot serve this run's adapters: {'; '.join(reasons)}. Check the merged model instead "
                            "(--format merged), or write the adapter unchecked (--no-verify; peft loads it)")


def _export_here(config, paths, checkpoint: str, fmt: str, output: Path, request: dict, args) -> dict:
    from .eval import _output_to_log

    _require("torch", "writes the export with torch")
    if args.verify:
        _require("vllm", "checks the export with vLLM")
    from ..jobs.export import run_export

    print(f"exporting {checkpoint} of {paths.root} as {fmt} to {output} ...", file=sys.stderr, flush=True)
    engine_output = contextlib.nullcontext if args.verbose else _output_to_log
    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout; stdout carries the result only
        return run_export(config, paths, checkpoint, fmt, output, progress=not args.quiet, engine_output=engine_output,
                          **request)


def _export_on_slurm(config, paths, checkpoint: str, fmt: str, output: Path, request: dict) -> dict:
    from ..jobs.export import run_export
    from ..launch.slurm import submit_task
    from .eval import wait_for

    job = submit_task(config, paths, "export", run_export, config, paths, checkpoint, fmt, output, progress=False,
                      **request)
    print(f"submitted export job {job.job_id} (log: {job.paths.stdout}); waiting for it", file=sys.stderr)
    return wait_for(job, "export")


def _require(module: str, why: str) -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        raise UserError(f"`rltools export` {why}, which is not installed here (a login node?): run it as a Slurm job "
                        "on one generator's resources with --slurm" + (", or write the export unchecked with --no-verify"
                                                                        if module == "vllm" else ""))


def describe(result: dict) -> str:
    """The export on a few lines: what, where, how big, its check, and how to load it."""
    size = f"{result['bytes'] / 2**20:.1f} MiB"
    what = {"adapter": "PEFT adapter", "merged": "merged Hugging Face model"}[result["format"]]
    quantized = f", quantised to {result['quantization']}" if result.get("quantization") else ""
    dequantized = f", NVFP4 base dequantised to {result['dtype']}" if result.get("dequantized") else ""
    lines = [f"wrote {result['output']}: {what} of {result['checkpoint']} ({result['tensors']} tensors, {size}"
             f"{dequantized}{quantized})"]
    check = result.get("verified")
    lines.append("not checked (--no-verify)" if check is None else
                 f"checked with vLLM: probe logprob gap {check['logprob_gap']:.3g} (largest token {check['max_token_gap']:.3g})"
                 f" to the trainer's, limit generator.max_logprob_gap {check['limit']:g}")
    out = result["output"]
    if result["format"] == "adapter":
        lines.append(f"load it over {result['base_model']}: PeftModel.from_pretrained(base, '{out}') (peft), or "
                     f"vllm serve {result['base_model']} --enable-lora --lora-modules policy={out}")
    else:
        lines.append(f"load it as any Hugging Face model: AutoModelForCausalLM.from_pretrained('{out}'), or vllm serve {out}")
    return "\n".join(lines)
