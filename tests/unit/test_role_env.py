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
    with pytest.raises(UserError, match="expected generator or trainer"):
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
