"""The local launcher: the same job as the Slurm one, as processes on this machine.

Invariant: the children are started exactly as `srun` would start them (same entry modules, same
run directory, RoleEnv's local variables instead of SLURM_*), and they never outlive the launcher:
a failing child, Ctrl-C or a finished run stops them all.
"""

import json
import os
import signal
import subprocess
import sys
import time

from ..config.schema import RLConfig
from ..paths import RunPaths
from .plan import plan
from .role_env import RoleEnv

STOP_GRACE_S = 10.0


def run_local(config: RLConfig, paths: RunPaths, attempt: int = 0, quiet: bool = False) -> int:
    children = start_children(config, paths, attempt)
    progress = Progress(config, paths, quiet)
    try:
        while True:
            progress.update()
            failed = [c for c in children if c["proc"].poll() not in (None, 0)]
            if failed:
                stop(children)
                child = failed[0]
                print(f"\n{child['name']} failed (exit {child['proc'].returncode}); its log {child['log']}:", file=sys.stderr)
                print(_tail(child["log"]), file=sys.stderr)
                return 1
            if all(c["proc"].poll() == 0 for c in children):
                progress.update()
                progress.finish()
                return 0
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping generator and trainer processes", file=sys.stderr)
        stop(children)
        return 130


def start_children(config: RLConfig, paths: RunPaths, attempt: int) -> list[dict]:
    children = []
    for component in plan(config):
        ntasks = component.resources.ntasks
        for rank in range(ntasks):
            log = paths.task_log(attempt, component.role, rank)
            log.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **config.cluster.environment, **RoleEnv.local_environ(component.role, rank, ntasks, attempt)}
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    [config.cluster.python, "-m", component.entry, str(paths.root)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C reaches the launcher only; it stops the children
                )
            children.append({"name": f"{component.role} {rank}", "proc": proc, "log": log})
    return children


def stop(children: list[dict]) -> None:
    for child in children:
        if child["proc"].poll() is None:
            os.killpg(child["proc"].pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child["proc"].wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(child["proc"].pid, signal.SIGKILL)
            child["proc"].wait()


class Progress:
    """One line per step (a redrawn bar on a terminal): step, reward, accuracy, tokens/s, timings."""

    def __init__(self, config: RLConfig, paths: RunPaths, quiet: bool = False):
        self.paths, self.steps, self.k, self.quiet = paths, config.schedule.steps, config.eval.k, quiet
        self.offset = 0
        self.evals: dict[int, dict] = {}  # eval results read so far, by step
        self.tty = sys.stderr.isatty()

    def update(self) -> None:
        if self.quiet:
            return
        for line in self._new_metrics():
            m = json.loads(line)
            done = m["step"] + 1
            bar = ("=" * int(20 * done / self.steps)).ljust(20)
            text = (
                f"step {done}/{self.steps} [{bar}] reward {m['reward_mean']:.3f} acc {m['accuracy']:.3f} "
                f"kl {m.get('kl', 0):.4f} | {m['gen_tokens_per_s']:.0f} tok/s | gen {m['generation_s']:.2f}s "
                f"train {m['training_s']:.2f}s sync {m['sync_s']:.2f}s"
            )
            print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", file=sys.stderr, flush=True)
        for step, result in self._new_evals():
            prefix = "\n" if self.tty else ""
            print(f"{prefix}eval after {step} steps: avg@{result['k']} {result['avg_at_k']:.3f} "
                  f"(+- {result['stderr']:.3f}, {result['n_problems']} problems)", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.quiet:
            return
        evals = self.evals  # complete: run_local calls update() once more before finish()
        if 0 in evals and self.steps in evals:
            before, after = evals[0]["avg_at_k"], evals[self.steps]["avg_at_k"]
            print(f"\nheld-out avg@{self.k}: {before:.3f} before -> {after:.3f} after {self.steps} steps "
                  f"({100 * (after - before):+.1f} points)", file=sys.stderr)
        print(f"run directory: {self.paths.root}", file=sys.stderr)

    def _new_metrics(self) -> list[str]:
        try:
            with open(self.paths.metrics) as f:
                f.seek(self.offset)
                text = f.read()
        except FileNotFoundError:
            return []
        complete = text[: text.rfind("\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        return complete.splitlines()

    def _new_evals(self) -> list[tuple[int, dict]]:
        """Eval results that appeared since the last poll (each file is read once)."""
        found = []
        for path in self.paths.eval_dir.glob("step_*.json") if self.paths.eval_dir.is_dir() else ():
            step = int(path.stem.split("_")[1])
            if step not in self.evals:
                self.evals[step] = json.loads(path.read_text())
                found.append((step, self.evals[step]))
        return sorted(found, key=lambda item: item[0])


def _tail(path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
