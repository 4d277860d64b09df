"""One run that goes through every fault a user meets, one launch each, and still ends with every
step exactly once: kill -9 of each role and of the launcher, SIGTERM and SIGHUP to the launcher, a
second launch on the running run, a stop signal at each phase of the trainer (start-up, training,
weight sync, checkpoint writing), a damaged checkpoint, a full disk and a moved run directory.

The tests run in order on one run directory (module scope): each launch costs ~15 s of start-up on
two cores, so one run carries all the faults. Each test names its fault; a failure stops the chain.
"""

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from .conftest import Launch, kill, role_pids, session_members, steps, wait_gone, wait_session_gone

TOTAL = 120


@pytest.fixture(scope="module")
def run(tmp_path_factory, repo):
    """The shared run: its directory, on a small tmpfs when this machine lets us mount one (the full
    disk test needs a filesystem it can fill), and the launch in progress."""
    base = tmp_path_factory.mktemp("faults")
    disk = base / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    state = {"repo": repo, "dir": disk / "run", "mounted": mounted}
    Launch.log_dir = base  # off the disk that the full-disk test fills
    yield state
    Launch.log_dir = None
    for pid in role_pids(state["dir"]).values():
        kill(pid)
    if mounted:
        wait_gone(state["dir"], timeout=120)
        subprocess.run(["umount", "-l", str(disk)])


def checkpoints(run_dir) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def launch(run, *overrides, env=None) -> Launch:
    assert len(steps(run["dir"])) + 15 < TOTAL, f"the chain has used up its {TOTAL} steps: raise TOTAL"
    if not (run["dir"] / "config.yaml").exists():
        return Launch.submit(run["repo"], run["dir"], f"schedule.steps={TOTAL}", *overrides, env=env)
    return Launch.resume(run["repo"], run["dir"], env=env)


def shown_steps(launch: Launch) -> list[int]:
    return [int(n) for n in re.findall(rf"^step (\d+)/{TOTAL}", launch.stderr, re.M)]


def test_kill_9_of_the_trainer(run):
    first = launch(run)
    first.wait_for_step(7)  # past the checkpoint of step 5
    kill(role_pids(run["dir"])["trainer"])
    assert first.wait() == 1
    assert "trainer 0 failed (exit -9)" in first.stderr
    wait_gone(run["dir"], timeout=120)  # the launcher stopped the generator


def test_resume_after_a_crash_replays_nothing_and_a_second_launch_is_refused(run):
    """The resume rewrites metrics.jsonl shorter while the launcher follows it (it used to die of
    JSONDecodeError and orphan the roles); the display shows only the steps this launch trains.
    A second launch while it runs is refused before it touches anything."""
    start = checkpoints(run["dir"])[-1]
    resumed = launch(run)
    lock = run["dir"] / "run.lock"
    deadline = time.monotonic() + 60
    while f'"pid": {resumed.proc.pid}' not in lock.read_text():  # it holds the lock: its roles are starting
        assert time.monotonic() < deadline and resumed.proc.poll() is None, resumed.stderr[-2000:]
        time.sleep(0.05)
    for again in (Launch.resume, lambda repo, run_dir: Launch.submit(repo, run_dir, f"schedule.steps={TOTAL}")):
        second = again(run["repo"], run["dir"])
        assert second.wait(timeout=60) == 2, second.stderr
        assert (f"run directory {run['dir']} is in use by rltools resume (local launcher) (pid {resumed.proc.pid}"
                in second.stderr), second.stderr
    resumed.wait_for_output(f"step {start + 2}/{TOTAL}")
    sessions = set(role_pids(run["dir"]).values())
    kill(role_pids(run["dir"])["generator"])  # and then the generator dies
    wait_session_gone(sessions)  # vLLM's engine core and worker with it (they held the weight-sync group)
    assert resumed.wait() == 1
    assert "generator 0 failed (exit -9)" in resumed.stderr
    shown = shown_steps(resumed)
    assert shown == list(range(start + 1, shown[-1] + 1)) and len(shown) >= 2, f"steps shown on resume: {shown}"
    assert "Traceback" not in resumed.stderr
    wait_gone(run["dir"])


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_or_sighup_to_the_launcher_stops_both_roles_at_a_checkpoint(run, signum, code):
    """`timeout 1200 rltools submit ...` (SIGTERM) or a closed terminal (SIGHUP) must not leave the
    roles training on their own."""
    current = launch(run)
    current.wait_for_output(f"step {len(steps(run['dir'])) + 2}/{TOTAL}")
    current.proc.send_signal(signum)
    assert current.wait(timeout=180) == code
    assert f"continue with: rltools resume {run['dir']}" in current.stderr, current.stderr[-2000:]
    assert not role_pids(run["dir"]), "roles outlived the launcher"
    assert checkpoints(run["dir"])[-1] == len(steps(run["dir"])), "the trainer checkpointed every step it trained"
    status = subprocess.run([sys.executable, "-m", "rltools", "status", str(run["dir"]), "--json"], capture_output=True,
                            text=True, cwd=run["repo"])
    assert json.loads(status.stdout)["state"] == "STOPPED"


def test_kill_9_of_the_launcher_takes_its_roles_down(run):
    current = launch(run)
    current.wait_for_output(f"step {len(steps(run['dir'])) + 2}/{TOTAL}")
    sessions = set(role_pids(run["dir"]).values())
    assert any("VLLM::EngineCore" in p for p in session_members(sessions)), session_members(sessions)
    kill(current.proc.pid)
    wait_gone(run["dir"], timeout=120)  # PR_SET_PDEATHSIG: each role got SIGTERM
    wait_session_gone(sessions)  # the generator leaves with os._exit: vLLM's processes die with it (lifeline)
    trainer_log = sorted((run["dir"] / "slurm/logs").glob("attempt_*/trainer_0.log"))[-1].read_text()
    assert "received SIGTERM" in trainer_log and "stopped on SIGTERM" in trainer_log
    assert checkpoints(run["dir"])[-1] == len(steps(run["dir"]))


@pytest.mark.parametrize("phase,signame", [("start", "USR2"), ("train", "TERM"), ("sync", "USR2"), ("checkpoint", "TERM")])
def test_a_stop_signal_at_each_phase_of_the_trainer_ends_at_a_checkpoint(run, phase, signame):
    """The preemption warning (USR2) or SIGTERM while the trainer starts up (before its slow imports),
    trains, broadcasts the weights or writes a checkpoint: each time it completes what it is doing,
    writes a valid checkpoint of exactly the steps it trained and exits 3. At start-up the generator
    receives the warning too, and ignores it."""
    done = len(steps(run["dir"]))
    step = {"start": None, "train": done + 1, "sync": done + 2, "checkpoint": (done // 5 + 1) * 5}[phase]
    fault = f"trainer.{phase}{'' if step is None else f'@{step}'}=signal:{signame}"
    if phase == "start":
        fault += ",generator.start=signal:USR2"
    expected = {"start": done, "train": done + 2, "sync": done + 2, "checkpoint": step}[phase]
    current = launch(run, env={"RLTOOLS_FAULT": fault})
    assert current.wait() == 3, f"{fault}: {current.stderr[-3000:]}"
    assert "the trainer stopped" in current.stderr
    assert len(steps(run["dir"])) == expected and checkpoints(run["dir"])[-1] == expected, (fault, checkpoints(run["dir"]))
    wait_gone(run["dir"])
    if phase == "start":
        generator_log = sorted((run["dir"] / "slurm/logs").glob("attempt_*/generator_0.log"))[-1].read_text()
        assert "ignored SIGUSR2 received during start-up" in generator_log


def test_a_damaged_checkpoint_is_set_aside_and_the_previous_one_resumes(run):
    """64 flipped bytes in the middle of the newest checkpoint's tensors used to load silently
    (reward 0 from then on) and retention then deleted the good checkpoints."""
    newest, previous = checkpoints(run["dir"])[-1], checkpoints(run["dir"])[-2]
    shard = next((run["dir"] / "checkpoints" / f"step_{newest}").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    shard.write_bytes(bytes(data))
    current = launch(run)
    current.wait_for_output(f"step {previous + 3}/{TOTAL}")
    current.proc.send_signal(signal.SIGINT)
    assert current.wait(timeout=180) == 130
    trainer_log = sorted((run["dir"] / "slurm/logs").glob("attempt_*/trainer_0.log"))[-1].read_text()
    assert f"checkpoint {run['dir']}/checkpoints/step_{newest} is damaged ({shard.name} fails its checksum)" in trainer_log
    assert f"resuming from {run['dir']}/checkpoints/step_{previous} instead" in trainer_log
    assert list((run["dir"] / "checkpoints.rejected").glob(f"step_{newest}.*")), "the damaged checkpoint is kept aside"
    # the launcher announced the newest checkpoint; it then says which one the trainers loaded, and why
    assert f"its latest checkpoint holds {newest} of {TOTAL} steps" in current.stderr
    assert f"the trainers resumed from the checkpoint after {previous} steps\n  set aside: checkpoint " in current.stderr
    assert checkpoints(run["dir"])[-1] == len(steps(run["dir"])) >= previous + 3


def test_a_full_disk_fails_naming_the_file_and_the_run_resumes_once_there_is_space(run):
    if not run["mounted"]:
        pytest.skip("cannot mount a tmpfs here (needs root): no filesystem to fill")
    current = launch(run)
    current.wait_for_output(f"step {len(steps(run['dir'])) + 2}/{TOTAL}")
    filler = run["dir"].parent / "filler"
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)  # until the disk is full
        assert current.wait() == 1
        # the role names the file in its log if the full disk leaves room for that line; the launcher always says it
        assert f"the filesystem of {run['dir']} is full" in current.stderr, current.stderr[-3000:]
        wait_gone(run["dir"])
    finally:
        filler.unlink()
    log = sorted((run["dir"] / "slurm/logs").glob("attempt_*/"))[-1]
    errors = [line for path in log.glob("*.log") for line in path.read_text(errors="replace").splitlines()
              if line.startswith("error: ")]
    assert all("No space left on device writing /" in line for line in errors), errors


def test_a_moved_run_directory_resumes_where_it_is_now(run):
    """`resume COPY` used to print "resuming COPY" and then run in the run.dir recorded in config.yaml."""
    old, new = run["dir"], run["dir"].parent / "moved"
    shutil.move(old, new)
    run["dir"] = new
    final = launch(run)
    assert final.wait() == 0, final.stderr[-4000:]
    assert f"was moved or copied from {old}" in final.stderr
    assert not old.exists(), "nothing may run in the old place"
    assert steps(new) == list(range(TOTAL)), "each step exactly once across all the faults"
    assert (new / "eval" / f"step_{TOTAL}.json").exists()
