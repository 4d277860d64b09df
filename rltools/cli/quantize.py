"""`rltools quantize MODEL_DIR -o OUT`: a Hugging Face checkpoint converted to NVFP4 (compressed-tensors),
tensor by tensor (rltools/quant/nvfp4_checkpoint.py). Light at import, like the rest of the command line."""

from pathlib import Path

from ..errors import UserError


def add_parser(commands) -> None:
    quant = commands.add_parser("quantize", help="convert a Hugging Face checkpoint to NVFP4 (compressed-tensors)")
    quant.add_argument("model_dir", type=Path, help="Hugging Face model directory (safetensors, bf16/fp16/fp32)")
    quant.add_argument("-o", "--output", type=Path, required=True, help="new output directory")
    quant.add_argument("--format", choices=["nvfp4", "nvfp4-experts-fp8"], default="nvfp4",
                       help="nvfp4: every eligible linear NVFP4 (default); nvfp4-experts-fp8: a MoE's routed experts "
                       "NVFP4, its other linears FP8, as the public NVFP4 MoE checkpoints are laid out")
    quant.add_argument(
        "--ignore", action="append", default=[], metavar="PATTERN",
        help="keep matching linear layers in high precision: a module name or re:REGEX (repeatable); "
        "embeddings, lm_head, norms and routers are always kept",
    )
    quant.add_argument("--shard-gb", type=float, default=1.0, help="output shard size in GB (default 1)")
    quant.add_argument("--quiet", action="store_true", help="no progress bar")
    quant.set_defaults(func=cmd_quantize)


def cmd_quantize(args) -> int:
    if not (args.model_dir / "config.json").exists():
        raise UserError(f"{args.model_dir}: not a Hugging Face model directory (no config.json)")
    from ..quant.nvfp4_checkpoint import quantize_checkpoint

    try:
        summary = quantize_checkpoint(
            args.model_dir, args.output, ignore=args.ignore, shard_bytes=int(args.shard_gb * 1e9), progress=not args.quiet,
            fp8_outside_experts=args.format == "nvfp4-experts-fp8",
        )
    except ValueError as err:
        raise UserError(str(err)) from err
    for line in summary.lines():
        print(line)
    print(f"wrote {args.output}")
    return 0
