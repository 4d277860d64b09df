"""The rendered hetjob on a real Slurm, with the RL roles replaced by the cluster self-check."""

import json

from .conftest import demo_run, sbatch, wait_for_job

SELFCHECK = {"generator": "rltools.jobs.selfcheck", "trainer": "rltools.jobs.selfcheck"}


def roleenvs(log_text: str) -> list[dict]:
    prefix = "selfcheck roleenv "
    return [json.loads(line[len(prefix):]) for line in log_text.splitlines() if line.startswith(prefix)]


def test_hetjob_components_start_on_their_nodes_and_meet(slurm, repo, tmp_path):
    paths = demo_run(
        repo, tmp_path, "cluster.generators.nodes=2", "cluster.trainers.ntasks_per_node=2", "cluster.time=00:05:00",
        entries=SELFCHECK,
    )
    job_id = sbatch(paths.sbatch_script)
    states = wait_for_job(job_id)

    logs = paths.attempt_log_dir(0)
    found = sorted(p.name for p in logs.glob("*.log")) if logs.exists() else []
    batch_err = paths.component_log("generators", "err")
    context = f"states {states}; logs {found}; batch stderr: {batch_err.read_text() if batch_err.exists() else '-'}"
    assert set(states.values()) == {"COMPLETED"}, context
    assert found == ["generator_0.log", "generator_1.log", "trainer_0.log", "trainer_1.log"], context

    generators = [roleenvs(paths.task_log(0, "generator", r).read_text())[0] for r in (0, 1)]
    trainers = [roleenvs(paths.task_log(0, "trainer", r).read_text())[0] for r in (0, 1)]
    assert [g["rank"] for g in generators] == [0, 1] and [t["rank"] for t in trainers] == [0, 1]
    assert all(e["world_size"] == 2 and e["launcher"] == "slurm" for e in generators + trainers)
    assert {g["role"] for g in generators} == {"generator"} and {t["role"] for t in trainers} == {"trainer"}
    generator_nodes = {g["node"] for g in generators}
    trainer_nodes = {t["node"] for t in trainers}
    assert len(generator_nodes) == 2 and len(trainer_nodes) == 1
    assert not generator_nodes & trainer_nodes, "components must run on different nodes"
    assert all(e["trainer_host"] == trainers[0]["node"] for e in generators + trainers)
    assert len({e["job_id"] for e in generators + trainers}) == 1 and generators[0]["job_id"] == job_id

    trainer0 = paths.task_log(0, "trainer", 0).read_text()
    for rank in (0, 1):
        assert f"selfcheck met generator rank {rank} from node" in trainer0
        assert "selfcheck met trainer rank 0 on node " + trainers[0]["node"] in paths.task_log(0, "generator", rank).read_text()
