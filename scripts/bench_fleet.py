"""What losing one of two generator engines costs: the demo under the local launcher with two
engines, generator 1's engine killed with SIGKILL when step KILL_AT is done; printed from the same run:

- seconds from the kill to trainer rank 0 declaring the engine lost (generator.heartbeat_timeout_s
  bounds it), to the first step trained without it, and to its replacement rejoining
  (generator.max_engine_restarts) and the first step trained with both again;
- seconds per step with 2 engines (the steps before the kill, the first two left out as warm-up)
  next to 1 engine (the steps between the loss and the rejoin): the reference is the same run's
  own two-engine pace.

    .venv/bin/python scripts/bench_fleet.py [--steps 150] [--kill-at 8] [--heartbeat 5]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def engine_pid(run_dir: Path, rank: int) -> int | None:
    """The engine (not its task's supervisor) of generator `rank`."""
    pids = subprocess.run(["pgrep", "-f", f"rltools.jobs.generator {run_dir}$"], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RLTOOLS_RANK={rank}".encode() in environ and any(v.startswith(b"RLTOOLS_ENGINE_RESTART=") for v in environ):
            return int(pid)
    return None


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--heartbeat", type=float, default=5.0)
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-fleet-")) / "run"
    sets = [f"run.dir={run_dir}", f"schedule.steps={args.steps}", "schedule.eval_every=0", "eval.problems=16",
            "cluster.generators.ntasks_per_node=2", f"generator.heartbeat_timeout_s={args.heartbeat}"]
    launcher = subprocess.Popen([sys.executable, "-m", "rltools", "submit", str(REPO / "configs" / "demo.yaml"),
                                 *[w for s in sets for w in ("--set", s)]], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    while len(metrics(run_dir)) < args.kill_at:
        if launcher.poll() is not None:
            sys.exit(f"the run ended before step {args.kill_at}: see {run_dir}/slurm/logs")
        time.sleep(0.05)
    killed = time.time()
    os.kill(engine_pid(run_dir, 1), 9)
    if launcher.wait(timeout=900) != 0:
        sys.exit(f"the run failed: see {run_dir}/slurm/logs")
    lines = metrics(run_dir)
    events = json.loads((run_dir / "fleet.json").read_text())["events"]
    lost = next(e["time"] for e in events if e["event"] == "lost")
    joined = next((e["time"] for e in events if e["event"] == "joined"), float("inf"))
    first_alone = next(m["time"] for m in lines if m["time"] > lost and m["engines"] == 1)
    times = [m["time"] for m in lines]
    both = [b - a for a, b, m in zip(times, times[1:], lines[1:]) if m["step"] >= 3 and b < killed]
    alone = [b - a for a, b in zip(times, times[1:]) if first_alone < a and b < joined]
    print(f"kill -> engine declared lost: {lost - killed:.1f} s (generator.heartbeat_timeout_s {args.heartbeat:g})")
    print(f"kill -> first step trained without it: {first_alone - killed:.1f} s")
    if joined < float("inf"):
        again = next(m["time"] for m in lines if m["time"] > joined)
        print(f"kill -> its replacement rejoined: {joined - killed:.1f} s; first step trained with both again: "
              f"{again - killed:.1f} s")
    print(f"seconds per step: 2 engines {sum(both) / len(both):.3f} ({len(both)} steps), "
          f"1 engine {sum(alone) / len(alone):.3f} ({len(alone)} steps): ratio {sum(alone) / len(alone) / (sum(both) / len(both)):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
