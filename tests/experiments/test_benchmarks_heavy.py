"""The heaviest benchmarks' tiny runs (inductor compilations, the largest grids), checked as test_benchmarks.py
checks the others; a file of their own, so that xdist, which hands out whole files, runs them beside that one."""

from __future__ import annotations

import pytest
from benchmark_cases import cases, check_tiny_json


@pytest.mark.parametrize("name", cases(heavy=True))
def test_tiny_run_writes_its_json(name, tiny_benchmark):
    check_tiny_json(name, tiny_benchmark)
