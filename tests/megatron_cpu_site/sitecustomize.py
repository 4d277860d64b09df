"""Test-only: trainer processes started with this directory first on PYTHONPATH run megatron-core on
CPU through the shim in tests/megatron_cpu.py (the repository root must be on PYTHONPATH too)."""

import os

if os.environ.get("RLTOOLS_ROLE") == "trainer":
    from tests.megatron_cpu import install

    install()
