"""Generator role entry point: `python -m jobs.generator RUN_DIR` (one per vLLM engine)."""

import sys

from jobs.common import run_role

if __name__ == "__main__":
    sys.exit(run_role("generator", sys.argv[1:]))
