"""Weight sync across real OS processes: trainer rank 0 (sender) and two generator workers (receivers).

Each peer is `sync_peer.py` in its own process, over loopback gloo (NCCL in the gpu test); it writes
what it sent or saw to a JSON file that the test compares.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rltools.paths import RunPaths
from rltools.weight_sync import SyncOptions, WeightSyncError, host_group, join_group
from rltools.weight_sync.channel import ALIGN, plan_pieces
from rltools.weight_sync.admission import _Admissions, _mac
from rltools.weight_sync.rendezvous import SealedStore

from .sync_peer import SMALL, model

HELPER = Path(__file__).with_name("sync_peer.py")
REPO = Path(__file__).resolve().parents[2]
GROUP = "weight-sync group (trainer rank 0 + 2 generator worker(s), backend gloo)"


class Peer:
    def __init__(self, tmp: Path, run: Path, role: str, rank: int, *args: str):
        self.out, self.err = tmp / f"{role}{rank}.json", tmp / f"{role}{rank}.err"
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        command = [sys.executable, str(HELPER), role, str(run), "--rank", str(rank), "--out", str(self.out), *args]
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(command, stdout=err, stderr=err, env=env, cwd=REPO)

    def result(self, timeout: float) -> dict:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.out.stem} did not exit within {timeout} s; its log:\n{self.err.read_text()[-3000:]}")
        assert self.out.exists(), f"{self.out.stem} wrote no result; its log:\n{self.err.read_text()[-3000:]}"
        return json.loads(self.out.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_dir(tmp_path: Path) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.create()
    return paths


def wait_for_file(path: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def held_at_once(tensors: dict, bucket_bytes: int, alone_bytes: int, max_in_flight: int = 2) -> int:
    """The most stream tensors the sender must hold at one time, from its plan alone: tensors produced
    ahead of the one a piece asks for (a big tensor goes before the open bucket of earlier small
    ones) plus the alone pieces still in flight (zero-copy: their broadcast reads the tensor)."""
    specs = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
    produced, ahead, flight, most = 0, set(), deque(), 0
    for nbytes, members in plan_pieces(specs, bucket_bytes, alone_bytes).pieces:
        while len(flight) >= max_in_flight:
            flight.popleft()
        for index, _ in members:
            while produced <= index:
                if specs[produced][3]:  # empty tensors hold no memory
                    ahead.add(produced)
                produced += 1
                most = max(most, len(ahead) + sum(flight))
            ahead.discard(index)
        flight.append(len(members) == 1 and nbytes >= alone_bytes)
        most = max(most, len(ahead) + sum(flight))
    return most


def test_full_and_lora_updates_arrive_bitwise_equal_in_version_order(tmp_path):
    paths = run_dir(tmp_path)
    # A file left by an earlier start (attempt 0, dead port): joiners must wait for attempt 1's.
    paths.sync_address.write_text(json.dumps({"host": "127.0.0.1", "port": 1, "attempt": 0}))
    args = ("--scenario", "roundtrip", "--attempt", "1")
    joiners = [Peer(tmp_path, paths.root, "join", r, *args) for r in (1, 2)]
    time.sleep(0.5)  # joiners start first, so they likely find the stale file before the host replaces it
    host = Peer(tmp_path, paths.root, "host", 0, *args)
    sent = host.result(20)
    assert "setup_error" not in sent, sent
    assert [m["version"] for m in sent["sent"]] == [1, 2, 3, 4]
    assert sent["sent"][0]["pieces"] > 3, "full weights travel in several pieces (alone + buckets)"
    # version 4 was a TensorStream of 45 tensors (43 with bytes): the sender held only those its wire
    # order requires at once (`held_at_once`), plus the last one taken; a list would have held all 43
    most = held_at_once(model(4, "cpu"), **SMALL)
    assert sent["most_alive"] <= most + 1 < 43, (sent["most_alive"], most)
    for joiner in joiners:
        got = joiner.result(20)
        assert not got["errors"] and "setup_error" not in got, got
        assert [(m["version"], m["kind"]) for m in got["received"]] == [(1, "full"), (2, "lora"), (3, "full"), (4, "full")]
        for want, have in zip(sent["sent"], got["received"]):
            assert have["tensors"] == want["tensors"]  # names, dtypes, shapes and sha256 of the bytes
            assert have["pieces"] == want["pieces"]
        dtypes = {spec[0] for spec in got["received"][0]["tensors"].values()}
        assert {"torch.float32", "torch.bfloat16", "torch.float16", "torch.int64"} <= dtypes
        shapes = [spec[1] for spec in got["received"][0]["tensors"].values()]
        assert [] in shapes and [0] in shapes and [3, 0] in shapes
        # Bounded memory: two piece buffers, each the largest piece (the 75 KiB embedding), not the model.
        assert got["buffer_bytes"] == 2 * 300 * 64 * 4


def test_stale_version_is_refused_by_the_sender_and_by_every_receiver(tmp_path):
    paths = run_dir(tmp_path)
    peers = [Peer(tmp_path, paths.root, "host" if r == 0 else "join", r, "--scenario", "stale") for r in range(3)]
    sent, *received = [p.result(20) for p in peers]
    assert "setup_error" not in sent, sent
    assert sent["local"]["type"] == "ValueError" and "version 4" in sent["local"]["message"] and "(5)" in sent["local"]["message"]
    remote = sent["remote"]
    assert remote["type"] == "StaleVersionError", remote
    assert "refused version 3" in remote["message"] and "already applied version 5" in remote["message"]
    for got in received:
        assert [m["version"] for m in got["received"]] == [5, 6], "the group survives a refusal"
        [error] = got["errors"]
        assert error["type"] == "StaleVersionError"
        assert "refused version 3" in error["message"] and "already applied version 5" in error["message"]


def test_a_failing_consumer_is_reported_to_every_side_and_the_group_stays_usable(tmp_path):
    paths = run_dir(tmp_path)
    peers = [Peer(tmp_path, paths.root, "host" if r == 0 else "join", r, "--scenario", "consumer-fails") for r in range(3)]
    sent, healthy, failing = [p.result(20) for p in peers]
    assert sent["error"]["type"] == "WeightSyncError"
    assert "sync rank [2] failed to apply version 1" in sent["error"]["message"], sent
    assert [m["version"] for m in sent["sent"]] == [2]
    # A version that failed on one worker is served by none: the healthy one is told and skips it
    [skipped] = healthy["errors"]
    assert "version 1 failed on generator worker(s) with sync rank [2]" in skipped["message"], skipped
    assert [m["version"] for m in healthy["received"]] == [2]
    [error] = failing["errors"]
    assert "applying version 1 failed" in error["message"] and "engine rejected the shapes" in error["message"]
    assert [m["version"] for m in failing["received"]] == [2], "the next version still arrives"


@pytest.mark.parametrize("failure", ["die-after-header", "die", "stall"])
def test_a_receiver_dying_or_stalling_mid_transfer_fails_the_sender_within_its_timeout(tmp_path, failure):
    timeout = 3.0
    paths = run_dir(tmp_path)
    args = ("--scenario", failure, "--timeout", str(timeout))
    peers = [Peer(tmp_path, paths.root, "host" if r == 0 else "join", r, *args) for r in range(3)]
    try:  # generous: process start-up (torch imports) on a loaded slow host; `elapsed` is what is checked
        sent = peers[0].result(timeout + 60)
        survivor = peers[1].result(timeout + 60)
    finally:
        peers[2].kill()  # the stalled one would wait out its sleep
    assert "setup_error" not in sent, sent
    error = sent["error"]
    assert error["type"] == "WeightSyncError" and GROUP in error["message"], error
    assert "broadcast of version 1 piece" in error["message"] and "timeout 3 s" in error["message"]
    assert error["elapsed"] < timeout + 1.5, error
    if failure != "stall":
        assert peers[2].proc.returncode == 17
    # The other receiver does not hang either: it fails, named, within its timeout.
    [other] = survivor["errors"]
    assert other["type"] == "WeightSyncError" and GROUP in other["message"] and other["elapsed"] < timeout + 1.5, other


def test_a_joiner_without_the_run_secret_is_refused_and_the_group_still_forms(tmp_path):
    paths = run_dir(tmp_path)
    other = RunPaths(tmp_path / "other-run")  # same address, different secret: another run's worker
    other.create()
    host = Peer(tmp_path, paths.root, "host", 0, "--scenario", "intruder")
    wait_for_file(paths.sync_address)
    shutil.copy(paths.sync_address, other.sync_address)
    intruder = Peer(tmp_path / "other-run", other.root, "join", 1, "--scenario", "intruder")
    refused = intruder.result(20)["setup_error"]
    assert refused["type"] == "WeightSyncError"
    assert "trainer rank 0 refused this process (sync rank 1)" in refused["message"]
    assert f"the run secret in {other.secret} does not match" in refused["message"]
    joiners = [Peer(tmp_path, paths.root, "join", r, "--scenario", "intruder") for r in (1, 2)]
    sent = host.result(20)
    assert [m["version"] for m in sent["sent"]] == [1], sent
    assert [[m["version"] for m in j.result(20)["received"]] for j in joiners] == [[1], [1]]
    log = host.err.read_text()
    assert "refused a process claiming generator worker sync rank 1: its proof does not match this run's secret" in log
    assert "admitted generator worker(s) [1, 2]" in log


def test_a_joiner_waits_for_its_own_attempt_and_names_the_file_on_timeout(tmp_path):
    paths = run_dir(tmp_path)
    paths.sync_address.write_text(json.dumps({"host": "127.0.0.1", "port": 1, "attempt": 0}))
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as caught:
        join_group(paths, rank=1, world_size=2, attempt=1, options=SyncOptions(join_timeout_s=1.0))
    assert time.monotonic() - started < 3
    message = str(caught.value)
    assert str(paths.sync_address) in message and "attempt 1" in message and "holds attempt 0" in message


def test_trainer_rank_0_names_the_missing_workers_when_the_join_deadline_passes(tmp_path):
    paths = run_dir(tmp_path)
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as caught:
        host_group(paths, world_size=3, address="127.0.0.1", options=SyncOptions(join_timeout_s=1.0))
    assert time.monotonic() - started < 3
    assert "sync rank [1, 2] did not join trainer rank 0 within 1 s" in str(caught.value)
    assert json.loads(paths.sync_address.read_text())["attempt"] == 0


def test_trainer_rank_0_admits_each_rank_once_and_ignores_replays_and_garbage(caplog):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    secret, nonce = b"s" * 32, "nonce"
    admissions = _Admissions(store, secret, nonce, world_size=3, may_join=lambda rank: rank == 4)

    def join(rank: int, token: str, key: bytes = secret) -> None:
        store.append("joins", f";{rank}:{token}:{_mac(key, 'join', nonce, rank, token).hex()};")

    join(1, "aa")
    join(1, "aa")  # a replay of the same entry must not overwrite its answer
    join(1, "bb")  # a second process started as rank 1
    join(5, "cc")  # a rank the group does not have
    join(2, "dd", key=b"x" * 32)  # another run's secret
    store.append("joins", "garbage")  # no terminator: must not swallow the next join
    join(4, "ff")  # a worker of an engine a join job added (rltools join)
    admissions.poll()
    assert admissions.admitted == {1, 4} and not admissions.complete  # a joined worker is not a configured one
    join(2, "ee")
    admissions.poll()
    assert admissions.admitted == {1, 2, 4} and admissions.complete
    answers = {t: store.get(f"admit/{t}").decode() for t in ("aa", "bb", "cc", "dd", "ee", "ff")}
    assert all(answers[t].startswith("ok:") for t in ("aa", "ee", "ff"))
    assert [answers[t] for t in ("bb", "cc", "dd")] == ["refused:rank-taken", "refused:rank-range", "refused:secret"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "rltools.weight_sync"]
    assert len(warnings) == 4 and any("malformed" in w for w in warnings)


def test_the_group_rendezvous_store_rejects_a_forged_record(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    sealed = SealedStore(store, b"k" * 32, timedelta(seconds=5))
    sealed.set("0/0", b"address of rank 0")
    assert sealed.get("0/0") == b"address of rank 0"
    assert not any("0/0" in key for key in store.list_keys()), "key names must not reveal the group's records"
    forged = b"attacker's address" + b"\0" * 32
    store.set(sealed._name("0/1"), forged)
    with pytest.raises(WeightSyncError, match="failed authentication"):
        sealed.get("0/1")


@pytest.mark.parametrize("produced, message", [
    ([("a", (2,)), ("b", (3,))], "stream tensor 1 is 'b' torch.float32 \\(3,\\), its spec says 'b' torch.float32 \\(2,\\)"),
    ([("a", (2,))], "ended after 1 of the 2 tensors its specs announce \\(next: 'b'\\)"),
    ([("a", (2,)), ("b", (2,)), ("c", (1,))], "yields 'c' after the 2 tensors"),
])
def test_a_stream_that_breaks_its_specs_is_named(produced, message):
    from rltools.weight_sync.channel import _in_order

    take = _in_order(iter([(name, torch.zeros(shape)) for name, shape in produced]),
                     [("a", torch.float32, (2,), 8), ("b", torch.float32, (2,), 8)])
    with pytest.raises(ValueError, match=message):
        take(1), take(0), take(2)


def test_the_alive_count_sees_tensors_a_consumer_holds():
    """The instrument behind `most_alive` above: a consumer that keeps every tensor (what the sender
    did before streams) makes it count them all."""
    from tests.integration.sync_peer import _produced, model

    out: dict = {}
    kept = list(_produced(model(4, "cpu"), out))
    assert out["most_alive"] == sum(1 for _, t in kept if t.numel()) == 43  # 45, less 2 empty tensors


def test_plan_packs_small_tensors_aligned_into_bounded_buckets():
    specs = [(f"t{i}", torch.float16, (n,), 2 * n) for i, n in enumerate([3, 1000, 7, 5000, 0, 11, 900, 4])]
    plan = plan_pieces(specs, bucket_bytes=4096, alone_bytes=8000)
    placed = {}
    for nbytes, members in plan.pieces:
        assert nbytes <= 4096 or len(members) == 1
        for index, offset in members:
            assert offset % ALIGN == 0 and offset + specs[index][3] <= nbytes
            placed[index] = offset
    assert sorted(placed) == list(range(len(specs)))
    alone = [members[0][0] for nbytes, members in plan.pieces if nbytes >= 8000]
    assert alone == [3], "only the 10 000-byte tensor travels alone"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL weight sync needs 2+ GPUs (one per process)")
def test_nccl_full_and_lora_updates_arrive_bitwise_equal(tmp_path):
    world = min(3, torch.cuda.device_count())
    paths = run_dir(tmp_path)
    args = ("--scenario", "roundtrip", "--backend", "nccl", "--world", str(world), "--timeout", "60")
    peers = [Peer(tmp_path, paths.root, "host" if r == 0 else "join", r, *args) for r in range(world)]
    sent, *received = [p.result(120) for p in peers]
    assert "setup_error" not in sent, sent
    for got in received:
        assert not got["errors"] and "setup_error" not in got, got
        assert [m["version"] for m in got["received"]] == [1, 2, 3]
        for want, have in zip(sent["sent"], got["received"]):
            assert have["tensors"] == want["tensors"]


def test_weights_bench_moves_the_same_bytes_both_ways_and_reports_a_ratio():
    from rltools.bench.weights import run_weights_bench

    result = run_weights_bench(total_mb=16, receivers=2)  # the receivers' counts are checked inside
    assert result["receivers"] == 2 and result["n_tensors"] >= 16 and 12 < result["total_mb"] < 18
    assert result["ours_gb_s"] > 0 and result["reference_gb_s"] > 0
    assert result["ratio"] == pytest.approx(result["ours_gb_s"] / result["reference_gb_s"], rel=0.01)


def test_a_stream_that_breaks_mid_message_leaves_the_group_unusable(tmp_path):
    """Receivers of a half-sent message still wait for its pieces: the next broadcast must not start
    a new header on top of it, so the sender fails at once, naming the first error."""
    from datetime import timedelta

    import torch.distributed as dist

    from rltools.weight_sync import (
        SyncGroup,
        TensorStream,
        WeightSender,
        WeightSyncError,
    )

    store = dist.HashStore()  # a one-member gloo group: the sender's collectives complete locally
    pg = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=5))
    sender = WeightSender(SyncGroup(pg, 0, 1, "gloo", torch.device("cpu"), timedelta(seconds=5), store))
    short = TensorStream([("a", torch.float32, (2,)), ("b", torch.float32, (2,))], iter([("a", torch.zeros(2))]))
    with pytest.raises(WeightSyncError, match="version 1 stopped mid-message.*ended after 1 of the 2 tensors"):
        sender.broadcast(short, 1)
    with pytest.raises(WeightSyncError, match="unusable after an earlier failure.*stopped mid-message"):
        sender.broadcast({"a": torch.zeros(2)}, 2)


def test_the_weight_sync_store_listens_only_on_the_address_it_publishes(tmp_path):
    """TCPStore alone listens on every interface (*:PORT) whatever host it is given."""
    import threading

    import psutil

    paths = run_dir(tmp_path)
    errors = []
    host = threading.Thread(target=lambda: errors.append(pytest.raises(WeightSyncError, host_group, paths, world_size=2,
                                                                       address="127.0.0.1",
                                                                       options=SyncOptions(join_timeout_s=3.0))))
    host.start()
    wait_for_file(paths.sync_address)
    port = json.loads(paths.sync_address.read_text())["port"]
    listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
    host.join()
    assert listening == {"127.0.0.1"}
    assert errors  # the join deadline passed, as expected with no generator


def test_an_engine_arriving_mid_run_waits_for_the_generation_formed_with_it(tmp_path):
    """A worker of an engine added from outside (`rltools join`) is admitted beside the configured
    one; a generation formed without it (it came too late for that one) is not its end: it joins the
    next, which trainer rank 0 forms once it saw the worker admitted."""
    import threading

    from rltools.weight_sync.rendezvous import SyncHost, SyncMember

    paths = run_dir(tmp_path)
    options = SyncOptions(join_timeout_s=30, collective_timeout_s=30)
    groups, errors = {}, []

    def run(name, body):
        try:
            groups[name] = body()
        except Exception as err:  # reported by the assertion below
            errors.append(f"{name}: {err!r}")

    def host():
        sync = SyncHost(paths, workers=1, address="127.0.0.1", options=options, may_join=lambda worker: worker == 2)
        first = sync.first_group()
        while 2 not in sync.admitted():
            time.sleep(0.01)
        sync.open()
        while not {1, 2} <= sync.ready():
            time.sleep(0.01)
        return first, sync.form([1, 2])

    def configured():
        member = SyncMember(paths, worker=1, workers=1, options=options)
        first = member.join()
        return first, member.join(after=first.generation)

    threads = [threading.Thread(target=run, args=(name, body)) for name, body in (
        ("host", host), ("configured", configured),
        ("arriving", lambda: SyncMember(paths, worker=2, workers=1, options=options, arriving=True).join()))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    (first, second), arriving = groups["host"], groups["arriving"]
    assert (first.generation, first.members) == (0, (1,)) and (second.generation, second.members) == (1, (1, 2))
    assert (arriving.generation, arriving.rank, arriving.world_size) == (1, 2, 3)
    received = [torch.zeros(1), torch.zeros(1)]
    works = [member.pg.broadcast([tensor], dist.BroadcastOptions())
             for member, tensor in zip((arriving, groups["configured"][1]), received)]
    second.pg.broadcast([torch.ones(1)], dist.BroadcastOptions()).wait()
    for work in works:
        work.wait()
    assert [t.item() for t in received] == [1.0, 1.0]  # the new generation carries weights to both


def test_a_group_given_up_with_a_collective_pending_is_never_destroyed_under_its_members_feet(tmp_path):
    """A member whose collective was given up (the trainer re-formed the group) drops its group and goes
    on. Destroying a gloo group with work pending waits out the collective's timeout, in whichever
    thread drops the last reference: in a vLLM worker that was execute_model, stalled for 300 s (the
    join test under load). The given-up group is kept, so dropping it costs nothing."""
    import gc
    import threading

    from rltools.weight_sync.channel import _Collectives

    paths = run_dir(tmp_path)
    options = SyncOptions(join_timeout_s=30, collective_timeout_s=30)
    groups = {}
    host = threading.Thread(target=lambda: groups.update(host=host_group(paths, world_size=2, address="127.0.0.1",
                                                                          options=options)))
    host.start()
    member = join_group(paths, rank=1, world_size=2, options=options)
    host.join(30)
    ops = _Collectives(member, abandon=lambda: "trainer rank 0 re-forms the group (generation 1)")
    pending = ops.broadcast(torch.zeros(4), "piece 1 of 1")  # trainer rank 0 never sends it
    with pytest.raises(WeightSyncError, match="given up: trainer rank 0 re-forms the group"):
        ops.wait(pending)
    started = time.monotonic()
    del member, ops, pending
    gc.collect()
    dropped_s = time.monotonic() - started
    assert dropped_s < 5, f"dropping the given-up group took {dropped_s:.1f} s (its collective's timeout: 30 s)"
