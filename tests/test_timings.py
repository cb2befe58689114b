"""Every running time the listing states is measured by experiments/timings.py and stored with its date, the
machine's facts and the load; the ``all`` row is the sum of its column."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cde_nets.experiments import timings
from cde_nets.experiments.__main__ import _seconds, listing
from cde_nets.experiments.registry import REPRODUCTIONS, SETTINGS, times, total

ROOT = Path(__file__).resolve().parents[1]


def test_every_stored_time_says_when_and_where_it_was_measured():
    data = timings.load_timings()
    entries = [e for size in SETTINGS for e in data.get(size, {}).values()]
    assert len(data.get("tiny", {})) == len(REPRODUCTIONS)  # the tiny setting is measured for every one
    for e in entries + ([data["main_job"]] if "main_job" in data else []):
        assert e["seconds"] > 0 and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", e["date"])
        assert {"cpu", "cores", "torch", "torch_threads"} <= set(e["machine"]) and "load_before" in e


def test_the_all_row_is_the_sum_of_its_column():
    rows = {line.split()[0]: line for line in listing().splitlines() if line.startswith("  ") and line.split()}
    cells = rows["all"].split("every one")[0].split()[1:]
    for size, cell in zip(SETTINGS, [c for c in re.findall(r"—|<1 s|\d+ (?:s|min)\*?", " ".join(cells))]):
        each = [times(name).get(size) for name in REPRODUCTIONS]
        expected = None if None in each else sum(each)
        assert total(size) == expected
        assert cell.rstrip("*") == _seconds(expected), (size, cell)


def test_the_timing_script_measures_one_reproduction(tmp_path):
    out = tmp_path / "timings.json"
    assert timings.main(["--size", "tiny", "--only", "hdnn_fig4", "--out", str(out)]) == 0
    entry = json.loads(out.read_text())["tiny"]["hdnn_fig4"]
    assert 0 < entry["seconds"] < 300 and entry["machine"]["torch_threads"] == 1


def test_the_readme_states_the_measured_main_job_time_or_none():
    readme = (ROOT / "README.md").read_text()
    stated = re.findall(r"(\d+)\s+min\s+(\d+)\s+s\s+measured", readme)
    job = timings.load_timings().get("main_job")
    if job is None:
        assert stated == [], "the README states a main-job time that experiments/timings.py never measured"
    else:
        m, s = divmod(round(job["seconds"]), 60)
        assert stated == [(str(m), str(s))]
    assert "all --quick" in timings.main_job_command()
