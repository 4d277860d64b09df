"""`rltools bench step`: our RL step wall time against TRL's GRPOTrainer, side by side.

Both run the same tiny model, prompts per step, group size and max new tokens, on this machine, in
one invocation. Ours is the demo job itself (local launcher: generator and trainer processes,
max_staleness from the demo config), timed from metrics.jsonl; TRL runs as shipped in its own
process (see trl_reference.py). Steady state: the first `warmup` steps of each are dropped.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..config import load_config
from ..launch.local import run_local
from ..launch.run_dir import prepare_run_dir
from ..launch.run_lock import RunLock
from ..launch.sbatch import render_sbatch
from ..monitor.progress import Progress

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def run_step_bench(steps: int = 14, warmup: int = 3, overrides: list[str] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="rltools-bench-step-") as work:
        config = load_config(
            DEMO, [f"run.dir={work}/run", f"schedule.steps={steps}", "eval.problems=8", "schedule.eval_every=0", *overrides]
        )
        paths = prepare_run_dir(config, render_sbatch(config))
        with RunLock.acquire(paths, by="rltools bench step") as lock:
            code = run_local(config, paths, lock, Progress(config, paths, quiet=True))  # before the children start
        if code != 0:
            raise RuntimeError(f"the demo run failed; see {paths.log_dir}")
        times = [json.loads(line)["time"] for line in paths.metrics.read_text().splitlines()]
    ours = statistics.median(b - a for a, b in zip(times[warmup:], times[warmup + 1 :]))
    s, g = config.schedule, config.generator
    reference = _trl_reference(config.model.path, steps, s.prompts_per_step, s.group_size, g.max_new_tokens,
                               config.algorithm.learning_rate, config.run.seed)
    ref_s = statistics.median(reference["step_s"][warmup:])
    return {
        "ours_s": round(ours, 4),
        "reference_s": round(ref_s, 4),
        "ratio": round(ours / ref_s, 3),
        "shape": {"prompts_per_step": s.prompts_per_step, "group_size": s.group_size, "max_new_tokens": g.max_new_tokens},
        "ours_settings": {"lora": config.lora.enabled, "max_staleness": s.max_staleness, "trainer_ranks": 1, "generators": 1},
        "reference_settings": {"trl": _trl_version(), **reference["settings"], "full_finetuning": True},
        "steps_timed": steps - warmup,
    }


def _trl_reference(model, steps, prompts, group, max_tokens, lr, seed) -> dict:
    command = [sys.executable, "-m", "rltools.bench.trl_reference", model, str(steps), str(prompts), str(group),
               str(max_tokens), str(lr), str(seed)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        tail = "\n".join(result.stderr.splitlines()[-15:])
        raise RuntimeError(f"the TRL reference failed (pip install 'rltools[bench]' installs trl):\n{tail}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _trl_version() -> str:
    from importlib.metadata import version

    return version("trl")
