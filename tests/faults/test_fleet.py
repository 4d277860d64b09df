"""A lost generator engine costs throughput, not the run (`train.fleet`): engines killed with SIGKILL
while they generate and inside a weight sync (a vLLM worker dying with the version's metadata
received); without restarts the run completes on the survivors, with them the killed engine is
replaced and rejoins. Every step is trained once, on exactly the prompts an uninterrupted run trains."""

import json

from tests.fleet_checks import assert_each_step_trained_its_own_prompts

from .conftest import Launch, steps

STEPS = 10


def test_a_run_loses_two_of_three_engines_and_completes_on_the_third(tmp_path, repo):
    run_dir = tmp_path / "fleet"
    faults = "generator.sample@3/1=kill,generator.receive@6/2=kill"
    launch = Launch.submit(repo, run_dir, f"schedule.steps={STEPS}", "cluster.generators.ntasks_per_node=3",
                           "generator.heartbeat_timeout_s=5", f"schedule.keep_rollout_steps={STEPS}",
                           "generator.max_engine_restarts=0", env={"RLTOOLS_FAULT": faults})
    assert launch.wait(timeout=400) == 0, launch.stderr[-3000:]
    assert "generator 1 failed (exit 137); the run goes on with the other engines" in launch.stderr
    assert "generator 2 failed" in launch.stderr
    assert steps(run_dir) == list(range(STEPS))

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    engines = [m["engines"] for m in metrics]
    assert engines[0] == 3 and engines[-1] == 1 and engines == sorted(engines, reverse=True), engines
    assert len(metrics[-1]["logprob_gap_engines"]) == 1  # the probe: only the live engine answers
    # slots 1 and 2 (5 of the 16 prompts each) went to engine 0 once their engines were lost
    assert [m["reassigned_samples"] for m in metrics[-3:]] == [(5 + 5) * 8] * 3, metrics

    fleet = json.loads((run_dir / "fleet.json").read_text())
    assert fleet["live"] == [0]
    assert [(e["event"], e["engine"]) for e in fleet["events"]] == [("lost", 1), ("lost", 2)]
    assert fleet["assignments"][-1][1] == [0, 0, 0]

    assert_each_step_trained_its_own_prompts(run_dir, STEPS)
    log = (run_dir / "slurm" / "logs" / "attempt_0" / "generator_0.log").read_text()
    assert "(slot 1, for a lost engine)" in log and "(slot 2, for a lost engine)" in log


def test_a_killed_engine_is_replaced_and_takes_its_slot_back(tmp_path, repo):
    """The replacement (generator.max_engine_restarts) starts vLLM again, ~30-50 s here: the run is
    long enough for it to rejoin well before the end."""
    total = 120
    run_dir = tmp_path / "replaced"
    launch = Launch.submit(repo, run_dir, f"schedule.steps={total}", "cluster.generators.ntasks_per_node=2",
                           "generator.heartbeat_timeout_s=5", f"schedule.keep_rollout_steps={total}",
                           env={"RLTOOLS_FAULT": "generator.sample@3/1=kill"})
    assert launch.wait(timeout=400) == 0, launch.stderr[-3000:]
    assert steps(run_dir) == list(range(total))
    fleet = json.loads((run_dir / "fleet.json").read_text())
    assert [(e["event"], e["engine"]) for e in fleet["events"]] == [("lost", 1), ("joined", 1)]
    back_at = fleet["events"][1]["step"]
    assert back_at < total - 5 and fleet["live"] == [0, 1] and fleet["assignments"][-1] == [back_at, [0, 1]]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["engines"] == 2 and len(metrics[-1]["logprob_gap_engines"]) == 2
    assert metrics[-1]["reassigned_samples"] == 0 and metrics[back_at - 2]["reassigned_samples"] == 8 * 8
    assert_each_step_trained_its_own_prompts(run_dir, total)
    log = (run_dir / "slurm" / "logs" / "attempt_0" / "generator_1.log").read_text()
    assert "the engine died (exit -9): starting it again (restart 1 of 3" in log
    assert f"step {total - 1}: 64 samples, policy" in log  # its own slot again, to the end
