"""`python -m rltools.sandbox FILE.py`: run one file in a sandbox, print one JSON line.

The line has stdout, stderr, exit_code, timed_out, truncated and wall_s; the command itself exits 0
whatever the program did (its exit code is in the line), 2 when the node cannot run a sandbox.
`python -m rltools.sandbox --bench` prints the start-up cost a warm sandbox saves.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from rltools.errors import UserError

from .pool import SandboxPool
from .sandbox import Limits, run_code


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rltools.sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="the Python file to run; - reads it from stdin")
    parser.add_argument("--bench", action="store_true", help="measure cold and warm sandbox latency")
    parser.add_argument("--python", default=sys.executable, help="the interpreter inside the sandbox")
    for field in dataclasses.fields(Limits):
        parser.add_argument("--" + field.name.replace("_", "-"), type=field.type, default=field.default,
                            help=f"default {field.default}")
    args = parser.parse_args(argv)
    if (args.file is None) == (not args.bench):
        parser.error("give FILE.py or --bench")
    return args


def bench(limits: Limits, python: str, calls: int = 10) -> dict:
    """Median and worst latency of `print(1)`: a fresh sandbox each call vs one from a warm pool.

    The warm calls are spaced 0.3 s apart so each replacement has booted: the pool's regime, where
    calls come less often than a sandbox starts. Back to back, a call may wait for a booting one.
    """
    cold = [_timed(lambda: run_code("print(1)", limits, python)) for _ in range(calls)]
    with SandboxPool(2, limits, python) as pool:
        warm = []
        for _ in range(calls):
            time.sleep(0.3)
            warm.append(_timed(lambda: pool.run("print(1)")))
    summary = {"calls": calls}
    for name, times in (("cold", cold), ("warm", warm)):
        summary[f"{name}_median_ms"] = round(1000 * statistics.median(times), 1)
        summary[f"{name}_max_ms"] = round(1000 * max(times), 1)
    return summary


def _timed(call) -> float:
    start = time.perf_counter()
    result = call()
    assert result.stdout == "1\n", result
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limits = Limits(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Limits)})
    try:
        if args.bench:
            print(json.dumps(bench(limits, args.python)))
        else:
            source = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
            print(json.dumps(run_code(source, limits, args.python).to_json()))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return UserError.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
