"""Installing cde_nets puts no generic top-level name on ``sys.path``: the repository's ``solvers/``,
``experiments/`` and ``benchmarks/`` folders install as ``cde_nets.solvers`` and so on, so a user's own
``solvers.py`` (or ``experiments.py``, ``benchmarks.py``) next to their script breaks neither the library nor the
command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHADOWS = ("solvers", "experiments", "benchmarks")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def shadowed(tmp_path: Path) -> Path:
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    return tmp_path


@pytest.mark.slow
def test_library_imports_beside_a_users_generic_modules(shadowed: Path):
    code = (
        "import cde_nets, cde_nets.solvers, cde_nets.experiments.registry, cde_nets.benchmarks; "
        "from cde_nets.solvers import SCHEMES; print(len(SCHEMES) > 0)"
    )
    out = _run([sys.executable, "-c", code], shadowed)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


@pytest.mark.slow
def test_command_line_beside_a_users_generic_modules(shadowed: Path):
    exe = shutil.which("cde-nets", path=str(Path(sys.executable).parent))
    assert exe is not None, "the cde-nets console script is not installed"
    out = _run([exe, "experiments", "--list"], shadowed)
    assert out.returncode == 0, out.stderr
    assert "hdnn_table1" in out.stdout
    out = _run([sys.executable, "-m", "cde_nets.experiments", "--list"], shadowed)
    assert out.returncode == 0, out.stderr
    assert "hdnn_table1" in out.stdout


def test_no_generic_top_level_package_is_installed(tmp_path: Path):
    code = f"import importlib.util as u; print([n for n in {SHADOWS!r} if u.find_spec(n) is not None])"
    out = _run([sys.executable, "-c", code], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_subpackage_is_listed_for_a_regular_install():
    """A regular (non-editable) install ships only the packages ``pyproject.toml`` lists: a folder left out (as
    ``solvers/gradients`` once was) installs a library whose ``import cde_nets`` fails."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    dirs = {name: root / path for name, path in tool["package-dir"].items()} | {"cde_nets": root / "cde_nets"}
    found = set()
    for name, base in dirs.items():
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; stale: {sorted(listed - found)}"
