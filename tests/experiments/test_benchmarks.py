"""Every benchmark runs in its tiny configuration, so none goes stale; numbers the construction fixes."""

from __future__ import annotations

import json
import pkgutil
from pathlib import Path

import pytest
import torch

import cde_nets.benchmarks
from cde_nets.benchmarks.__main__ import BENCHMARKS

# module -> (JSON file it writes in tiny mode, top-level keys, keys of every row)
EXPECTED = {
    "discrete_overhead": ("discrete_overhead", {"goal", "rows"}, {"net", "mode", "ours_s", "hand_s", "ratio_hand"}),
    "continuous_overhead": ("continuous_overhead", {"goal", "rows"}, {"ratio", "nfe_ours", "nfe_torchdiffeq"}),
    "memory_scaling": (
        "memory_scaling",
        {"rows", "summary", "goal", "discrete", "discrete_summary"},
        {"gradient", "steps", "saved_bytes"},
    ),
    "jump_nfe": ("jump_nfe", {"setting", "rows"}, {"rtol", "jumps", "nfe_forward", "max_error"}),
    "adjoint_study": ("adjoint_study_tiny", {"setting", "reference", "rows"}, {"mode", "method", "rel_grad_error"}),
    "stopping_scaling": (
        "stopping_scaling",
        {"setting", "goal", "rows", "fit"},
        {"mode", "fraction_early", "early_samples", "sum_depths", "time_s", "fit_s"},
    ),
    "stopping_saving": ("stopping_saving", {"setup", "rows_ratio", "timings"}, {"mode", "time_ratio"}),
    "momentum_peer": (
        "momentum_peer",
        {"rows"},
        {
            "depth",
            "memory_free",
            "max_abs_diff_output",
            "time_ratio",
            "memory_ratio",
            "saved_bytes_ours",
            "saved_bytes_theirs",
        },
    ),
    "training": ("training", {"setting", "reference", "rows"}, {"time_s", "test_accuracy"}),
    "gradient_modes": ("gradient_modes_tiny", {"setting", "rows", "targets"}, {"field", "method", "mode"}),
    "adjoint_pieces": (
        "adjoint_pieces",
        {"setting", "goal", "rows", "per_piece_growth"},
        {"pieces", "new_adjoint_s", "old_adjoint_s", "backprop_s", "new_over_backprop"},
    ),
    "finiteness": ("finiteness", {"goal", "rows", "worst_overhead"}, {"case", "checked_s", "unchecked_s", "overhead"}),
    "implicit_methods": (
        "implicit_methods",
        {"setting", "goal", "rows", "cost", "cost_vs_step"},
        {"method", "steps", "nfe", "rel_error"},
    ),
    "implicit_tolerance": (
        "implicit_tolerance",
        {"setting", "goal", "rows", "cost"},
        {"tol", "nfe_per_step", "slope_over_rk4", "max_over_first_percent"},
    ),
    "events": ("events", {"setting", "goal", "rows"}, {"ratio_to_ideal", "ratio_per_sample_to_ours", "fired"}),
    "forward_grid": (
        "forward_grid",
        {"setting", "goal", "rows"},
        {"dim", "batch", "nfe", "fe_s", "ours_s", "torchdiffeq_s", "torchode_s", "ours_over_fe"},
    ),
    "compiled": (
        "compiled",
        {"setting", "goal", "rows"},
        {"net", "mode", "eager_s", "compiled_s", "speedup", "max_rel_diff", "graphs"},
    ),
    "compiled_step": (
        "compiled_step_tiny",
        {"setting", "goal", "rows", "spiral", "profile"},
        {"name", "ratio", "goal", "met"},
    ),
    "torchdiffeq_dropin": (
        "torchdiffeq_dropin_tiny",
        {"setting", "goal", "rows", "spiral"},
        {"dim", "batch", "mode", "ours_s", "torchdiffeq_s", "ratio", "max_abs_diff"},
    ),
    "torchdiffeq_suite": (
        "torchdiffeq_suite_tiny",
        {"counts", "total", "by_reason", "rows", "unexplained"},
        {"test", "outcome"},
    ),
    "per_sample": (
        "per_sample_tiny",
        {"setting", "goal", "torchode", "rows"},
        {"case", "mode", "shared_nfe", "per_sample_nfe", "shared_s", "per_sample_s", "ratio"},
    ),
    "per_sample_device": (
        "per_sample_device_tiny",
        {"setting", "goal", "torchode", "rows"},
        {"case", "batch", "mode", "device", "calls", "shared_s", "per_sample_s", "per_sample_over_shared"},
    ),
    "ensembles": (
        "ensembles_tiny",
        {"setting", "goal", "rows"},
        {"members", "vmap_s", "stacked_s", "per_sample_s", "loop_s", "vmap_over_stacked", "loop_over_vmap"},
    ),
    "forward_sensitivity": (
        "forward_sensitivity",
        {"setting", "rows", "crossover_params"},
        {"params", "forward_s", "backprop_s", "checkpoint_s", "adjoint_s", "forward_over_best_reverse"},
    ),
    "default_gradient": (
        "default_gradient",
        {"setting", "rows"},
        {"case", "solver", "default", "steps", "backprop_s", "checkpoint_over_backprop", "backprop_peak_bytes"},
    ),
    "interpolating_adjoint": (
        "interpolating_adjoint",
        {"setting", "rows", "slopes", "timing", "van_der_pol"},
        {"gradient", "steps", "saved_bytes"},
    ),
    "gauss_adjoint": (
        "gauss_adjoint",
        {"setting", "rows", "crossover_params"},
        {"params", "backprop_s", "adjoint_s", "gauss_s", "gauss_nfe_backward", "gauss_over_adjoint"},
    ),
    "binomial_checkpoint": (
        "binomial_checkpoint",
        {"setting", "rows"},
        {"budget", "steps", "stored_states", "recomputed_steps", "offline_optimum", "peak_rss_rise_bytes", "time_s"},
    ),
    "reversible_rk": ("reversible_rk", {"setting", "goal", "rows", "summary", "stability"}, {"case", "steps"}),
    "mixed_precision": (
        "mixed_precision",
        {"setting", "goal", "rows", "rtol_sweep", "spiral", "digits"},
        {"problem", "float32_loss", "bfloat16_loss", "rel_loss_diff", "saved_ratio", "time_ratio"},
    ),
}


def test_every_benchmark_module_is_in_the_suite_table():
    modules = {m.name for m in pkgutil.iter_modules(cde_nets.benchmarks.__path__)} - {"common", "__main__", "summary"}
    assert modules == {name for name, _, _ in BENCHMARKS} == set(EXPECTED)


# tiny runs over ~2 s on an idle machine (pytest -m "not slow" leaves them out)
SLOW = {
    "adjoint_study",
    "compiled",
    "compiled_step",
    "continuous_overhead",
    "discrete_overhead",
    "ensembles",
    "gradient_modes",
    "implicit_tolerance",
    "mixed_precision",
    "per_sample",
    "per_sample_device",
    "torchdiffeq_dropin",
}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name, _, _ in BENCHMARKS]
)
def test_tiny_run_writes_its_json(name, tiny_benchmark):
    file, keys, row_keys = EXPECTED[name]
    res, folder = tiny_benchmark(name)
    data = json.loads((folder / f"{file}.json").read_text())
    assert keys <= set(data) and "machine" in data
    if "skipped" in data:  # the peer package is optional
        assert data["skipped"] == "momentumnet not installed" and data["rows"] == []
        return
    rows = data["timings"] if name == "stopping_saving" else data["rows"]
    assert rows and all(row_keys <= set(r) for r in rows)
    headline = next(h for n, h, _ in BENCHMARKS if n == name)
    assert headline(res)  # the summary table can read this result


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
