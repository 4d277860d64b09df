"""The generator role: sample groups, score them, hand them over as shards; take new weights.

Reads top to bottom. Staleness: step k may be generated with policy version v only while
k - v <= schedule.max_staleness (0 = on-policy; 1 = generate step k+1 while step k trains). Every
broadcast of the trainer is received exactly once, in order, including the final one, after which
generator rank 0 evaluates the trained policy.
"""

import json
import logging
import time

import numpy as np

from ..config import load_config
from ..data.tasks import make_task
from ..eval.metrics import summarize
from ..metrics import write_scalars
from ..launch.role_env import RoleEnv
from ..paths import RunPaths
from ..preempt import generator_signals
from ..roles import group_id, prompt_share, sync_backend, sync_rank_base, sync_world_size
from ..rollout import RolloutBatch, RolloutStore, Sample
from .vllm_engine import VLLMEngine, request_seed

log = logging.getLogger("rltools.generator")


def run_generator(run_dir: str) -> None:
    env = RoleEnv.from_environ()
    paths = RunPaths(run_dir)
    config = load_config(paths.config)
    generator_signals(config.cluster.preempt_signal)
    task = make_task(config.data, config.reward, config.run.seed)
    engine = VLLMEngine(config.model, config.generator, config.run.seed, config.lora)
    engine.join_weight_sync(
        paths, sync_rank_base(config, env.rank), sync_world_size(config), env.attempt, sync_backend()
    )
    store = RolloutStore(paths, paths.read_run_id())
    schedule = config.schedule
    # Joined: trainer rank 0 has resumed (checkpoint loaded, unusable shards deleted) before hosting.
    start = paths.latest_checkpoint()
    if start:
        version, seconds = engine.receive_weights(paths, start)  # the checkpoint's policy, before any sampling
        log.info("resumed at step %d: policy version %d loaded in %.3f s", start, version, seconds)
    else:
        version = 0
        if env.rank == 0:
            evaluate(engine, task, config, paths, version)
    for step in range(start, schedule.steps):
        while step - version > schedule.max_staleness:
            version = receive(engine, task, config, paths, env, version)
        if paths.rollout_shard(step, env.rank).exists():
            log.info("step %d: shard kept from before the restart", step)
            continue
        problems = task.train_problems(step, schedule.prompts_per_step)
        share = list(prompt_share(config, env.rank))
        start = time.perf_counter()
        results = engine.sample(
            [problems[i].prompt for i in share],
            n=schedule.group_size,
            seeds=[request_seed(config.run.seed, step, i, schedule.group_size) for i in share],
        )
        samples = [
            Sample(
                prompt_ids=result.prompt_token_ids,
                completion_ids=c.token_ids,
                completion_logprobs=c.logprobs,
                reward=task.reward(c.text, problems[i].answer),
                group_id=group_id(config, step, i),
                sample_index=j,
                finish_reason=c.finish_reason,
                text=c.text,
            )
            for i, result in zip(share, results)
            for j, c in enumerate(result.completions)
        ]
        batch = RolloutBatch.from_samples(samples, policy_version=version, generation_seconds=time.perf_counter() - start)
        store.write(step, env.rank, batch)
        log.info("step %d: %d samples, policy version %d, reward %.3f", step, len(batch), version, batch.rewards.mean())
    while version < schedule.steps:  # the trainer's last broadcasts: the final weights
        version = receive(engine, task, config, paths, env, version)


def receive(engine: VLLMEngine, task, config, paths: RunPaths, env: RoleEnv, version: int) -> int:
    new_version, seconds = engine.receive_weights(paths, version + 1)
    log.info("policy version %d loaded in %.3f s", new_version, seconds)
    every = config.schedule.eval_every
    final = new_version == config.schedule.steps
    if env.rank == 0 and (final or (every and new_version % every == 0)):
        evaluate(engine, task, config, paths, new_version)
    return new_version


def evaluate(engine: VLLMEngine, task, config, paths: RunPaths, version: int) -> dict:
    """avg@k on the held-out problems with the current weights -> eval/step_<version>.json."""
    problems = task.eval_problems(config.eval.problems)
    start = time.perf_counter()
    results = engine.sample(
        [p.prompt for p in problems],
        n=config.eval.k,
        seeds=[request_seed(config.run.seed, -1, i, config.eval.k) for i in range(len(problems))],
    )
    correct = np.array([[task.reward(c.text, p.answer) for c in r.completions] for p, r in zip(problems, results)])
    tokens = np.array([len(c.token_ids) for r in results for c in r.completions])
    summary = {"step": version, **summarize(correct > 0.5, tokens), "seconds": round(time.perf_counter() - start, 2)}
    paths.eval_dir.mkdir(exist_ok=True)
    tmp = paths.eval_result(version).with_suffix(".tmp")
    tmp.write_text(json.dumps(summary))
    tmp.replace(paths.eval_result(version))
    write_scalars(paths, version, summary, prefix="eval")
    log.info("eval at policy version %d: avg@%d %.3f +- %.3f", version, config.eval.k, summary["avg_at_k"], summary["stderr"])
    return summary
