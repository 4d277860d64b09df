import os
import signal
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rltools.paths import RunPaths
from rltools.rollout import FinishReason, RolloutBatch, RolloutStore, RolloutTimeout, Sample, ShardError


def random_batch(rng: np.random.Generator, n: int = 8, max_len: int = 40, version: int = 3, texts: bool = True):
    samples = []
    for i in range(n):
        completion = rng.integers(0, 50_000, rng.integers(0, max_len)).tolist()
        samples.append(
            Sample(
                prompt_ids=rng.integers(0, 50_000, rng.integers(1, max_len)).tolist(),
                completion_ids=completion,
                completion_logprobs=(-rng.random(len(completion))).tolist(),
                reward=float(rng.integers(0, 2)),
                group_id=i // 4,
                sample_index=i % 4,
                finish_reason=FinishReason(int(rng.integers(0, 3))),
                text=f"answer {i} ✓" if texts else None,
            )
        )
    return RolloutBatch.from_samples(samples, policy_version=version)


@pytest.fixture
def store(tmp_path):
    paths = RunPaths(tmp_path / "run")
    paths.create()
    return RolloutStore(paths, paths.read_run_id(), keep_steps=2)


sample_strategy = st.builds(
    lambda prompt, completion, reward, group, index, reason, text: Sample(
        prompt, completion, [-(i % 7) / 3 for i in range(len(completion))], reward, group, index, reason, text
    ),
    st.lists(st.integers(0, 2**31 - 1), max_size=30),
    st.lists(st.integers(0, 2**31 - 1), max_size=30),
    st.floats(-10, 10, width=32),
    st.integers(0, 2**40),
    st.integers(0, 1000),
    st.sampled_from(list(FinishReason)),
    st.text(max_size=20),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(samples=st.lists(sample_strategy, max_size=12), version=st.integers(0, 10**6), step=st.integers(0, 10**5))
def test_round_trip(store, samples, version, step):
    batch = RolloutBatch.from_samples(samples, policy_version=version)
    store.write(step, 0, batch)
    back = store.read(step, 0)
    assert back == batch
    for i, sample in enumerate(samples):
        assert back.prompt(i).tolist() == list(sample.prompt_ids)
        assert back.completion(i).tolist() == list(sample.completion_ids)
        assert np.allclose(back.logprobs(i), sample.completion_logprobs)


def test_batch_checks_its_shape():
    batch = random_batch(np.random.default_rng(0))
    with pytest.raises(ValueError, match="completion_logprobs must align"):
        RolloutBatch(**{**batch.arrays, "completion_logprobs": batch.completion_logprobs[:-1]}, policy_version=0)
    with pytest.raises(ValueError, match="rewards has 3 entries for 8 samples"):
        RolloutBatch(**{**batch.arrays, "rewards": batch.rewards[:3]}, policy_version=0)


def test_concat_keeps_every_sample():
    rng = np.random.default_rng(1)
    parts = [random_batch(rng, n) for n in (3, 0, 5)]
    joined = RolloutBatch.concat(parts)
    assert len(joined) == 8
    flat = [(p.completion(i).tolist(), p.prompt(i).tolist()) for p in parts for i in range(len(p))]
    assert [(joined.completion(i).tolist(), joined.prompt(i).tolist()) for i in range(8)] == flat
    assert joined.slot_sizes == (3, 0, 5)
    # a slot a surviving engine generated after a loss may be of a newer version: the oldest bounds staleness
    mixed = RolloutBatch.concat([random_batch(rng, 2, version=2), random_batch(rng, 2, version=1)])
    assert mixed.policy_version == 1


def routed_batch(rng: np.random.Generator, n: int, layers: int = 2, top_k: int = 2) -> RolloutBatch:
    """A batch whose samples carry the experts each token ran through (routing replay)."""
    batch = random_batch(rng, n)
    samples = [Sample(batch.prompt(i), batch.completion(i), batch.logprobs(i), 0.0, i, 0, FinishReason.STOP,
                      routed_experts=rng.integers(0, 64, (len(batch.prompt(i)) + len(batch.completion(i)) - 1, layers,
                                                          top_k)))
               for i in range(n)]
    return RolloutBatch.from_samples(samples, policy_version=1)


def test_routed_experts_travel_with_their_samples(store):
    """Routing replay: each sample's routes (one row per prompt token and per completion token but the
    last) survive the shard, its checksum and a concat, and a batch whose routes do not fit is refused."""
    rng = np.random.default_rng(2)
    parts = [routed_batch(rng, n) for n in (3, 5)]
    path = store.write(4, 0, parts[0])
    back = store.read(4, 0)
    assert back == parts[0] and back.routed_experts.dtype == np.int16
    assert all(np.array_equal(back.routes(i), parts[0].routes(i)) for i in range(3))
    joined = RolloutBatch.concat(parts)
    assert np.array_equal(joined.routes(4), parts[1].routes(1))
    assert RolloutBatch.concat([parts[0], random_batch(rng, 2, version=1)]).routed_experts is None
    with pytest.raises(ValueError, match="one row per prompt token"):
        RolloutBatch(**parts[0].arrays, policy_version=1, routed_experts=parts[0].routed_experts[1:],
                     routed_offsets=parts[0].routed_offsets - np.minimum(parts[0].routed_offsets, 1))
    with pytest.raises(ValueError, match="come together"):
        RolloutBatch(**parts[0].arrays, policy_version=1, routed_experts=parts[0].routed_experts)
    with h5py.File(path, "r+") as f:
        f["routed_experts"][0, 0, 0] += 1
    with pytest.raises(ShardError, match="dataset routed_experts fails its checksum"):
        store.read(4, 0)


def episode_batch(rng, n: int, version: int = 1) -> RolloutBatch:
    """Multi-turn samples: model tokens, an environment answer, model tokens again."""
    samples = []
    for i in range(n):
        first, answer, last = (int(k) for k in rng.integers(1, 6, 3))
        mask = [1] * first + [0] * answer + [1] * last
        samples.append(Sample([1, 2, 3], rng.integers(0, 99, len(mask)).tolist(),
                              [0.0 if m == 0 else -0.5 for m in mask], 1.0, i // 2, i % 2, FinishReason.STOP,
                              completion_mask=mask, turns=2, tool_calls=1, tool_errors=i % 2))
    return RolloutBatch.from_samples(samples, policy_version=version)


def test_episode_masks_travel_with_their_samples(store):
    """Multi-turn rollouts: which tokens the model wrote survives the shard, its checksums and a concat;
    single-turn batches carry none and mark every token trained."""
    rng = np.random.default_rng(3)
    parts = [episode_batch(rng, n) for n in (3, 4)]
    path = store.write(2, 0, parts[0])
    back = store.read(2, 0)
    assert back == parts[0] and back.completion_mask.dtype == np.uint8
    assert list(back.tool_errors) == [0, 1, 0] and list(back.turns) == [2, 2, 2]
    joined = RolloutBatch.concat(parts)
    assert np.array_equal(joined.trained_mask(5), parts[1].trained_mask(2))
    assert 0 < joined.trained_mask(0).sum() < len(joined.completion(0)), "the environment's tokens are masked"
    single = random_batch(rng, 2, version=1)
    assert single.episodes == {} and single.trained_mask(1).sum() == len(single.completion(1))
    assert RolloutBatch.concat([parts[0], single]).completion_mask is None
    with pytest.raises(ValueError, match="come together"):
        RolloutBatch(**parts[0].arrays, policy_version=1, completion_mask=parts[0].completion_mask)
    with h5py.File(path, "r+") as f:
        f["completion_mask"][0] ^= 1
    with pytest.raises(ShardError, match="dataset completion_mask fails its checksum"):
        store.read(2, 0)


WRITER = os.path.join(os.path.dirname(__file__), "rollout_writer.py")


def start_writer(store, mode):
    writer = subprocess.Popen([sys.executable, WRITER, str(store.paths.root), mode], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "ready"
    return writer


@pytest.mark.parametrize("mode", ["mid-dataset", "before-rename"])
def test_writer_killed_mid_write_leaves_nothing_readable(store, mode):
    writer = start_writer(store, mode)
    assert writer.stdout.readline().strip() == "stalled"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    leftovers = list(store.paths.rollout_step(0).glob("*.tmp"))
    assert len(leftovers) == 1  # the torn file exists, under a temporary name only
    assert store.ready_ranks(0) == set()
    with pytest.raises(RolloutTimeout, match=r"rank\(s\) \[0\]"):
        store.wait(0, [0], timeout_s=0.2)
    batch = random_batch(np.random.default_rng(1))
    store.write(0, 0, batch)  # the restarted rank rewrites its shard and clears the leftover
    assert store.read(0, 0) == batch
    assert not list(store.paths.rollout_step(0).glob("*.tmp"))


def test_writer_killed_at_random_times_leaves_only_whole_shards(store):
    rng = np.random.default_rng(7)
    for _ in range(3):
        writer = start_writer(store, "loop")
        time.sleep(float(rng.uniform(0.1, 0.4)))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    visible = [step for step in store.paths.rollout_steps() if store.ready_ranks(step)]
    assert visible, "the writer never finished a shard"
    for step in visible:
        assert len(store.read(step, 0)) == 64  # every visible shard is whole and passes its checksums


def test_flipped_byte_is_detected_and_named(store):
    batch = random_batch(np.random.default_rng(2), n=16, max_len=200)
    path = store.write(5, 1, batch)
    with h5py.File(path, "r") as f:
        offset = f["completion_ids"].id.get_offset() + f["completion_ids"].nbytes // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ShardError, match=rf"{path}: dataset completion_ids fails its checksum"):
        store.read(5, 1)


def test_foreign_run_is_refused(store, tmp_path):
    other = RolloutStore(store.paths, run_id="someone-else")
    other.write(0, 0, random_batch(np.random.default_rng(3)))
    with pytest.raises(ShardError, match="belongs to run 'someone-else', not this run"):
        store.read(0, 0)


def test_other_schema_version_is_refused(store):
    path = store.write(0, 0, random_batch(np.random.default_rng(3)))
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 99
    with pytest.raises(ShardError, match="rollout schema version 99, this rltools reads version 1"):
        store.read(0, 0)


def test_shard_under_the_wrong_name_is_refused(store):
    path = store.write(0, 0, random_batch(np.random.default_rng(3)))
    os.link(path, store.paths.rollout_shard(0, 1))
    with pytest.raises(ShardError, match="generator_rank is 0, expected 1"):
        store.read(0, 1)


def test_truncated_file_is_refused(store):
    path = store.write(0, 0, random_batch(np.random.default_rng(3)))
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(ShardError, match=f"{path}: not a readable rollout shard"):
        store.read(0, 0)


def test_wait_deadline_names_missing_ranks(store):
    store.write(4, 1, random_batch(np.random.default_rng(4)))
    start = time.monotonic()
    with pytest.raises(RolloutTimeout, match=r"step 4: no shard from generator rank\(s\) \[0, 2\] in .*step_4"):
        store.wait(4, [0, 1, 2], timeout_s=0.5)
    assert time.monotonic() - start < 2.0


def test_wait_returns_shards_as_they_land(store):
    batches = [random_batch(np.random.default_rng(r), version=9) for r in range(2)]
    writer = threading.Timer(0.2, lambda: [store.write(3, r, b) for r, b in enumerate(batches)])
    writer.start()
    assert store.wait(3, [0, 1], timeout_s=10) == batches
    writer.join()


def test_prune_keeps_unconsumed_and_uncheckpointed_steps(store):
    batch = random_batch(np.random.default_rng(5), n=2)
    for step in range(10):
        store.write(step, 0, batch)
    assert store.prune(consumed_through=9, checkpointed_through=5) == [0, 1, 2, 3]
    assert sorted(store.paths.rollout_steps()) == [4, 5, 6, 7, 8, 9]
    assert store.prune(consumed_through=3, checkpointed_through=9) == []
    assert store.prune(consumed_through=9, checkpointed_through=9) == [4, 5, 6, 7]


def test_a_resume_keeps_only_shards_of_versions_the_checkpoint_has(store):
    """Resuming from the checkpoint after 10 steps with max_staleness 1: step k's shard of version v
    stays only if k - 1 <= v <= 10 (later versions were trained on by steps the checkpoint lacks)."""
    rng = np.random.default_rng(0)
    shards = {(9, 0, 8): True,    # before the checkpoint: already trained on, left to retention
              (10, 0, 9): True, (10, 1, 10): True, (11, 0, 10): True,
              (11, 1, 11): False, (12, 0, 11): False, (12, 1, 9): False}
    for (step, rank, version), _ in shards.items():
        store.write(step, rank, random_batch(rng, version=version))
    stray = store.paths.rollout_step(12) / ".gen_3.h5.1234.tmp"
    stray.write_bytes(b"half a shard")

    discarded = store.discard_unusable(resumed_at=10, max_staleness=1)
    assert sorted((int(p.parent.name[5:]), RunPaths.shard_rank(p.name)) for p in discarded) == [(11, 1), (12, 0), (12, 1)]
    for (step, rank, _), kept in shards.items():
        assert store.paths.rollout_shard(step, rank).exists() == kept
    assert not stray.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_resume_deletes_damaged_shards_so_they_are_written_again(store, damage, caplog):
    """A truncated shard crashed the resume itself (a traceback naming no file); a flipped byte was
    kept and then failed the trainer on every resume. Both are now deleted, named, and regenerated."""
    rng = np.random.default_rng(6)
    good = store.write(10, 0, random_batch(rng, version=10))
    bad = store.write(10, 1, random_batch(rng, version=10))
    if damage == "truncate":
        os.truncate(bad, bad.stat().st_size // 2)
    else:
        with h5py.File(bad, "r") as f:
            offset = f["completion_ids"].id.get_offset()
        with open(bad, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level("WARNING", logger="rltools.rollout"):
        assert store.discard_unusable(resumed_at=10, max_staleness=1) == [bad]
    assert good.exists() and not bad.exists()
    assert f"deleted a damaged rollout shard, its generator writes it again: {bad}" in caplog.text
