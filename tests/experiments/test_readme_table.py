"""The documentation's generated pages (the reproductions' tables from the recorded JSON, the scheme ↔
architecture table from the code) are committed exactly as generated: nothing is typed by hand. After a new
recorded run or a new table row: ``python -m cde_nets.experiments.readme_table``."""

from pathlib import Path

from cde_nets.experiments.readme_table import main

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_generated_docs_pages_are_current():
    assert main(["--check", "--docs", str(DOCS)]) == 0


def test_the_reproductions_page_shows_every_figure_before_the_margins_table():
    page = (DOCS / "reproductions.md").read_text()
    margins = page.index("## Margins")
    figures = sorted(p.name for p in (DOCS / "figures").glob("*.png") if f"(figures/{p.name})" in page)
    assert len(figures) >= 8
    assert all(page.index(f"(figures/{name})") < margins for name in figures)
