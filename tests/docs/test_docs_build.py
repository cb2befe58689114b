"""The documentation site builds with ``mkdocs build --strict``: every page in the nav exists, every link and
anchor resolves, and mkdocstrings renders every API page from the docstrings (including ``cde_nets.solvers``,
found through the installed package)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed: pip install -e '.[docs]'")


@pytest.mark.slow
def test_mkdocs_build_strict(built_site):
    site, proc = built_site
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    api = (site / "api" / "discrete" / "index.html").read_text()
    assert 'id="cde_nets.solvers.schemes.Scheme"' in api  # the installed-only subpackage was found
    assert ":class:" not in api  # Sphinx roles render as code, not as markup
    assert (site / "reproductions" / "index.html").exists()


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3.11 -m venv") and "pytest" in line]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3.11")]
    assert len(commands) == 1 and ci == commands, (commands, ci)


def test_readme_links_into_the_docs_exist():
    import re

    targets = re.findall(r"\]\((docs/[^)#\s]+)", (ROOT / "README.md").read_text())
    assert targets
    assert [t for t in targets if not (ROOT / t).exists()] == []
