"""Run the demo job once per algorithm setting, same seed and steps, and print one table: held-out
avg@8 before and after (with its standard error), the gain, and the wall time.

    python scripts/compare_algorithms.py                    # every row below, 900 steps each (~30 min)
    python scripts/compare_algorithms.py --steps 300 --only grpo gspo
    python scripts/compare_algorithms.py --out /tmp/compare  # keep the run directories there

Each row is `rltools submit configs/demo.yaml` with the overrides shown (the demo itself is
dr_grpo with max_staleness 1). Rows run one after another on this machine, so their wall times
compare. One run per row: differences within about two standard errors are noise.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = {
    "grpo": ["algorithm.type=grpo"],
    "dr_grpo": ["algorithm.type=dr_grpo"],
    "dapo": ["algorithm.type=dapo"],
    "dapo + dynamic sampling": ["algorithm.type=dapo", "algorithm.dynamic_sampling=true"],
    "gspo": ["algorithm.type=gspo", "algorithm.mini_batches=4"],
    "cispo": ["algorithm.type=cispo"],
    "dr_grpo staleness 0": ["algorithm.type=dr_grpo", "schedule.max_staleness=0"],
    "dr_grpo staleness 2": ["algorithm.type=dr_grpo", "schedule.max_staleness=2", "algorithm.tis_cap=2.0"],
}


def run(name: str, overrides: list[str], steps: int, directory: Path, timeout_s: float) -> dict:
    run_dir = directory / name.replace(" ", "-")
    sets = [w for o in [*overrides, f"schedule.steps={steps}", f"run.dir={run_dir}"] for w in ("--set", o)]
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "rltools", "submit", str(REPO / "configs" / "demo.yaml"), *sets],
                                capture_output=True, text=True, cwd=REPO, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{name}: no result after {timeout_s:.0f} s (--timeout); its run directory: {run_dir}") from None
    wall = time.monotonic() - start
    if result.returncode != 0:
        raise SystemExit(f"{name}: rltools submit failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    return {"name": name, "overrides": " ".join(overrides), "before": first["avg_at_k"], "before_se": first["stderr"],
            "after": last["avg_at_k"], "after_se": last["stderr"], "steps": last["step"], "wall_s": wall}


def table(rows: list[dict]) -> str:
    lines = ["| setting | overrides | held-out avg@8 before | after | gain (points) | wall |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | `{r['overrides']}` | {r['before']:.3f} ± {r['before_se']:.3f} | "
                     f"{r['after']:.3f} ± {r['after_se']:.3f} | {100 * (r['after'] - r['before']):+.1f} | "
                     f"{r['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=900, help="steps per run (default: the demo's 900)")
    parser.add_argument("--only", nargs="+", choices=list(ROWS), metavar="ROW", help=f"rows to run: {', '.join(ROWS)}")
    parser.add_argument("--out", type=Path, help="directory for the run directories (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take (default 1800)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rltools-compare-") as tmp:
        directory = args.out or Path(tmp)
        rows = []
        for name in args.only or ROWS:
            print(f"running {name} ({args.steps} steps) ...", file=sys.stderr, flush=True)
            rows.append(run(name, ROWS[name], args.steps, directory, args.timeout))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
