"""The generator role: sample groups, score them, hand them over as shards; take new weights.

Reads top to bottom. Staleness: step k may be generated with policy version v only while
k - v <= schedule.max_staleness (0 = on-policy; 1 = generate step k+1 while step k trains). Every
broadcast of the trainer is received once, in order, including the final one, after which the
first live engine evaluates the trained policy. Rewards are scored per step in one batch (pooled
verifiers score it in parallel worker processes, each call under reward.timeout_s).

The fleet (`runtime.fleet`): each engine generates the slots of each step that fleet.json assigns
to it, its own slot while it is live, and after the loss of another engine the slots it was given
of every untrained step, including steps it has already passed. When the weight-sync group breaks
(trainer rank 0 lost an engine or one joins) it joins the group's next generation and goes on.
"""

import logging
import os
import time
from pathlib import Path

from ..config import load_config
from ..data.eval_sets import EvalSets, eval_sets
from ..data.tasks import load_tokenizer, make_task
from ..errors import UserError
from ..paths import RunPaths
from ..reward.judge import JudgeLost
from ..rollout import RolloutBatch, RolloutStore, Sample
from ..runtime import faults
from ..runtime.address import published_attempt
from ..runtime.fleet import FleetRecord, Heartbeat
from ..runtime.preempt import before_leaving, generator_signals
from ..runtime.probe import probe_gap, read_probe
from ..runtime.role_env import RoleEnv
from ..runtime.roles import (
    eval_due,
    group_id,
    prompt_share,
    sends_start_policy,
    slots,
    sync_backend,
    sync_rank_base,
    sync_workers,
)
from ..weight_formats import weight_format
from .evaluation import evaluate, record_eval
from .judge import judge_client
from .supervisor import ENGINE, JOINED
from .vllm_engine import GroupBroken, GroupDropped, VLLMEngine, request_seed

log = logging.getLogger("rltools.generator")


def run_generator(run_dir: str) -> int | None:
    env = RoleEnv.from_environ()
    paths = RunPaths(run_dir)
    config = load_config(paths.config)
    generator_signals(config.cluster.preempt_signal)
    task = make_task(config.data, config.reward, config.run.seed, config.model.path, load_tokenizer(config.model.path))
    sets = eval_sets(config.eval, config.data, config.reward, config.generator, task)
    if config.reward.uses_judge:  # eval sets scored by the run's reward share task.reward
        task.reward.connect_judge(judge_client(paths, config, run_attempt(env, paths)))
    try:
        generate(env, paths, config, task, sets)
    except JudgeLost as err:
        log.error("%s; this engine stops (their logs: rltools logs %s --role judge)", err, paths.root)
        return JudgeLost.exit_code
    finally:
        sets.close()
        task.reward.close()


def generate(env: RoleEnv, paths: RunPaths, config, task, sets: EvalSets) -> None:
    engine = VLLMEngine(config.model, config.generator, config.run.seed, weight_format(config),
                        routing_replay=config.algorithm.routing_replay)
    attempt = run_attempt(env, paths)
    engine.join_weight_sync(paths, sync_rank_base(config, env.rank), sync_workers(config), attempt, sync_backend())
    heartbeat = Heartbeat(paths, attempt, env.rank, config.generator.sync_timeout_s,  # trainer rank 0 sees it live
                          where={"node": env.node, "job": env.job_id})
    if env.joined:  # its job ends apart from the run's (time limit, scancel): its slots go to the others at once
        before_leaving(heartbeat.leave)  # (the run's own engines end with the run: no race with its stop)
    if JOINED in os.environ:  # the supervisor restarts an engine only once it got this far
        Path(os.environ[JOINED]).touch()
    store = RolloutStore(paths, paths.read_run_id())
    schedule = config.schedule
    # Joined: trainer rank 0 has resumed (checkpoint loaded, unusable shards deleted) before hosting.
    start = paths.latest_checkpoint()
    sent = sends_start_policy(config, start)  # the checkpoint's policy, or lora.init_from's at step 0
    weights = Weights(engine, sets, config, paths, heartbeat, version=start - 1 if sent else 0)
    # mid-run: a lost engine's replacement (`supervisor`), or an engine of a join job
    arriving = int(os.environ.get(ENGINE, "0")) > 0 or env.joined
    if sent or arriving:  # the checkpoint's (or the run's current) policy, before any sampling
        initial = weights.version
        while weights.version == initial or weights.dirty:  # until one arrived whole (the group may re-form)
            weights.receive(with_eval=not start and not arriving)  # lora.init_from's version 0 is evaluated
    elif engine.writes_files:  # the first engine evaluates
        weights.evaluate()
    if arriving:  # the steps before it had slots are trained already
        record = FleetRecord.read(paths)
        start = max(start, record.assignments[-1][0] if record else 0)
    step = backfill = start  # steps before `backfill` need nothing more from this engine
    assignments = None
    while True:
        if weights.dirty:  # part of a message loaded before the group broke: the resend comes first
            weights.receive()
            continue
        if step < schedule.steps:
            record = FleetRecord.read(paths) or FleetRecord.start(config.cluster.generators.ntasks, slots(config))
            if record.assignments != assignments:  # reassigned from that step on: maybe slots of steps passed
                assignments = record.assignments
                backfill = min(backfill, record.assignments[-1][0])
            todo = work(record, env.rank, backfill, step, paths)
            backfill = todo[0][0] if todo else step
            if not todo:
                step += 1
                continue
            at = todo[0][0]
            if at - weights.version > schedule.max_staleness:
                weights.receive()
                continue
            mine = [slot for when, slot in todo if when == at]
            generate_slots(engine, task, config, store, at, mine, weights.version,
                           covering=[slot for slot in mine if record.home(slot) not in record.live])
            continue
        if weights.version >= schedule.steps:
            break
        weights.receive()  # the trainer's last broadcasts: the final weights


def run_attempt(env: RoleEnv, paths: RunPaths) -> str:
    """The start of the run this engine serves: its own job's, or for a join job's engine (`rltools
    join`) the start of the run that is running."""
    if not env.joined:
        return env.attempt
    attempt = published_attempt(paths.sync_address)
    if attempt is None:
        raise UserError(f"{paths.root} has no running trainer to join (no {paths.sync_address})")
    return attempt


def work(record: FleetRecord, engine: int, since: int, step: int, paths: RunPaths) -> list[tuple[int, int]]:
    """(step, slot) this engine still has to generate, in order: slots of steps `since`..`step` - 1
    a lost engine left to it (those steps are not trained yet: they wait for these), then `step`'s."""
    return [(at, slot) for at in range(since, step + 1) for slot in record.mine(engine, at)
            if not paths.rollout_shard(at, slot).exists()]


def generate_slots(engine: VLLMEngine, task, config, store: RolloutStore, step: int, slots: list[int], version: int,
                   covering: list[int]) -> None:
    """Generate slots `slots` of step `step` (their prompts: `roles.prompt_share`) in one batch of
    requests, and write each slot's shard; `covering`: those whose home engine was lost."""
    faults.point("generator.sample", step)
    schedule = config.schedule
    shares = [list(prompt_share(config, slot)) for slot in slots]
    start = time.perf_counter()
    groups = iter(sample_groups(engine, task, config, step, 0, [i for share in shares for i in share],
                                task.train_problems(step, schedule.prompts_per_step)))
    seconds = time.perf_counter() - start  # each slot's: they were generated together
    for slot, share in zip(slots, shares):
        mine, drawn = [next(groups) for _ in share], len(share)
        if config.algorithm.dynamic_sampling:
            mine, drawn = replace_uniform_groups(engine, task, config, step, share, mine)
        batch = RolloutBatch.from_samples([sample for group in mine for sample in group], policy_version=version,
                                          generation_seconds=seconds, prompts_drawn=drawn)
        store.write(step, slot, batch)
        whose = f" (slot {slot}, for a lost engine)" if slot in covering else f" (slot {slot})" if len(slots) > 1 else ""
        log.info("step %d: %d samples%s, policy version %d, reward %.3f", step, len(batch), whose, version,
                 batch.rewards.mean())


class Weights:
    """This engine's policy version and its weight-sync membership: `receive` loads the next version,
    and when the group broke (trainer rank 0 lost an engine, or one joins) joins its next generation.
    Once the final version is in, the heartbeat stops: trainer rank 0 needs nothing more from this
    engine and closes its store when it is done, maybe long before a final evaluation ends."""

    def __init__(self, engine: VLLMEngine, sets: EvalSets, config, paths: RunPaths, heartbeat: Heartbeat,
                 version: int):
        self.engine, self.sets, self.config, self.paths, self.heartbeat = engine, sets, config, paths, heartbeat
        self.version = version
        self.dirty = False
        """A message broke off after part of it was loaded (full, adapted): sample nothing before the next."""

    def receive(self, with_eval: bool = True) -> None:
        engine = self.engine
        try:
            version, seconds = engine.receive_weights(self.paths, self.version + 1)
        except GroupBroken as err:
            self.dirty = self.dirty or err.dirty
            self._rejoin(err)
            return
        self.dirty, self.version = False, version
        try:
            gap = probe(engine, self.paths, version)
        except GroupBroken as err:  # the version is loaded; only the probe's figure is lost
            self._rejoin(err)
            return
        finally:
            if version >= self.config.schedule.steps:  # the trainer's last collective with this engine is over
                self.heartbeat.stop()
        log.info("policy version %d loaded in %.3f s, logprob gap to the trainer %.2e", version, seconds, gap)
        if with_eval and engine.writes_files and eval_due(self.config, version):  # the first engine evaluates
            self.evaluate()

    def evaluate(self) -> None:
        """Evaluate the served policy (this version) on the eval sets and record the result."""
        faults.point("generator.eval", self.version)
        results, completions = evaluate(self.engine, self.sets, self.config.env, self.config.run.seed)
        record_eval(self.paths, results, self.version, completions)

    def _rejoin(self, err: GroupBroken) -> None:
        log.warning("the weight-sync group broke (%s): joining its next generation", err)
        try:
            generation = self.engine.rejoin_weight_sync()
        except GroupDropped as dropped:
            raise RuntimeError(f"this generator left the run: {dropped}") from None
        log.info("joined weight-sync generation %d", generation)


def sample_groups(engine: VLLMEngine, task, config, step: int, draw: int, share: list[int], problems) -> list[list[Sample]]:
    """One group of schedule.group_size scored samples per prompt index in `share` (indices into
    `problems`); `draw` > 0: a dynamic-sampling round (its own seeds and group ids)."""
    schedule = config.schedule
    groups = engine.sample(
        [problems[i] for i in share],
        n=schedule.group_size,
        seeds=[request_seed(config.run.seed, step, draw * schedule.prompts_per_step + i, schedule.group_size)
               for i in share],
        env=config.env,
    )
    episodes = config.env.type != "single_turn"  # the rollouts carry which tokens the model wrote
    rows = [problems[i] for i, group in zip(share, groups) for _ in group]
    scores = task.reward.score(  # RewardFailing (a UserError) when too many calls failed: the run stops
        [e.last_turn for group in groups for e in group], [row.answer for row in rows], rows)
    scored, first = [], 0  # first: the group's first call in `scores`
    for i, group in zip(share, groups):
        scored.append([e.sample(scores[first + j], group_id(config, step, i, draw), j, multi_turn=episodes,
                                **scores.outcome(first + j)) for j, e in enumerate(group)])
        first += len(group)
    return scored


def replace_uniform_groups(engine: VLLMEngine, task, config, step: int, share: list[int], groups: list[list[Sample]]):
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, sec. 3.2): a group whose samples
    all got the same reward has zero advantage and teaches nothing; draw further rounds of prompts
    (at most algorithm.max_extra_draws, each as many as this rank's share) and keep the first groups
    whose rewards differ. Uniform groups fill what is still missing, so every step has its size.
    Returns (groups, prompts drawn)."""
    def teaches(group: list[Sample]) -> bool:
        return len({sample.reward for sample in group}) > 1

    informative = [g for g in groups if teaches(g)]
    uniform = [g for g in groups if not teaches(g)]
    drawn = len(share)
    for draw in range(1, config.algorithm.max_extra_draws + 1):
        if len(informative) >= len(share):
            break
        problems = task.replacement_problems(step, draw, config.schedule.prompts_per_step)
        informative += [g for g in sample_groups(engine, task, config, step, draw, share, problems) if teaches(g)]
        drawn += len(share)
    kept = (informative + uniform)[: len(share)]
    log.info("step %d: dynamic sampling drew %d prompts for %d groups, %d of them informative", step, drawn,
             len(share), min(len(informative), len(share)))
    return kept, drawn


def probe(engine: VLLMEngine, paths: RunPaths, version: int) -> float:
    """Score the trainer's probe of `version` with the weights just loaded and report the mean gap to
    trainer rank 0, which judges it (`runtime.probe`); returns it (nan: the trainer wrote no probe)."""
    probe = read_probe(paths, version)
    gap = float("nan") if probe is None else probe_gap(probe[1], engine.probe_logprobs(probe[0]))[0]
    engine.report_gap(gap, version)
    return gap
