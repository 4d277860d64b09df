"""Judge role entry point: `python -m rltools.jobs.judge RUN_DIR` (one per judge engine; reward.judge)."""

import sys

from rltools.jobs.common import run_role

if __name__ == "__main__":
    sys.exit(run_role("judge", sys.argv[1:]))
