"""The live display of a run while a launcher waits on it, and the one format of a step's line.

Invariant: a step's line is formatted by `step_line` alone, for the live display and for
`rltools status` alike, so both say the same thing the same way.
"""

import datetime
import os
import sys
from collections import deque

from ..config.schema import HELD_OUT, RLConfig
from ..paths import RunPaths
from ..records import eval_files, parse_records, read_evals, read_json, set_results


class Progress:
    """One line per step (a redrawn bar on a terminal): step, reward, accuracy, tokens/s, timings.

    Invariant: it shows what the job it follows writes, each step and evaluation once. What the run
    directory held when it was created is history and is not shown again; a metrics.jsonl that a
    resume rewrites (a new, shorter file) is read again from its start, skipping lines already
    known, so a resume never replays the steps it discards. A line it cannot parse is skipped: the
    display must never stop the run it follows.
    """

    def __init__(self, config: RLConfig, paths: RunPaths, quiet: bool = False):
        self.paths, self.steps, self.quiet = paths, config.schedule.steps, quiet
        self.tty = sys.stderr.isatty()
        self.inode, self.offset, self.printed = None, 0, False
        self.recent = deque(maxlen=20)  # (step, time) of the latest records: the ETA's pace
        self.known = {_record_key(m) for m in self._new_records()}  # history
        self.shown_evals = dict(eval_files(paths))  # step -> mtime of the result file, history too
        self.resumed = _mtime(paths.resumed)  # the trainers' record of what they loaded, history too

    def update(self) -> None:
        lines = []  # (steps done, is an eval, text): an eval after k steps prints right after step k
        for m in self._new_records():
            if _record_key(m) in self.known:
                continue
            self.known.add(_record_key(m))
            self.recent.append((m["step"], m.get("time")))
            lines.append((m["step"] + 1, False,
                          step_line(m["step"] + 1, self.steps, m, timings=True, eta_s=eta(list(self.recent), self.steps))))
        for step, mtime in eval_files(self.paths).items():
            if self.shown_evals.get(step) != mtime:
                self.shown_evals[step] = mtime
                result = read_json(self.paths.eval_result(step))
                if result:
                    lines.append((step, True, eval_line(step, result)))
        resumed = self._resumed()
        if self.quiet:
            return
        if resumed:
            _print(("\n" if self.tty and self.printed else "") + resumed)
        for _, is_eval, text in sorted(lines, key=lambda item: item[:2]):
            if is_eval:
                _print(("\n" if self.tty else "") + text)
            else:
                _print(("\r" + text) if self.tty else text, end="" if self.tty else "\n")
            self.printed = True

    def _resumed(self) -> str | None:
        """A line for a start whose trainers resumed from a checkpoint, once they decided which."""
        mtime = _mtime(self.paths.resumed)
        if mtime == self.resumed:
            return None
        self.resumed = mtime
        record = read_json(self.paths.resumed)
        if not record or not (record["step"] or record["set_aside"]):
            return None  # a fresh start: nothing to say
        line = (f"the trainers resumed from the checkpoint after {record['step']} steps" if record["step"]
                else "the trainers start from step 0: no checkpoint passed its checks")
        return line + "".join(f"\n  set aside: {note}" for note in record["set_aside"])

    def finish(self) -> None:
        if self.quiet:
            return
        evals = read_evals(self.paths)
        if 0 in evals and self.steps in evals:
            before, after = set_results(evals[0]), set_results(evals[self.steps])
            for name in (n for n in after if n in before):
                a, b = before[name]["avg_at_k"], after[name]["avg_at_k"]
                _print(f"\n{_label(name)} avg@{after[name]['k']}: {a:.3f} before -> {b:.3f} after {self.steps} steps "
                       f"({100 * (b - a):+.1f} points)")
        _print(f"run directory: {self.paths.root}")

    def _new_records(self) -> list[dict]:
        """Records appended since the last poll; all of them again after the file was replaced."""
        try:
            with open(self.paths.metrics, "rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self.inode or stat.st_size < self.offset:  # new, or a resume rewrote it
                    if self.printed and self.inode is not None:
                        _print(f"\n(the job restarted from its checkpoint after {self.paths.latest_checkpoint()} steps)")
                    self.inode, self.offset = stat.st_ino, 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        return parse_records(complete.decode(errors="replace"))


def _mtime(path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def _record_key(record: dict) -> tuple:
    return record["step"], record.get("time")


def eta(recent: list[tuple[int, float | None]], total: int) -> float | None:
    """Seconds to the last step at the pace of `recent` (step, time) records (the latest last)."""
    timed = [(step, t) for step, t in recent if t is not None]
    if len(timed) < 2 or timed[-1][0] <= timed[0][0]:
        return None
    per_step = (timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0])
    return max(0.0, (total - timed[-1][0] - 1) * per_step)


def step_line(done: int, total: int, m: dict | None = None, timings: bool = False, eta_s: float | None = None) -> str:
    """`step done/total [bar]`, then the step's reward, accuracy and KL when there is a record `m` (and
    how many of its samples' reward calls failed, if any), then its throughput and timings with
    `timings` (the live display has them; a status may not), then the time left when `eta_s` is known."""
    bar = ("=" * int(20 * done / total)).ljust(20)
    line = f"step {done}/{total} [{bar}]"
    if m:
        line += f" reward {m['reward_mean']:.3f} acc {m['accuracy']:.3f} kl {m.get('kl', 0):.4f}"
        if m.get("reward_failures"):  # calls of the reward that failed and scored 0 (reward.max_failure_fraction)
            line += f" | reward failures {m['reward_failures']}/{m.get('samples', '?')}"
        if "tool_call_rate" in m:  # multi-turn: how often the policy calls its tools, and how often they fail
            line += f" tools {m['tool_call_rate']:.2f} (errors {m['tool_error_rate']:.2f})"
        if m.get("engines", 1) != 1 or m.get("reassigned_samples"):  # a fleet: how many engines generate
            line += f" | engines {m['engines']}" + (f" ({m['reassigned_samples']} samples for a lost one)"
                                                     if m.get("reassigned_samples") else "")
        if timings:
            line += (f" | {m['gen_tokens_per_s']:.0f} tok/s | gen {m['generation_s']:.2f}s "
                     f"train {m['training_s']:.2f}s sync {m['sync_s']:.2f}s")
            if m.get("sync_wait_s", 0) >= 0.1:  # the generators were busy (rank 0 evaluating)
                line += f" (+{m['sync_wait_s']:.1f}s generators busy)"
    if eta_s is not None and done < total:
        line += f" | eta {datetime.timedelta(seconds=round(eta_s))}"
    return line


def eval_line(step: int, result: dict) -> str:
    """One line per eval set: avg@k +- stderr, problems, maj@k where the verifier extracts answers."""
    lines = []
    for name, s in set_results(result).items():
        where = "" if name == HELD_OUT else f", {name}"
        majority = f", maj@{s['k']} {s['maj_at_k']:.3f}" if "maj_at_k" in s else ""
        cut = f" of {s['problems_available']}" if s.get("problems_available", 0) > s["n_problems"] else ""
        lines.append(f"eval after {step} steps{where}: avg@{s['k']} {s['avg_at_k']:.3f} (+- {s['stderr']:.3f}, "
                     f"{s['n_problems']}{cut} problems{majority})")
    return "\n".join(lines)


def _label(name: str) -> str:
    return "held-out" if name == HELD_OUT else name


def _print(text: str, end: str = "\n") -> None:
    try:
        print(text, end=end, file=sys.stderr, flush=True)
    except OSError:  # a closed terminal: the run goes on
        pass
