"""The README's results and margin tables are the ones generated from the recorded JSON (issue 6: nothing typed by
hand). After a new recorded run: ``python -m cde_nets.experiments.readme_table``."""

from pathlib import Path

from cde_nets.experiments.readme_table import main


def test_readme_results_table_is_generated_from_the_recorded_runs():
    readme = Path(__file__).resolve().parents[1] / "README.md"
    assert main(["--check", "--readme", str(readme)]) == 0
