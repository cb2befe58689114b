"""The README's test command is the one CI runs, and its links into the docs exist. (The build itself, ``mkdocs
build --strict``, is asserted in test_docs_site.py, the one file that reads the built site, so that the suite builds
it once.)"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
