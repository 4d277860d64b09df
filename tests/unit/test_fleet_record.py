"""runtime.fleet: which engine generates each slot of a step, trainer rank 0's heartbeat clock, and a
generator's heartbeat, which stops before the trainer's store goes away."""

import time
from datetime import timedelta

import torch.distributed as dist

from rltools.paths import RunPaths
from rltools.runtime import faults
from rltools.runtime.address import publish_address
from rltools.runtime.fleet import BEAT_S, FleetRecord, Heartbeat, Heartbeats, add_join, joined_engines, set_join_job
from rltools.weight_sync.store import bound_store


def test_a_lost_engines_slots_go_to_the_survivors_in_turn_and_come_home_when_it_is_back(tmp_path):
    record = FleetRecord.start(4)
    assert record.slots(7) == [0, 1, 2, 3] and record.mine(2, 7) == [2]
    record.live = [0, 2]  # engines 1 and 3 lost at step 5
    assert record.reassign(5) == [0, 0, 2, 2]
    assert record.slots(4) == [0, 1, 2, 3] and record.slots(5) == [0, 0, 2, 2]  # trained steps keep theirs
    record.live = [0]
    assert record.reassign(9) == [0, 0, 0, 0]
    record.live = [0, 1]  # engine 1 restarted: its own slot comes back, and an even share
    assert record.reassign(12) == [0, 1, 0, 1]
    assert [start for start, _ in record.assignments] == [0, 5, 9, 12]
    record.note("lost", 3, 5, "its heartbeat stopped")
    paths = RunPaths(tmp_path)
    record.write(paths)
    assert FleetRecord.read(paths) == record
    assert FleetRecord.read(RunPaths(tmp_path / "none")) is None


def test_engines_that_join_take_an_even_share_of_the_slots_and_hand_it_back_when_they_leave():
    record = FleetRecord.start(1, slots=4)  # one configured engine, room for three more
    assert record.slots(0) == [0, 0, 0, 0] and record.covered(0) == []
    record.live = [0, 1]  # engine 1 joined (rltools join) at step 3
    assert record.reassign(3) == [0, 0, 1, 1]
    assert record.covered(3) == []  # its home engine is live: nothing was generated for a lost one
    record.live = [0, 1, 2]
    assert record.reassign(5) == [0, 0, 1, 2]
    record.count(5, [8, 8, 8, 8])
    record.count(4, [8, 8, 8, 8])
    assert record.delivered == {"0": 32, "1": 24, "2": 8}
    record.live = [1, 2]  # the configured engine is lost: its slots are covered by the joined ones
    assert record.reassign(7) == [1, 2, 1, 2] and record.covered(7) == [0, 1, 2, 3]
    two = FleetRecord.start(2, slots=4)
    assert two.slots(0) == [0, 1, 0, 1] and two.home(2) == 0 and two.home(3) == 1


def test_join_jobs_number_their_engines_past_the_runs_own_and_never_reuse_them(tmp_path):
    paths = RunPaths(tmp_path)
    assert joined_engines(paths) == {}
    assert add_join(paths, configured=2, engines=2, nodes=1) == 2
    set_join_job(paths, 2, "41")
    assert add_join(paths, configured=2, engines=1, nodes=1) == 4
    engines = joined_engines(paths)
    assert sorted(engines) == [2, 3, 4] and engines[3]["job_id"] == "41" and "job_id" not in engines[4]


def test_an_engine_is_stale_only_after_its_counter_stops_for_the_timeout():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    beats = Heartbeats(store, timeout_s=0.05)
    assert beats.stale([0, 1]) == {}  # first sight: a grace period
    time.sleep(0.1)
    store.add("beat/0", 1)  # engine 0 beats, engine 1 does not
    stale = beats.stale([0, 1])
    assert list(stale) == [1] and stale[1] > 0.05
    beats.forget(1)
    assert beats.stale([1]) == {}
    assert beats.left([0, 1]) == []
    store.set("left/1", "1")  # engine 1's job ends (Heartbeat.leave)
    assert beats.left([0, 1]) == [1]
    beats.forget(1)  # a new engine of that number has not left
    assert beats.left([0, 1]) == []


def test_a_fault_can_name_the_task_it_is_for():
    spec = "generator.sample@3/1=kill,trainer.sync@2=signal:USR2"
    assert faults._parse(spec, "1") == {("generator.sample", 3): "kill", ("trainer.sync", 2): "signal:USR2"}
    assert faults._parse(spec, "0") == {("trainer.sync", 2): "signal:USR2"}
    assert faults._parse("generator.eval@4=sleep:2.5", None) == {("generator.eval", 4): "sleep:2.5"}


def test_a_sleep_fault_pauses_the_process_there(monkeypatch):
    monkeypatch.setattr(faults, "_FAULTS", faults._parse("generator.eval@4=sleep:0.3", None))
    start = time.perf_counter()
    faults.point("generator.eval", 3)
    assert time.perf_counter() - start < 0.1
    faults.point("generator.eval", 4)
    assert time.perf_counter() - start >= 0.3


def _serve_store(paths: RunPaths):
    """Trainer rank 0's weight-sync store, its address published as the trainer publishes it; the
    server closes when the returned store is dropped (`del`)."""
    store = bound_store("127.0.0.1", timedelta(seconds=5))
    publish_address(paths.sync_address, "127.0.0.1", store.port, "0")
    return store


def test_a_stopped_heartbeat_stays_silent_when_the_trainers_store_closes(tmp_path, capfd):
    paths = RunPaths(tmp_path)
    server = _serve_store(paths)
    heartbeat = Heartbeat(paths, "0", engine=0, timeout_s=30, where={"node": "n1"})
    time.sleep(2.5 * BEAT_S)
    beats = server.add("beat/0", 0)
    assert beats >= 2  # the first beat, then one a second
    heartbeat.stop()  # the generator holds the final weights
    time.sleep(1.5 * BEAT_S)
    assert server.add("beat/0", 0) == beats
    del server  # the trainer closes its store; a final evaluation goes on for seconds
    time.sleep(2.5 * BEAT_S)
    heartbeat.leave()  # a signal now: nothing to tell, and no call to a closed store
    assert "[c10d]" not in capfd.readouterr().err


def test_a_heartbeat_ends_at_its_first_failed_beat(tmp_path, capfd):
    # the trainer died: a TCPStore client never reconnects, and each failed call logs a C++ stack trace
    paths = RunPaths(tmp_path)
    server = _serve_store(paths)
    heartbeat = Heartbeat(paths, "0", engine=0, timeout_s=30, where={})
    del server
    time.sleep(3 * BEAT_S)
    assert not heartbeat._thread.is_alive()
    err = capfd.readouterr().err
    assert err.count("[c10d]") == 1, err
