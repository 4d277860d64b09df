"""What a run that lost generator engines must still have trained: each step exactly its own
prompts, each group whole, as an uninterrupted run trains them (a slot's prompts and group ids
depend only on the seed, the step and the slot: `runtime.roles`)."""

import numpy as np

from rltools.config import load_config
from rltools.paths import RunPaths
from rltools.rollout.shard import read_shard
from rltools.runtime.roles import group_id, slots


def assert_each_step_trained_its_own_prompts(run_dir, steps: int) -> None:
    """Needs every step's shards (schedule.keep_rollout_steps >= steps)."""
    paths = RunPaths(run_dir)
    config = load_config(paths.config)
    schedule, run_id = config.schedule, paths.read_run_id()
    for step in range(steps):
        ids = np.concatenate([read_shard(paths.rollout_shard(step, slot), run_id=run_id, step=step, rank=slot).group_ids
                              for slot in range(slots(config))])
        expected = [group_id(config, step, i) for i in range(schedule.prompts_per_step)]
        groups, counts = np.unique(ids, return_counts=True)
        assert groups.tolist() == expected and set(counts.tolist()) == {schedule.group_size}, (step, ids)
