"""The judge role (`python -m rltools.jobs.judge RUN_DIR`, one task per judge engine), and the generators'
way to it. Only with a reward function of type judge (reward.judge; the wire: rltools/reward/judge.py).

Each judge task loads reward.judge.model into a vLLM engine, answers scoring requests over HTTP on its
node and publishes its address for this attempt in the run directory (`RunPaths.judge_address`); it
serves until the trainers and the generators of its attempt have ended (the job script writes their exit
files: `RunPaths.component_exit`), or SIGTERM (the local launcher's stop, scancel); until it serves,
SIGTERM ends it at once (`runtime.preempt.catch_early`). Slurm's preemption warning does not stop it:
the generators may still score while the trainers checkpoint. A generator finds the engines published
for its attempt anew at each batch, so an engine that starts late is used from then on, and a lost one
is left out.
"""

import logging
import signal
import socket
import threading
import time

from ..config import load_config
from ..paths import RunPaths
from ..reward.judge import JudgeClient, JudgeServer
from ..runtime import faults
from ..runtime.address import publish_address, read_address
from ..runtime.role_env import RoleEnv
from .vllm_engine import JudgeEngine

log = logging.getLogger("rltools.judge")
POLL_S = 1.0


def run_judge(run_dir: str) -> int:
    env = RoleEnv.from_environ()
    paths = RunPaths(run_dir)
    config = load_config(paths.config)
    judge = config.reward.judge
    engine = JudgeEngine(judge, config.run.seed)
    served = {"requests": 0, "prompts": 0}

    def complete(prompts: list[str]) -> list[str]:
        served["requests"] += 1
        faults.point("judge.serve", served["requests"])
        texts = engine.complete(prompts)
        served["prompts"] += len(prompts)
        if served["requests"] in (1, 10, 100) or served["requests"] % 1000 == 0:
            log.info("judge %d: %d request(s), %d prompt(s) answered so far", env.rank, served["requests"],
                     served["prompts"])
        return texts

    host = "127.0.0.1" if env.launcher == "local" else socket.gethostbyname(env.node)
    server = JudgeServer(complete, paths.read_secret(), host)
    paths.judge_address(env.rank).parent.mkdir(exist_ok=True)
    publish_address(paths.judge_address(env.rank), *server.address, env.attempt)
    log.info("judge %d serving %s on %s:%d", env.rank, judge.model, *server.address)
    signal.signal(signal.SIGTERM, _stop)
    attempt = paths.attempts()[-1]  # the directory of this start's logs, made before the tasks started
    ended = [paths.component_exit(attempt, role) for role in ("trainer", "generator")]
    threading.Thread(target=_stop_when, args=(ended, server), daemon=True).start()
    why = "the trainers and generators have ended"
    try:
        server.serve_forever()
    except Stop:
        why = "SIGTERM"
    finally:
        server.close()
    log.info("judge %d stopping (%s): %d request(s), %d prompt(s) answered", env.rank, why, served["requests"],
             served["prompts"])
    return 0


def _stop_when(files: list, server: JudgeServer) -> None:
    """Stop `server` once every file of `files` exists."""
    while not all(file.exists() for file in files):
        time.sleep(POLL_S)
    server.stop()


class Stop(Exception):
    """SIGTERM: the job stops the judge (the run is over, or ends)."""


def _stop(signum, frame) -> None:
    raise Stop()


def judge_client(paths: RunPaths, config, attempt: str) -> JudgeClient:
    """A generator's client of the judge engines of `attempt` (`RoleEnv.attempt`, or the attempt a join job joined)."""
    engines = config.cluster.judges.ntasks

    def find() -> dict[int, tuple[str, int]]:
        found = {engine: read_address(paths.judge_address(engine), attempt) for engine in range(engines)}
        return {engine: address for engine, address in found.items() if address is not None}

    return JudgeClient(find, paths.read_secret(), config.reward.judge.start_timeout_s)
