"""A run's state (`rltools status`, `submit --wait`, `cancel`), read from its directory and Slurm's queue.

Invariant: `run_status` needs no accounting database and no launcher: Slurm's word comes from
`launch.slurm.job_state` (squeue, then sacct), a local run's from its lock, and when neither knows,
the exit files of the latest attempt decide; those files also name the component that failed first.
Every wait here ends, with or without a deadline.
"""

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..config import load_config
from ..config.schema import HELD_OUT
from ..errors import UserError
from ..launch.run_lock import is_held
from ..launch.slurm import ACTIVE, job_state
from ..paths import ROLES, RunPaths
from ..runtime.fleet import LEFT, FleetRecord, joined_engines
from ..runtime.preempt import EXIT_STOPPED
from .logs import failing_log_tail
from .progress import eta, step_line
from ..records import read_evals, read_json, read_metrics, set_results

COMPONENT_OF = {"generator": "generators", "trainer": "trainers", "judge": "judges"}
UNSEEN_S = 120.0  # a submitted job squeue has not shown by then is not going to appear


@dataclass
class RunStatus:
    """Where a run stands. The fields, in this order, are the keys of `rltools status --json`."""

    run_dir: str
    """The run directory, resolved."""
    name: str
    """The run's `run.name`."""
    launcher: str
    """The run's `cluster.launcher`: "slurm" or "local"."""
    job_id: str | None
    """The Slurm job id the run directory records; None for a run that was never submitted to Slurm."""
    state: str
    """Slurm's word for the job (PENDING, RUNNING, COMPLETED, FAILED, ...); RUNNING for a live local
    launcher; STOPPED for a trainer that stopped at a checkpoint on a signal (resumable); UNKNOWN
    when neither Slurm, the run's lock nor the exit files tell."""
    components: dict[str, dict[str, str]]
    """Slurm's view of each hetjob component: {"generators": {"state", "nodes", "reason"}, ...};
    empty when Slurm does not know the job (or there is none)."""
    restarts: int
    """The latest attempt's number: 0 for a run that never restarted or resumed."""
    step: int
    """Steps done, by metrics.jsonl."""
    total_steps: int
    """The run's `schedule.steps`."""
    last_metrics: dict | None
    """The last complete record of metrics.jsonl; None before the first step."""
    eta_s: float | None
    """Seconds left at the pace of the last 20 steps; None with fewer than two timed steps."""
    eval_k: int
    """The k of the headline avg@k (the first eval set's)."""
    evals: dict[int, float]
    """The headline avg@k (the first eval set's) by the steps done when it was measured, oldest first."""
    checkpoint: int
    """Steps done by the latest valid checkpoint; 0 when there is none."""
    staleness: dict[int, int] = dataclasses.field(default_factory=dict)
    """How many steps trained on rollouts k policy versions old, by k (schedule.max_staleness bounds k)."""
    reward_failures: dict[int, int] = dataclasses.field(default_factory=dict)
    """Samples whose reward call failed (timed out, raised, returned no number) and scored 0, by step;
    steps without any are left out."""
    engines: dict | None = None
    """The generator fleet (fleet.json): {"configured", "live": [engine, ...], "events": [{"event":
    "lost", "engine", "step", "why", "time"}, ...], "pool": `engine_pool`}; None before trainer rank 0
    formed it."""
    resumed: dict | None = None
    """What the trainers of the latest start loaded: {"step", "set_aside": [notes], "time"}."""
    failed_component: str | None = None
    """The component whose role failed first ("generators" or "trainers"), when the run failed."""
    log_tail: str | None = None
    """The end of that component's task log that shows the error."""
    eval_sets: dict[str, dict] = dataclasses.field(default_factory=dict)
    """Every eval set, in config order: {name: {"k", "avg_at_k": {step: value}, "stderr": {step: value},
    "maj_at_k": {step: value} (verifiers that extract answers)}}."""

    def to_json(self) -> dict:
        """The plain dict that `rltools status --json` prints."""
        return dataclasses.asdict(self)


def open_run(run_dir: str | Path) -> RunPaths:
    paths = RunPaths(Path(run_dir).resolve())
    if not paths.config.is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml): pass the run.dir of a submitted run")
    return paths


def run_status(paths: RunPaths) -> RunStatus:
    """Where a run stands, from its directory, Slurm's queue and its latest attempt's exit files."""
    config = load_config(paths.config)
    job_id = paths.job_id_file.read_text().strip() if paths.job_id_file.exists() else None
    attempts = paths.attempts()
    metrics = read_metrics(paths)
    status = RunStatus(
        run_dir=str(paths.root),
        name=config.run.name,
        launcher=config.cluster.launcher,
        job_id=job_id,
        state="UNKNOWN",
        components={},
        restarts=attempts[-1] if attempts else 0,
        step=metrics[-1]["step"] + 1 if metrics else 0,
        total_steps=config.schedule.steps,
        last_metrics=metrics[-1] if metrics else None,
        eta_s=eta([(m["step"], m.get("time")) for m in metrics[-20:]], config.schedule.steps),
        eval_k=config.eval.k,
        evals={},
        checkpoint=paths.latest_checkpoint(),
        staleness=dict(sorted(Counter(m["staleness"] for m in metrics if "staleness" in m).items())),
        reward_failures={m["step"]: m["reward_failures"] for m in metrics if m.get("reward_failures")},
    )
    _read_eval_sets(status, read_evals(paths))
    status.resumed = read_json(paths.resumed)
    fleet = FleetRecord.read(paths)
    if fleet is not None:
        status.engines = {"configured": config.cluster.generators.ntasks, "live": fleet.live, "events": fleet.events,
                          "pool": engine_pool(fleet, joined_engines(paths), config.cluster.generators.ntasks)}
    if job_id:
        job = job_state(job_id)
        status.state, status.components = job["state"], job["components"]
    elif is_held(paths):  # the local launcher (and its roles) hold the run's lock while they run
        status.state = "RUNNING"
    if attempts:
        _read_exits(status, paths, attempts[-1])
    return status


def _read_eval_sets(status: RunStatus, evals: dict[int, dict]) -> None:
    for step, result in evals.items():
        for name, summary in set_results(result).items():
            entry = status.eval_sets.setdefault(name, {"k": summary["k"], "avg_at_k": {}, "stderr": {}})
            entry["k"] = summary["k"]
            entry["avg_at_k"][step], entry["stderr"][step] = summary["avg_at_k"], summary["stderr"]
            if "maj_at_k" in summary:
                entry.setdefault("maj_at_k", {})[step] = summary["maj_at_k"]
    if status.eval_sets:
        first = next(iter(status.eval_sets.values()))
        status.eval_k, status.evals = first["k"], dict(first["avg_at_k"])


def engine_pool(fleet: FleetRecord, joined: dict[int, dict], configured: int) -> list[dict]:
    """One entry per engine the run has had: live or not, where, since which step, samples delivered,
    restarts (a configured engine's starts after its first), the join job it came with."""
    engines = sorted({*range(configured), *fleet.live, *(e["engine"] for e in fleet.events)})
    pool = []
    for engine in engines:
        events = [e for e in fleet.events if e["engine"] == engine]
        arrivals = [e for e in events if e["event"] == "joined"]
        last = events[-1] if events else None
        why = last.get("why", "") if last and engine not in fleet.live else ""
        state = "live" if engine in fleet.live else "left" if why.startswith(LEFT) else "lost"
        pool.append({"engine": engine, "state": state, **({"why": why} if why else {}), "node": fleet.where.get(str(engine), {}).get("node"),
                     "since_step": arrivals[-1]["step"] if arrivals else 0,
                     "samples": fleet.delivered.get(str(engine), 0),
                     "restarts": len(arrivals) if engine < configured else 0,
                     **({"join_job": joined[engine].get("job_id")} if engine in joined else {})})
    return pool


def _read_exits(status: RunStatus, paths: RunPaths, attempt: int) -> None:
    """What the attempt's exit files add: the end of a job Slurm has forgotten, a stop at a
    checkpoint, and the component that failed first (the first exit file written with a failure)."""
    exits = _exit_codes(paths, attempt)
    if status.state == "UNKNOWN" and exits:  # the job left the queue and there is no accounting
        # the trainers' end is the run's: engines lost on the way fail their component, not the run
        status.state = "COMPLETED" if exits.get("trainer") == 0 and "generator" in exits else "FAILED"
    # on a signal, at a checkpoint: resumable; unless the generators refused their input (UserError's exit 2:
    # a broken reward) and the trainers were stopped for it. Generators killed at a time limit exit otherwise.
    refused = exits.get("generator") == UserError.exit_code
    if status.state not in ACTIVE and exits.get("trainer") == EXIT_STOPPED and not refused:
        status.state = "STOPPED"
    if status.state not in ACTIVE and status.state not in ("COMPLETED", "STOPPED"):
        failed = [role for role, code in sorted(exits.items(), key=lambda item: _mtime(paths, attempt, item[0]))
                  if code not in (0, EXIT_STOPPED)] or [role for role, code in exits.items() if code]
        if failed:
            status.failed_component = COMPONENT_OF[failed[0]]
            status.log_tail = failing_log_tail(paths, attempt, failed[0])


def format_status(status: RunStatus) -> str:
    job = f"job {status.job_id}" if status.job_id else f"{status.launcher} launcher"
    lines = [f"{status.name}  {job}  {status.state}  restarts {status.restarts}  ({status.run_dir})"]
    for name, component in status.components.items():
        where = component["nodes"] or component["reason"]
        lines.append(f"  {name:<11} {component['state']:<11} {where}")
    lines.append(step_line(status.step, status.total_steps, status.last_metrics,
                           eta_s=status.eta_s if status.state in ACTIVE else None))
    if status.engines and (len(status.engines["pool"]) > 1 or status.engines["events"]):
        engines = status.engines
        ended = {"lost": [], "left": []}
        for e in engines["events"]:
            if e["event"] == "lost":
                why = e.get("why", "")
                ended["left" if why.startswith(LEFT) else "lost"].append(
                    f"generator {e['engine']} at step {e['step']}" + ("" if why.startswith(LEFT) else f" ({why})"))
        joined = len(engines["pool"]) - engines["configured"]
        lines.append(f"generator engines: {len(engines['live'])} live ({engines['configured']} configured"
                     + (f", {joined} joined" if joined else "") + ")"
                     + "".join(f"; {kind}: {', '.join(names)}" for kind, names in ended.items() if names))
        for e in engines["pool"]:
            came = f"join job {e['join_job']}" if "join_job" in e else f"restarts {e['restarts']}"
            lines.append(f"  engine {e['engine']:<3} {e['state']:<5} on {e['node'] or '?':<10} since step "
                         f"{e['since_step']:<5} {e['samples']:>7} samples  {came}")
    if status.checkpoint:
        lines.append(f"checkpoint after {status.checkpoint} steps")
    if status.resumed and status.resumed["set_aside"]:
        lines.append(f"its latest start resumed from the checkpoint after {status.resumed['step']} steps; set aside: "
                     + "; ".join(status.resumed["set_aside"]))
    if any(status.staleness):  # some step trained on rollouts of an older policy
        lines.append("steps trained on rollouts k versions behind: " +
                     ", ".join(f"k={k} {n}" for k, n in status.staleness.items()))
    if status.reward_failures:
        failed = status.reward_failures
        lines.append(f"reward calls that failed and scored 0: {sum(failed.values())} samples in {len(failed)} step(s), "
                     f"the latest in step {max(failed) + 1}/{status.total_steps} (the generator's log says why)")
    if status.state not in ACTIVE | {"UNKNOWN", "COMPLETED"}:
        lines.append(f"continue with: rltools resume {status.run_dir}")
    for name, entry in status.eval_sets.items():
        label = "held-out" if name == HELD_OUT else f"eval {name}"
        majority = entry.get("maj_at_k", {})
        lines.append(f"{label} avg@{entry['k']}: " + ", ".join(
            f"step {s} {v:.3f}" + (f" (maj {majority[s]:.3f})" if s in majority else "")
            for s, v in sorted(entry["avg_at_k"].items())))
    if status.failed_component:
        lines.append(f"the {status.failed_component} component failed first; the end of its log:")
        lines.append(status.log_tail)
    return "\n".join(lines)


def wait_for_end(paths: RunPaths, timeout_s: float | None = None, progress=None) -> RunStatus:
    """Poll the run until its job is no longer active; `progress.update()` on each poll.

    Without `timeout_s` it still ends: a job that squeue forgets before its end is known (UNKNOWN after
    it was seen, or never seen within UNSEEN_S of the first poll) is reported as it stands."""
    start = time.monotonic()
    seen = False
    while True:
        if progress is not None:
            progress.update()
        status = run_status(paths)
        if status.state not in ACTIVE and status.state != "UNKNOWN":
            return status
        seen = seen or status.state in ACTIVE
        waited = time.monotonic() - start
        if status.state == "UNKNOWN" and (seen or waited > UNSEEN_S):
            return status
        if timeout_s is not None and waited > timeout_s:
            return status
        time.sleep(2.0)


def _exit_codes(paths: RunPaths, attempt: int) -> dict[str, int]:
    codes = {}
    for role in ROLES:
        path = paths.component_exit(attempt, role)
        if path.exists():
            codes[role] = int(path.read_text().strip() or 1)
    return codes


def _mtime(paths: RunPaths, attempt: int, role: str) -> float:
    return paths.component_exit(attempt, role).stat().st_mtime
