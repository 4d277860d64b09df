"""Generator role entry point: `python -m rltools.jobs.generator RUN_DIR` (one per vLLM engine)."""

import sys

from rltools.jobs.common import run_role

if __name__ == "__main__":
    sys.exit(run_role("generator", sys.argv[1:]))
