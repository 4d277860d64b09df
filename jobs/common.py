"""What every role entry point does around its loop: logging, one torch thread on CPU, exit codes."""

import logging
import os
import sys


def run_role(role: str, argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m jobs.{role} RUN_DIR", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(name)s: %(message)s", stream=sys.stdout)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from rltools.errors import UserError

    try:
        if role == "generator":
            from rltools.generate.loop import run_generator as loop
        else:
            from rltools.train.loop import run_trainer as loop
        loop(argv[0])
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0
