"""A lost generator engine costs throughput, not the run (`train.fleet`): an engine killed with
SIGKILL inside a weight sync (its vLLM worker dies with the version's metadata received) is lost,
the other engine takes its slots, and its task's supervisor starts it again: it rejoins and takes
its slot back. Every step is trained once, on exactly the prompts an uninterrupted run trains.
(A generator task lost for good, while it generates, is tests/slurm/test_fleet.py.)"""

import json
import signal
import time

from tests.fleet_checks import assert_each_step_trained_its_own_prompts

from .conftest import Launch, steps

TOTAL = 400  # an upper bound: the test stops the run a few steps after the replacement rejoined


def fleet(run_dir) -> dict:
    path = run_dir / "fleet.json"
    return json.loads(path.read_text()) if path.exists() else {"events": []}


def test_an_engine_killed_in_a_weight_sync_is_lost_then_replaced_and_takes_its_slot_back(tmp_path, repo):
    run_dir = tmp_path / "fleet"
    launch = Launch.submit(repo, run_dir, f"schedule.steps={TOTAL}", "cluster.generators.ntasks_per_node=2",
                           "generator.heartbeat_timeout_s=5", f"schedule.keep_rollout_steps={TOTAL}",
                           env={"RLTOOLS_FAULT": "generator.receive@6/1=kill"})
    # the replacement starts vLLM again: ~45 s here, minutes on a loaded machine
    deadline = time.monotonic() + 600
    while not any(e["event"] == "joined" for e in fleet(run_dir)["events"]):
        assert launch.proc.poll() is None and time.monotonic() < deadline, launch.stderr[-3000:]
        time.sleep(0.5)
    back_at = fleet(run_dir)["events"][-1]["step"]
    launch.wait_for_step(back_at + 6)
    launch.proc.send_signal(signal.SIGTERM)  # it stops at a checkpoint of the steps done
    assert launch.wait(timeout=180) == 143, launch.stderr[-3000:]
    done = len(steps(run_dir))
    assert steps(run_dir) == list(range(done))

    record = fleet(run_dir)
    assert [(e["event"], e["engine"]) for e in record["events"]] == [("lost", 1), ("joined", 1)]
    assert record["events"][0]["step"] == 6 and record["live"] == [0, 1]
    assert record["assignments"] == [[0, [0, 1]], [6, [0, 0]], [back_at, [0, 1]]]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["engines"] for m in metrics[:5]] == [2] * 5 and metrics[6]["engines"] == 1
    assert metrics[-1]["engines"] == 2 and len(metrics[back_at + 2]["logprob_gap_engines"]) == 2  # both probed
    assert metrics[back_at - 2]["reassigned_samples"] == 8 * 8 and metrics[-1]["reassigned_samples"] == 0
    assert_each_step_trained_its_own_prompts(run_dir, done)

    trainer = (run_dir / "slurm/logs/attempt_0/trainer_0.log").read_text()
    assert "weight sync failed" in trainer and "generator 1 lost at step 6" in trainer
    assert "generator 1 is back: it joins the group at this weight sync" in trainer
    replaced = (run_dir / "slurm/logs/attempt_0/generator_1.log").read_text()
    assert "the engine died (exit 1): starting it again (restart 1 of 3" in replaced  # its vLLM worker was killed
    assert f"step {done - 1}: 64 samples, policy" in replaced or f"step {done}: 64 samples, policy" in replaced
    assert "(slot 1, for a lost engine)" in (run_dir / "slurm/logs/attempt_0/generator_0.log").read_text()
