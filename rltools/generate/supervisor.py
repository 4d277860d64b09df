"""The generator task's supervisor: it runs the engine (vLLM and the sampling loop) as a child
process and starts it again when it dies, so a lost engine is replaced inside the allocation, on
its own node, in its own Slurm task. The new engine joins the weight-sync group at the next weight
sync (`train.fleet`) and takes its slots back from the engines that covered for it.

Invariants: at most generator.max_engine_restarts restarts per task; an engine that ended well
(exit 0), refused its input (exit 2, a UserError), lost every judge engine (exit 4) or died before it
joined the run (vLLM refusing to start, say) is not restarted: it would only fail again;
the engine dies with the supervisor (PR_SET_PDEATHSIG), and a fault planned for the task
(RLTOOLS_FAULT) fires in the first engine only.
"""

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ..reward.judge import JudgeLost

ENGINE = "RLTOOLS_ENGINE_RESTART"
"""Set in the engine process: how many times its task's engine was started before (0: the first)."""
JOINED = "RLTOOLS_ENGINE_JOINED"
"""Set in the engine process: a file it creates once it joined the weight-sync group."""
_PR_SET_PDEATHSIG = 1

log = logging.getLogger("rltools.supervisor")


def supervise(run_dir: str) -> int:
    from ..config import load_config
    from ..paths import RunPaths
    from ..runtime.preempt import before_leaving, generator_signals

    paths = RunPaths(run_dir)
    config = load_config(paths.config)
    generator_signals(config.cluster.preempt_signal)  # SIGTERM ends this process; the engine follows it
    scratch = tempfile.mkdtemp(prefix="rltools-engine-")  # node-local
    before_leaving(lambda: shutil.rmtree(scratch, ignore_errors=True))  # SIGTERM skips the finally below
    try:
        return _run(run_dir, paths, config, Path(scratch) / "joined")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(run_dir: str, paths, config, joined: Path) -> int:
    limit = config.generator.max_engine_restarts
    for restart in range(limit + 1):
        if restart and _trained(paths) >= config.schedule.steps:
            log.info("the engine died after the trainers' last step: nothing left to generate")
            return 0
        env = {**os.environ, ENGINE: str(restart), JOINED: str(joined)}
        if restart:
            env.pop("RLTOOLS_FAULT", None)
        joined.unlink(missing_ok=True)
        engine = subprocess.Popen([sys.executable, "-m", "rltools.jobs.generator", run_dir], env=env,
                                  preexec_fn=_die_with_parent)
        code = _wait(engine, paths, config.schedule.steps, joined if restart else None)
        if code in (0, 2, JudgeLost.exit_code, -signal.SIGTERM):
            return code if code >= 0 else 0
        if not joined.exists():  # vLLM refused to start, say: it would again, each time
            log.error("the engine failed (exit %d) before it joined the run: not restarted", code)
            return 128 - code if code < 0 else code
        if restart < limit:
            log.warning("the engine died (exit %d): starting it again (restart %d of %d, "
                        "generator.max_engine_restarts); it rejoins the run at the next weight sync",
                        code, restart + 1, limit)
    log.error("the engine died (exit %d) and generator.max_engine_restarts (%d) allows no more restarts: this task "
              "gives up; the run goes on with the other engines", code, limit)
    return 128 - code if code < 0 else code  # a signal's death as a shell reports it (SIGKILL: 137)


def _wait(engine: subprocess.Popen, paths, steps: int, joined: Path | None) -> int:
    """The engine's exit code. A replacement (`joined` given) still starting when the trainers finish
    has nothing left to do: it is stopped (it would wait for a trainer that is gone)."""
    while True:
        try:
            return engine.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            if joined is not None and not joined.exists() and _trained(paths) >= steps:
                log.info("the run ended before the restarted engine joined it: stopping it")
                engine.terminate()
                return engine.wait()


def _trained(paths) -> int:
    """Steps done, by metrics.jsonl (a line per step)."""
    try:
        return sum(1 for line in paths.metrics.read_text().splitlines() if line.endswith("}"))
    except FileNotFoundError:
        return 0


def _die_with_parent() -> None:
    """In the engine before exec: SIGTERM when the supervisor dies; and the preemption warning
    ignored until the engine's own handlers are in place (`scancel --signal=USR2` reaches every
    process of the task, and its default action kills an interpreter still starting)."""
    from ..runtime.preempt import CANDIDATES

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    for signum in CANDIDATES:
        signal.signal(signum, signal.SIG_IGN)
