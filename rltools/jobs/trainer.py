"""Trainer role entry point: `python -m rltools.jobs.trainer RUN_DIR` (one per trainer rank)."""

import sys

from rltools.jobs.common import run_role

if __name__ == "__main__":
    sys.exit(run_role("trainer", sys.argv[1:]))
