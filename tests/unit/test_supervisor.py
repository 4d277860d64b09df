"""The generator task's supervisor (`generate/supervisor.py`) leaves nothing behind on the node when
SIGTERM ends it (the end of a join job, scancel, a requeue), and restarts only an engine a restart can mend."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rltools.config import dump_config, load_config
from rltools.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]

# The supervisor with its engine replaced by a wait: it prints its node-local scratch directory.
SUPERVISOR = textwrap.dedent("""
    import sys, time
    import rltools.generate.supervisor as supervisor

    def engine(run_dir, paths, config, joined):
        print(joined.parent, flush=True)
        time.sleep(60)

    supervisor._run = engine
    supervisor.supervise(sys.argv[1])
""")


def test_sigterm_removes_the_supervisors_scratch_directory(tmp_path):
    paths = RunPaths(tmp_path / "run")
    paths.create()
    paths.config.write_text(dump_config(load_config(REPO / "configs" / "demo.yaml", [f"run.dir={paths.root}"])))
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(paths.root)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    try:
        scratch = Path(proc.stdout.readline().strip())
        assert scratch.is_dir()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert not scratch.exists(), f"{scratch} left behind"


@pytest.mark.parametrize("code, starts", [(1, 3), (2, 1), (4, 1)], ids=["crashed", "refused its input", "no judge left"])
def test_an_engine_is_started_again_unless_a_new_one_would_fail_alike(tmp_path, monkeypatch, code, starts):
    """A crash is restarted (up to generator.max_engine_restarts); bad input (exit 2) or the loss of every judge
    engine (exit 4, `JudgeLost`: a new engine would find none either) end the task at once."""
    from rltools.generate import supervisor

    paths = RunPaths(tmp_path / "run")
    paths.create()
    config = load_config(REPO / "configs" / "demo.yaml", [f"run.dir={paths.root}", "generator.max_engine_restarts=2"])
    started, popen = [], subprocess.Popen

    def engine(argv, env, preexec_fn):  # an engine that joined the run, then ended with `code`
        started.append(env[supervisor.ENGINE])
        Path(env[supervisor.JOINED]).touch()
        return popen([sys.executable, "-c", f"raise SystemExit({code})"])

    monkeypatch.setattr(supervisor.subprocess, "Popen", engine)
    assert supervisor._run(str(paths.root), paths, config, tmp_path / "joined") == code
    assert started == [str(restart) for restart in range(starts)]
