"""What every benchmark's tiny run must write, and the check of it, shared by test_benchmarks.py and
test_benchmarks_heavy.py (the heaviest tiny runs sit in the second file, so that xdist, which hands out whole files,
puts them on another worker)."""

from __future__ import annotations

import json

import pytest

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

# checked in test_benchmarks_heavy.py: inductor compilations and the largest grids (together about half the tiny runs'
# time); every other benchmark is checked in test_benchmarks.py
HEAVY = ("compiled", "compiled_step", "gradient_modes", "per_sample_device")


def cases(heavy: bool) -> list:
    """The benchmarks one file checks, in the suite table's order, the slow ones marked."""
    names = [name for name, _, _ in BENCHMARKS if (name in HEAVY) == heavy]
    return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in names]


def check_tiny_json(name: str, tiny_benchmark) -> None:
    """The tiny run wrote its JSON with the expected keys, and the summary table can read its result."""
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
