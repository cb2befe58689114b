"""Every benchmark runs in its tiny configuration, so none goes stale (the heaviest in test_benchmarks_heavy.py);
numbers the construction fixes, read off the tiny runs (shared, once per session, with the JSON checks)."""

from __future__ import annotations

import json
import pkgutil
from pathlib import Path

import pytest
import torch
from benchmark_cases import EXPECTED, HEAVY, cases, check_tiny_json

import cde_nets.benchmarks
from cde_nets.benchmarks.__main__ import BENCHMARKS


def test_every_benchmark_module_is_in_the_suite_table():
    modules = {m.name for m in pkgutil.iter_modules(cde_nets.benchmarks.__path__)} - {"common", "__main__", "summary"}
    assert modules == {name for name, _, _ in BENCHMARKS} == set(EXPECTED)
    assert set(HEAVY) < set(EXPECTED)  # test_benchmarks_heavy.py checks these, this file the others


@pytest.mark.parametrize("name", cases(heavy=False))
def test_tiny_run_writes_its_json(name, tiny_benchmark):
    check_tiny_json(name, tiny_benchmark)


def test_stopping_depths_are_the_designed_ones(tmp_path):
    """Early samples start at equilibrium (depth 1), the others run max_depth = 4 steps: Σ depths is exact."""
    from cde_nets.benchmarks.stopping_scaling import run

    res = run(tiny=True, out_dir=tmp_path)
    batch, max_depth = 16, 4
    for r in res["rows"]:
        assert r["early_samples"] == round(r["fraction_early"] * batch)
        assert r["sum_depths"] == r["early_samples"] + (batch - r["early_samples"]) * max_depth


def test_momentum_peer_matches_and_memory_free_keeps_two_states(tmp_path):
    """Same map as momentumnet to 1e-10 in float64; memory-free saves only (x_L, v_L): 2 · batch · dim float32s."""
    pytest.importorskip("momentumnet")
    from cde_nets.benchmarks.momentum_peer import run

    res = run(tiny=True, out_dir=tmp_path)
    for r in res["rows"]:
        assert r["max_abs_diff_output"] < 1e-10 * max(1.0, r["output_scale"])
        assert r["max_abs_diff_grad"] < 1e-10 * max(1.0, r["grad_scale"])
        if r["memory_free"]:
            assert r["saved_bytes_ours"] == 2 * r["batch"] * r["dim"] * 4
            assert r["max_abs_diff_output_vs_peer_memory_free"] < 1e-5  # the peer keeps v in float32


def _summary_lines(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]


def test_tiny_summary_says_what_it_checks_and_shows_no_goal_nor_unmeasured_figures(capsys):
    from cde_nets.benchmarks.__main__ import main

    assert main(["--tiny", "--only", "training", "forward_grid", "finiteness"]) == 0
    out = capsys.readouterr().out
    assert "tiny run: every benchmark ran at its smallest size to check that it works" in out
    rows = _summary_lines(out)
    assert rows[0] == ["benchmark", "measure", "value"]  # no goal column
    values = [r[2] for r in rows[1:]]
    assert values and not [v for v in values if v in ("nan", "0.00", "0.000") or v.startswith("nan")]
    # the tiny swiss-roll run takes a fraction of a second against the reference's 36 s: no figure, no 0.00
    assert ["training", "64-layer H1 swiss roll: wall time / reference's 36 s", "not measured"] in rows


def test_full_summary_of_the_recorded_results_says_met_or_missed_for_every_goal():
    from cde_nets.benchmarks.summary import table

    rows = []
    for name, headline, _ in BENCHMARKS:
        recorded = Path(cde_nets.benchmarks.__path__[0]) / "results" / f"{name}.json"
        rows += [(name, row) for row in headline(json.loads(recorded.read_text()))]
    text = table(rows, tiny=False)
    lines = _summary_lines(text)
    assert lines[0] == ["benchmark", "measure", "value", "goal", "met"]
    for name, measure, value, goal, met in lines[1:]:
        assert value not in ("nan", "0.00", "0.000"), (name, measure)
        assert (met in ("met", "MISSED")) == (goal != "—" and value != "not measured"), (name, measure, goal, met)
    judged = [line[4] for line in lines[1:] if line[4]]
    assert f"goals met: {judged.count('met')} of {len(judged)}" in text


def test_value_text_never_prints_nan_or_a_zero_ratio():
    from cde_nets.benchmarks.summary import at_most, value_text

    assert value_text(float("nan"), ".2f") == value_text(None, ".2f") == value_text(0.0001, ".2f") == "not measured"
    assert value_text(0.0, ".1e") == "0.0e+00" and value_text(0.004, "+.1%") == "+0.4%"
    assert at_most("r", 1.2, 1.1).met is False and at_most("r", 1.0, 1.1).met is True
    assert at_most("r", float("nan"), 1.1).met is None and at_most("p", 0.02, 0.03, "+.1%").goal == "<= 3%"


@pytest.mark.slow
def test_dropin_spiral_with_torchdiffeqs_steps_has_torchdiffeqs_losses(tiny_benchmark):
    """The race's third runner, ``Backprop(steps="torchdiffeq")``, trains on torchdiffeq's gradients bit for bit,
    so its losses equal torchdiffeq's exactly in both dtypes (the default differentiates every step size). The
    races are the tiny benchmark run's (three iterations in each dtype), shared with the test above."""
    spiral = tiny_benchmark("torchdiffeq_dropin")[0]["spiral"]
    for dtype in (torch.float32, torch.float64):
        race = spiral[str(dtype).removeprefix("torch.")]
        assert race["iterations"] == 3
        assert race["torchdiffeq_steps"]["losses_equal"], (dtype, race["torchdiffeq_steps"]["max_loss_diff"])
        assert race["torchdiffeq_steps"]["max_loss_diff"] == 0.0


@pytest.mark.slow
def test_adjoint_study_benchmark_has_a_row_for_every_registered_gradient(tiny_benchmark):
    """Every problem has a row for every registered gradient method; refused and failed cells carry a message."""
    from cde_nets.solvers.gradients import GRADIENTS

    study, folder = tiny_benchmark("adjoint_study")
    data = json.loads((folder / "adjoint_study_tiny.json").read_text())
    problems = set(data["reference"])
    assert len(problems) == 3 and {r["problem"] for r in data["rows"]} == problems
    for problem in problems:
        modes = {r["mode"] for r in data["rows"] if r["problem"] == problem}
        assert {cls().describe() for cls in GRADIENTS.values()} <= modes
    assert all(r["status"] == "ok" or r.get("refused") or r.get("error") for r in data["rows"])
    assert all("rel_grad_error" in r for r in data["rows"])
    assert [r["method"] for r in data["rows"] if r["problem"].startswith("Van der Pol")] == ["radauIIA5"] * (
        len(GRADIENTS) + 1
    )


@pytest.mark.slow
def test_bfloat16_training_ends_within_the_tolerance_of_float32(tiny_benchmark):
    """The mixed-precision benchmark's tiny run: bfloat16 autocast training ends within the stated tolerance of
    float32's final loss on both problems, and the field evaluations it counts are the solves' own."""
    from cde_nets.benchmarks.mixed_precision import LOSS_TOLERANCE, U

    res, _ = tiny_benchmark("mixed_precision")
    rows = {r["problem"]: r for r in res["rows"]}
    assert set(rows) == {"spiral", "digits"}
    for r in rows.values():
        # one seed: the tolerance is LOSS_TOLERANCE relative
        assert r["tolerance"] == LOSS_TOLERANCE * r["float32_loss"] and r["within_tolerance"]
        assert r["rel_loss_diff"] <= LOSS_TOLERANCE
        assert r["float32_loss"] != r["bfloat16_loss"]  # the two trainings are not one computation
        # dopri5 evaluates the field 6 times a step plus its first step's two: 6n + 2
        assert r["float32_nfe"] % 6 == 2 and r["bfloat16_nfe"] % 6 == 2
    # at rtol = u the bfloat16 solve is accurate to u against float64 (measured 2.7e-3 = 0.69 u)
    sweep = {r["precision"]: r for r in res["rtol_sweep"] if r["rtol"] == U}
    assert sweep["bfloat16"]["rel_error"] <= U
    width = res["memory_by_width"][0]
    assert width["float32_saved_bytes_per_eval"] > 0 and width["bfloat16_saved_bytes_per_eval"] > 0
