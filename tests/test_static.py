"""Static checks that run with the suite: mypy on the library (``cde_nets`` with ``cde_nets.solvers``), ruff's
lint and ruff's formatter on the whole repository.

The configuration is ``[tool.mypy]`` in pyproject.toml; the test runs plain ``mypy`` with it, exactly what a
developer runs from the repository root. Cache in ``.mypy_cache`` (git-ignored): about 20 s cold, a few warm.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_library_has_no_errors() -> None:
    # mypy reaches solvers/ as cde_nets.solvers through this symlink (see [tool.mypy] in pyproject.toml).
    link = ROOT / "typecheck" / "cde_nets" / "solvers"
    assert (link / "__init__.py").is_file(), (
        f"{link} must be a symlink to ../../solvers (a checkout without symlink support breaks it); "
        "without it mypy cannot resolve cde_nets.solvers."
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mypy reported errors (exit {proc.returncode}):\n{output}"
    assert "Success: no issues found" in proc.stdout, output


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_is_clean(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
