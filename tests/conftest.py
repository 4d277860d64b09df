"""Test tiers by directory: tests/<tier>/ gets the `<tier>` marker (unit, integration, faults, slurm, gpu).

Run one tier with `pytest -m unit`. GPU tests skip without CUDA; Slurm tests skip without a
running local cluster unless RLTOOLS_REQUIRE_SLURM=1 (CI), where a missing cluster is a failure.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 threads were 2-5x slower under load here

TIERS = ("unit", "integration", "faults", "slurm", "gpu")
REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(item.fspath).relative_to(REPO / "tests").parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
