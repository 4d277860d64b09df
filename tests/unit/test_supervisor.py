"""The generator task's supervisor (`generate/supervisor.py`) leaves nothing behind on the node when
SIGTERM ends it (the end of a join job, scancel, a requeue)."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

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
