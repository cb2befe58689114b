"""Every running time the listing states is measured by experiments/timings.py and stored with its date, the
machine's facts and the load; the ``all`` row is the sum of its column. (The README's main-job time is checked
against the stored one in tests/docs/test_docs_site_claims.py.)"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from cde_nets.experiments import timings
from cde_nets.experiments.__main__ import _seconds, listing
from cde_nets.experiments.registry import REPRODUCTIONS, SETTINGS, times, total


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


@pytest.mark.slow
def test_the_timing_script_measures_one_reproduction(tmp_path):
    # the cheapest reproduction (under a second of training): the child process's imports are most of its time
    out = tmp_path / "timings.json"
    assert timings.main(["--size", "tiny", "--only", "noise_robustness", "--out", str(out)]) == 0
    entry = json.loads(out.read_text())["tiny"]["noise_robustness"]
    assert 0 < entry["seconds"] < 300 and entry["machine"]["torch_threads"] == 1


def test_the_main_job_is_timed_after_the_readmes_install_in_a_fresh_clone(monkeypatch):
    """The install runs first and is not timed; the job is the README's own command, run in the clone."""
    ran = []

    def run(cmd, **kw):
        ran.append((cmd, kw.get("cwd")))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(timings.subprocess, "run", run)
    entry = timings.time_main_job()
    install, job = timings.main_job_command().rsplit(" && ", 1)
    (clone, _), (setup, where), (timed, there) = ran
    assert clone[:3] == ["git", "clone", "-q"] and str(where) == str(there) == clone[-1]
    assert setup == ["bash", "-c", install] and install.endswith('-e ".[experiments]"')
    assert timed == ["bash", "-c", job] and job == ".venv/bin/python -m cde_nets.experiments all --quick"
    assert entry["command"] == ["-m", "cde_nets.experiments", "all", "--quick"] and entry["threads"]["default"] == 1
