"""cluster.container: the pyxis options and the apptainer prefix in the rendered job script, for the plain
script and the submitit executors, and the checks on the config.

Neither pyxis (a Slurm SPANK plugin over enroot) nor apptainer can be installed on the machines these
tests run on, so they stop at the script: its exact srun lines, `bash -n`, and a run of the script
against a stub srun that records the argv each job step would have started.
"""

import json
import os
import subprocess
import sys

import pytest
import yaml

from rltools.config import load_config
from rltools.errors import UserError
from rltools.launch.sbatch import render_sbatch
from rltools.launch.slurm import GeneratorJobExecutor, HetJobExecutor
from rltools.paths import RunPaths

RUN = "/scratch/runs/c"
FIXED = [f"run.dir={RUN}", "model.path=/models/tiny", "cluster.launcher=slurm"]
PYXIS = "{runtime: pyxis, image: 'nvcr.io#nvidia/pytorch:25.01-py3', mounts: ['/lustre/hf:/hf:ro']}"
APPTAINER = "{runtime: apptainer, image: /images/rl.sif, mounts: ['/lustre/hf:/hf:ro']}"
MOUNTS = f"/lustre/hf:/hf:ro,/models/tiny:/models/tiny:ro,{RUN}:{RUN}"


def config(repo, container: str, *overrides: str):
    return load_config(repo / "configs" / "demo.yaml", [*FIXED, f"cluster.container={container}", *overrides])


def srun_steps(script: str) -> list[str]:
    """Each job step's srun command, from `srun` to its trailing `&`."""
    lines, steps = script.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("srun "):
            end = next(j for j in range(i, len(lines)) if lines[j].endswith("&"))
            steps.append("\n".join(lines[i : end + 1]))
    return steps


def test_pyxis_adds_container_options_to_each_srun_line(repo):
    script = render_sbatch(config(repo, PYXIS))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    container = (
        "    --container-image='nvcr.io#nvidia/pytorch:25.01-py3' \\\n"
        f"    --container-mounts={MOUNTS} \\\n"
        f"    --container-workdir={RUN} \\\n"
    )
    assert srun_steps(script) == [
        f"srun --het-group={i} --kill-on-bad-exit={int(role == 'trainer')} --export=ALL,RLTOOLS_ROLE={role} \\\n"
        f'    --output="$log_dir/{role}_%t.log" \\\n{container}'
        f'    python3 -m rltools.jobs.{role} "$RLTOOLS_RUN_DIR" 9>&- &'
        for i, role in enumerate(["generator", "trainer"])
    ]
    assert "flock --wait 60 9" in script  # the lock stays in the batch shell, outside the container


def test_apptainer_prefixes_each_task_and_maps_gpus_only_where_requested(repo):
    gpu_trainer = ["cluster.trainers.gpus_per_node=1", "cluster.container.workdir=/work dir"]
    script = render_sbatch(config(repo, APPTAINER, *gpu_trainer))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    generator, trainer = srun_steps(script)
    prefix = f"    apptainer exec {{}}--bind {MOUNTS} --pwd '/work dir' /images/rl.sif \\\n"
    assert generator.splitlines()[2:] == [
        prefix.format("").rstrip("\n"), '    python3 -m rltools.jobs.generator "$RLTOOLS_RUN_DIR" 9>&- &'
    ]
    assert trainer.splitlines()[2] == prefix.format("--nv ").rstrip("\n")
    assert "--container-" not in script


def test_without_a_container_the_script_is_unchanged(repo):
    plain = load_config(repo / "configs" / "demo.yaml", FIXED)
    off = config(repo, APPTAINER, "cluster.container.runtime=none")  # the other keys are then unused
    assert render_sbatch(off) == render_sbatch(plain)
    assert "apptainer" not in render_sbatch(plain) and "--container" not in render_sbatch(plain)


def test_mounts_cover_the_data_files_once_and_parents_come_first(repo):
    data = ["data.type=jsonl", "data.train_path=/data/aime/train.jsonl", "data.eval_path=/data/aime/eval.jsonl"]
    script = render_sbatch(config(repo, "{runtime: pyxis, image: /i.sqsh, mounts: ['/scratch:/scratch']}", *data))
    assert "--container-mounts=/scratch:/scratch,/models/tiny:/models/tiny:ro,/data/aime:/data/aime:ro \\\n" in script
    more = ["data.train_path=/data/dapo/train", "data.eval_path=/data/aime/eval.jsonl",  # a save_to_disk directory
            "eval.sets.math.path=/sets/math500.jsonl", "data.chat_template=/templates/chat.jinja"]
    script = render_sbatch(config(repo, "{runtime: pyxis, image: /i.sqsh}", *more))
    assert ("--container-mounts=/templates:/templates:ro,/sets:/sets:ro,/models/tiny:/models/tiny:ro,/data/dapo:"
            "/data/dapo:ro,/data/aime:/data/aime:ro,/scratch/runs/c:/scratch/runs/c \\\n") in script


def test_the_submitit_paths_run_in_the_container(repo, tmp_path):
    run_dir = tmp_path / "run"
    c = config(repo, APPTAINER, f"run.dir={run_dir}", "cluster.trainers.gpus_per_node=1")
    paths = RunPaths(run_dir)
    script = HetJobExecutor(c, paths)._make_submission_file_text("unused", "uid")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    trainer = srun_steps(script)[1].splitlines()
    assert trainer[2].startswith("    apptainer exec --nv --bind ")
    assert trainer[3] == (f"    env SUBMITIT_EXECUTOR=slurm python3 -u -m submitit.core._submit "
                          f"{paths.submitit_dir('trainer')} 9>&- &")

    pyxis = config(repo, PYXIS, f"run.dir={run_dir}")
    eval_job = GeneratorJobExecutor(pyxis, paths, "eval")
    text = eval_job._make_submission_file_text(eval_job._submitit_command_str, "uid")
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "'--container-image=nvcr.io#nvidia/pytorch:25.01-py3'" in srun and f"--container-workdir={run_dir}" in srun
    assert srun.endswith(f"python3 -u -m submitit.core._submit {paths.slurm_dir / 'submitit' / 'eval'}")


@pytest.fixture
def stub_srun(tmp_path):
    """A fake srun that records its argv, so the rendered script runs here up to its job steps."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "with open(os.environ['STUB_LOG'], 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    srun.chmod(0o755)
    return bin_dir


def run_script(script: str, work, stub_srun) -> list[list[str]]:
    """Each srun argv the script started, run from `work` with the run directory `work`/run."""
    RunPaths(work / "run").create()
    (work / "job.sbatch").write_text(script)
    log = work / "srun.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"PATH": f"{stub_srun}:{env['PATH']}", "STUB_LOG": str(log), "SLURM_JOB_ID": "4242"}
    result = subprocess.run(["bash", "job.sbatch"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_odd_paths_reach_the_runtime_as_one_word(repo, tmp_path, stub_srun):
    run_dir = tmp_path / "run"
    image = "/images/it's a $HOME & `x`.sqsh"
    container = {"runtime": "pyxis", "image": image, "mounts": ["/a&b/$c;d:/in"], "workdir": "/w d/'q'"}
    c = config(repo, json.dumps(container), f"run.dir={run_dir}")
    argv = run_script(render_sbatch(c), tmp_path, stub_srun)[0]
    assert argv[4:7] == [f"--container-image={image}", "--container-mounts=/a&b/$c;d:/in,/models/tiny:/models/tiny:ro,"
                         f"{run_dir}:{run_dir}", "--container-workdir=/w d/'q'"]

    c = config(repo, json.dumps({**container, "runtime": "apptainer"}), f"run.dir={run_dir}")
    argv = run_script(render_sbatch(c), tmp_path, stub_srun)[-1]
    assert argv[4:12] == ["apptainer", "exec", "--bind", argv[7], "--pwd", "/w d/'q'", image, "python3"]


HOSTILE = ["x'; touch pwned; '", "$(touch pwned)", "`touch pwned`", '"; touch pwned; "']


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
@pytest.mark.parametrize("key", ["image", "workdir", "python"])
@pytest.mark.parametrize("payload", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_container_values_never_execute(repo, tmp_path, stub_srun, runtime, key, payload):
    value = f"/{payload}" if key == "workdir" else payload
    container = {"runtime": runtime, "image": "/i.sif", key: value}
    c = config(repo, json.dumps(container), f"run.dir={tmp_path / 'run'}")
    calls = run_script(render_sbatch(c), tmp_path, stub_srun)
    assert not list(tmp_path.rglob("pwned"))
    assert len(calls) == 2 and all(any(value in word for word in argv) for argv in calls)


@pytest.mark.parametrize("mount", ["data:/data", "/data", "/data:/in:rx", "/a,b:/in", "/a b:/in", "/a:/in'", "/a:in"])
def test_bad_mounts_name_the_key_and_the_form(repo, mount):
    with pytest.raises(UserError, match=r"cluster\.container\.mounts\.0: must be SRC:DST or SRC:DST:ro") as err:
        config(repo, json.dumps({"runtime": "pyxis", "image": "/i.sqsh", "mounts": [mount]}))
    assert f"got {mount!r}" in str(err.value)


@pytest.mark.parametrize("container,overrides,message", [
    ("{runtime: apptainer, image: /i.sif}", ["cluster.launcher=local"],
     "cluster.container.runtime: apptainer needs cluster.launcher: slurm"),
    ("{runtime: pyxis}", [], "cluster.container.runtime: pyxis needs cluster.container.image"),
    ("{runtime: pyxis, image: /i.sqsh, workdir: work}", [], "cluster.container.workdir must be an absolute path"),
    ("{runtime: pyxis, image: \"a\\nb\"}", [], "cluster.container.image must be one non-empty line"),
])
def test_config_errors_say_what_to_set(repo, container, overrides, message):
    with pytest.raises(UserError, match=message):
        config(repo, container, *overrides)


def test_a_path_the_runtimes_cannot_mount_is_refused_at_render(repo, tmp_path):
    with pytest.raises(UserError, match=r"run\.dir '/scratch/a,b' cannot be mounted into the container"):
        render_sbatch(config(repo, PYXIS, "run.dir=/scratch/a,b"))
    # a mount that covers it is the way out
    script = render_sbatch(config(repo, "{runtime: pyxis, image: /i.sqsh, mounts: ['/scratch:/scratch']}",
                                  "run.dir=/scratch/a,b"))
    assert "--container-mounts=/scratch:/scratch,/models/tiny:/models/tiny:ro \\\n" in script


def test_render_command_writes_the_container_into_the_job_script(repo, tmp_path):
    from rltools.cli import main

    model = repo / "rltools" / "assets" / "tiny-arith"  # `rltools render` checks the model directory
    raw = {"run": {"name": "c", "dir": str(tmp_path / "run")}, "model": {"path": str(model)},
           "cluster": {"launcher": "slurm", "container": {"runtime": "pyxis", "image": "/i.sqsh"}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert main(["render", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "job.sbatch")]) == 0
    assert (tmp_path / "job.sbatch").read_text().count("    --container-image=/i.sqsh \\\n") == 2
