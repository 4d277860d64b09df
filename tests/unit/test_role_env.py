import pytest

from rltools.errors import UserError
from rltools.runtime.role_env import RoleEnv, expand_hostlist


@pytest.mark.parametrize(
    "hostlist,hosts",
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1-2,7],login", ["n1", "n2", "n7", "login"]),
        ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_expand_hostlist_rejects_garbage():
    with pytest.raises(ValueError):
        expand_hostlist("n[1-")


SLURM_TRAINER = {
    "RLTOOLS_ROLE": "trainer",
    "SLURM_JOB_ID": "100",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "n[3-4]",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURMD_NODENAME": "n4",
    "SLURM_RESTART_COUNT": "2",
}


def test_slurm_trainer():
    env = RoleEnv.from_environ(SLURM_TRAINER)
    assert (env.launcher, env.role, env.rank, env.world_size, env.local_rank) == ("slurm", "trainer", 3, 4, 1)
    assert env.trainer_host == "n3" and env.node == "n4"
    assert env.restart_count == 2 and env.job_id == "100"


def test_slurm_first_start_has_no_restart_count():
    env = RoleEnv.from_environ({k: v for k, v in SLURM_TRAINER.items() if k != "SLURM_RESTART_COUNT"})
    assert env.restart_count == 0


def test_slurm_without_hetjob_is_explained():
    with pytest.raises(UserError, match="not heterogeneous"):
        RoleEnv.from_environ({k: v for k, v in SLURM_TRAINER.items() if k != "SLURM_HET_SIZE"})


def test_missing_role_names_the_variable():
    with pytest.raises(UserError, match="RLTOOLS_ROLE is not set"):
        RoleEnv.from_environ({"SLURM_JOB_ID": "1"})


def test_bad_role():
    with pytest.raises(UserError, match="expected generator, trainer or judge"):
        RoleEnv.from_environ({"RLTOOLS_ROLE": "evaluator"})


def test_local_round_trip():
    env = RoleEnv.from_environ(RoleEnv.local_environ("generator", rank=1, world_size=2, restart_count=1))
    assert (env.launcher, env.role, env.rank, env.world_size, env.restart_count) == ("local", "generator", 1, 2, 1)
    assert env.trainer_host == "127.0.0.1" and env.job_id is None


def test_local_launcher_wins_inside_a_slurm_allocation():
    # The demo run by hand inside `salloc` still uses the local launcher's variables.
    env = RoleEnv.from_environ({**SLURM_TRAINER, **RoleEnv.local_environ("trainer", 0, 1)})
    assert env.launcher == "local" and env.rank == 0


def test_attempt_names_the_job_and_the_restart():
    # A record published by an earlier job in the same run directory (also restart 0) is not ours.
    assert RoleEnv.from_environ(SLURM_TRAINER).attempt == "100.2"
    assert RoleEnv.from_environ({**SLURM_TRAINER, "SLURM_JOB_ID": "200"}).attempt == "200.2"
    assert RoleEnv.from_environ(RoleEnv.local_environ("trainer", 0, 1, restart_count=1)).attempt == "local.1"


@pytest.mark.parametrize("local_rank,count,expected", [
    (0, 4, 0), (3, 4, 3),  # every task sees the node's 4 GPUs: one each, by node-local rank
    (0, 1, 0), (3, 1, 0),  # Slurm bound one GPU to each task (--gpus-per-task): the only one it sees
])
def test_each_trainer_rank_selects_its_own_gpu_in_both_slurm_layouts(local_rank, count, expected):
    """configs/aime.yaml runs 4 trainer ranks a node; without a choice FSDP2 put all of them on cuda:0."""
    from rltools.runtime.roles import gpu_index

    assert gpu_index(local_rank, count, "0,1,2,3" if count == 4 else str(local_rank)) == expected


def test_a_trainer_rank_without_a_gpu_of_its_own_is_named():
    from rltools.runtime.roles import gpu_index

    with pytest.raises(RuntimeError) as short:
        gpu_index(2, 2, "0,1")
    assert "node-local rank 2 sees 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1)" in str(short.value)
    assert "cluster.trainers.gpus_per_node >= ntasks_per_node" in str(short.value)


def test_the_trainer_makes_its_gpu_current_and_binds_its_group_to_it(monkeypatch):
    """With a stand-in device count: trainer_device makes the chosen device current (FSDP2 and the
    weight-sync group use the current device)."""
    import torch

    from rltools.train import loop

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert loop.trainer_device(3) == torch.device("cuda", 3) and current == [torch.device("cuda", 3)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert loop.trainer_device(3) == torch.device("cuda", 0)


def test_the_probe_gap_and_its_verdict():
    from rltools.runtime.probe import check_gap, probe_gap

    assert probe_gap([-1.0, -2.0, -0.5], [-1.1, -2.0, -0.2]) == pytest.approx((0.4 / 3, 0.3))
    with pytest.raises(ValueError, match="scored 2 tokens, the generator 1"):
        probe_gap([-1.0, -2.0], [-1.0])
    check_gap(3, 0.05, "sync rank 1 (generator 0)", 0.1)
    check_gap(3, 5.0, "sync rank 1 (generator 0)", 0.0)  # 0: no check
    with pytest.raises(RuntimeError) as far:
        check_gap(3, 0.7, "sync rank 2 (generator 1)", 0.1)
    assert "policy version 3" in str(far.value) and "sync rank 2 (generator 1)" in str(far.value)
    assert "by 0.7 on average, above generator.max_logprob_gap 0.1" in str(far.value)
    assert "kv_b_proj" in str(far.value), "names the likely causes"
