"""Tiny run of the 2-D flow reproduction: every row present and finite, the entropy reference correct."""

from __future__ import annotations

import math

import pytest

from cde_nets.experiments import flows_2d


def test_flows_2d_tiny(tmp_path):
    res = flows_2d.run("tiny", 0, tmp_path)
    rows = {r["setting"]: r for r in res["rows"]}
    for variant in flows_2d.VARIANTS:
        nll = rows[f"eight_gaussians, {variant}: test NLL"]["ours"]
        # a few steps from a near-identity flow: NLL between the data's entropy and a wide Gaussian's
        assert 2.8 < nll < 12.0
        nfe = rows[f"eight_gaussians, {variant}: forward NFE (training)"]["ours"]
        if variant.endswith("rk4"):  # four steps of 0.25 over [0, 1], four stages each, in each of 2 steps
            assert nfe == 2 * 16
        else:
            assert nfe >= 2 * 6  # dopri5: ≥ 6 per step
        hist = res["curves"][f"eight_gaussians/{variant}"][0]
        assert len(hist) == 1 and hist[0]["time_s"] > 0
    # the mixture's entropy, log 8 + log(2πeσ²) less the overlap of the components (tiny here)
    entropy = rows["eight_gaussians: entropy (lowest reachable NLL)"]["ours"]
    assert entropy == pytest.approx(math.log(8 * 2 * math.pi * math.e * 0.125), abs=0.02)
    assert rows["eight_gaussians: time ratio (unreg / reg)"]["published"] == 2.8
    assert "eight_gaussians: forward NFE ratio (unreg / reg) (kinetic+jacobian, rk4)" in rows
    assert all(p.endswith(".png") for p in res["figures"])


def test_flows_2d_runs_three_seeds_at_the_full_setting():
    from cde_nets.experiments.seeds import default_seeds

    assert default_seeds("flows_2d", "full") == 3 and default_seeds("flows_2d", "quick") == 1


def test_the_long_setting_is_the_full_one_trained_longer_with_a_stronger_lambda_beside_it():
    full, long = flows_2d.SETTINGS["full"], flows_2d.SETTINGS["long"]
    assert long["epochs"] * long["steps"] == 3000 and set(long["densities"]) == set(flows_2d.DENSITIES)
    same = ("steps", "batch", "hidden", "lr", "T", "lam", "tol", "n")
    assert {k: long[k] for k in same} == {k: full[k] for k in same}
    assert long["variants"] == ("unregularised", "kinetic+jacobian", "kinetic+jacobian, λ = 0.2")
    run = flows_2d.FlowRun("eight_gaussians", 0, "kinetic+jacobian, λ = 0.2", flows_2d.SETTINGS["tiny"])
    assert run.weights == {"kinetic": 0.2, "jacobian": 0.2}  # the variant's λ, not the setting's 0.01
    regularised = flows_2d.FlowRun("eight_gaussians", 0, "kinetic+jacobian", long)
    assert regularised.weights == {"kinetic": 0.05, "jacobian": 0.05}
