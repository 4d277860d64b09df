"""A lost generator engine costs throughput, not the run (`train.fleet`): the demo with three engines
loses one with SIGKILL while it generates and another inside a weight sync (its vLLM worker dies
with the version's metadata received), and completes on the last one, every step trained once on
exactly the prompts an uninterrupted run trains."""

import json

from tests.fleet_checks import assert_each_step_trained_its_own_prompts

from .conftest import Launch, steps

STEPS = 10


def test_a_run_loses_two_of_three_engines_and_completes_on_the_third(tmp_path, repo):
    run_dir = tmp_path / "fleet"
    faults = "generator.sample@3/1=kill,generator.receive@6/2=kill"
    launch = Launch.submit(repo, run_dir, f"schedule.steps={STEPS}", "cluster.generators.ntasks_per_node=3",
                           "generator.heartbeat_timeout_s=5", f"schedule.keep_rollout_steps={STEPS}",
                           env={"RLTOOLS_FAULT": faults})
    assert launch.wait(timeout=400) == 0, launch.stderr[-3000:]
    assert "generator 1 failed (exit -9); the run goes on with the other engines" in launch.stderr
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
