"""The documentation's generated pages (the reproductions' tables from the recorded JSON, the scheme ↔
architecture table from the code) are committed exactly as generated: nothing is typed by hand. After a new
recorded run or a new table row: ``python -m cde_nets.experiments.readme_table``."""

from pathlib import Path

from cde_nets.experiments.readme_table import main

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_generated_docs_pages_are_current():
    assert main(["--check", "--docs", str(DOCS)]) == 0
