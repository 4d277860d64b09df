"""A generator-like shard writer for the kill tests: `python rollout_writer.py RUN_DIR MODE`.

MODE loop: write shards of steps 0, 1, 2, ... forever. MODE mid-dataset / before-rename: park the
first write at that point (printing "stalled") so the test can SIGKILL it there.
"""

import os
import sys
import time
import types

import numpy as np

import rltools.durable as durable
import rltools.rollout.shard as shard
from rltools.paths import RunPaths
from rltools.rollout import RolloutStore

sys.path.insert(0, os.path.dirname(__file__))
from test_rollout_store import random_batch  # noqa: E402


def stall_on_call(real, at: int):
    calls = []

    def hook(*args):
        calls.append(1)
        if len(calls) == at:
            print("stalled", flush=True)
            time.sleep(60)
        return real(*args)

    return hook


def main(run_dir: str, mode: str) -> None:
    if mode == "mid-dataset":  # three datasets written, the file still open
        shard._checksum = stall_on_call(shard._checksum, at=3)
    elif mode == "before-rename":  # complete and fsynced, not yet renamed
        durable.os = types.SimpleNamespace(**{**vars(os), "replace": stall_on_call(os.replace, at=1)})
    paths = RunPaths(run_dir)
    store = RolloutStore(paths, paths.read_run_id())
    batch = random_batch(np.random.default_rng(0), n=64, max_len=4000)
    print("ready", flush=True)
    for step in range(10**9):
        store.write(step, 0, batch)


if __name__ == "__main__":
    main(*sys.argv[1:])
