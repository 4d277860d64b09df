"""`rltools bench handoff`: rollout hand-off throughput against raw file I/O of the same bytes.

Each repetition writes one realistic shard through the RolloutStore and reads it back, and writes
+ fsyncs + renames + reads the same number of bytes as a raw file in the same directory; the order
alternates so drift on a noisy disk hits both. A separate reader process polls the store like a
trainer and records when each shard became visible.
"""

import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..durable import atomic_path, fsync_path
from ..paths import RunPaths
from ..rollout import FinishReason, RolloutBatch, RolloutStore


def realistic_batch(rng: np.random.Generator, prompts: int = 64, group: int = 8) -> RolloutBatch:
    """prompts x group samples, 100-300 prompt tokens, 1-4k completion tokens (a math-RL step)."""
    n = prompts * group
    prompt_lens = np.repeat(rng.integers(100, 300, prompts), group)
    completion_lens = rng.integers(1000, 4000, n)

    def ragged(lengths, values):
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return values(int(offsets[-1])), offsets

    prompt_ids, prompt_offsets = ragged(prompt_lens, lambda k: rng.integers(0, 150_000, k, dtype=np.int32))
    completion_ids, completion_offsets = ragged(completion_lens, lambda k: rng.integers(0, 150_000, k, dtype=np.int32))
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_offsets=prompt_offsets,
        completion_ids=completion_ids,
        completion_offsets=completion_offsets,
        completion_logprobs=-rng.random(len(completion_ids), dtype=np.float32),
        rewards=rng.integers(0, 2, n).astype(np.float32),
        group_ids=np.repeat(np.arange(prompts, dtype=np.int64), group),
        sample_indices=np.tile(np.arange(group, dtype=np.int32), prompts),
        finish_reasons=np.full(n, FinishReason.STOP, dtype=np.uint8),
        policy_version=1,
    )


def _raw_round_trip(directory: Path, payload: list[np.ndarray]) -> None:
    """The shard writer's operations on raw bytes: write, fsync and rename (atomic_path), then the
    directory fsync, then read back."""
    final = directory / "raw.bin"
    with atomic_path(final) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for array in payload:
                os.write(fd, memoryview(array).cast("B"))
        finally:
            os.close(fd)
    fsync_path(directory)
    with open(final, "rb") as f:
        f.read()


def _reader(root: str, run_id: str, steps: int, out: mp.Queue) -> None:
    store = RolloutStore(RunPaths(root), run_id)
    for step in range(steps):
        store.wait(step, [0], timeout_s=120)
        out.put((step, time.time()))


def run_handoff_bench(repeats: int = 9, directory: str | None = None, prompts: int = 64, group: int = 8) -> dict:
    work = Path(tempfile.mkdtemp(prefix=".rltools-bench-", dir=directory or os.getcwd()))
    try:
        paths = RunPaths(work / "run")
        paths.create()
        store = RolloutStore(paths, paths.read_run_id())
        batch = realistic_batch(np.random.default_rng(0), prompts, group)
        payload = list(batch.arrays.values())
        nbytes = sum(a.nbytes for a in payload)
        visible = mp.get_context("spawn").Queue()
        reader = mp.get_context("spawn").Process(target=_reader, args=(str(paths.root), store.run_id, repeats, visible))
        reader.start()
        time.sleep(1.0)  # let the reader start polling before the first shard
        ours, reference, started = [], [], []
        for step in range(repeats):
            for which in ("ours", "reference") if step % 2 == 0 else ("reference", "ours"):
                t0 = time.perf_counter()
                if which == "ours":
                    started.append(time.time())
                    store.write(step, 0, batch)
                    store.read(step, 0)
                    ours.append(time.perf_counter() - t0)
                else:
                    _raw_round_trip(work, payload)
                    reference.append(time.perf_counter() - t0)
        seen = dict(visible.get(timeout=120) for _ in range(repeats))
        reader.join(timeout=30)
        ours_mb_s = nbytes / statistics.median(ours) / 1e6
        reference_mb_s = nbytes / statistics.median(reference) / 1e6
        return {
            "ours_mb_s": round(ours_mb_s, 1),
            "reference_mb_s": round(reference_mb_s, 1),
            "ratio": round(ours_mb_s / reference_mb_s, 3),
            "p50_visible_s": round(statistics.median(seen[s] - started[s] for s in range(repeats)), 4),
            "shard_mb": round(nbytes / 1e6, 2),
            "samples": prompts * group,
            "repeats": repeats,
            "directory": str(work.parent),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import json

    print(json.dumps(run_handoff_bench()))
