"""The digits density experiment: the bits/dim accounting against closed forms, its tiny run against the identity
flow's closed form, and a resumed run against an uninterrupted one."""

from __future__ import annotations

import math

import pytest
import torch

from cde_nets.datasets import dequantize, digits
from cde_nets.experiments import flows_digits
from cde_nets.image_density import Affine, Logit, image_bits_per_dim
from cde_nets.train.trainer import snapshotting

D = torch.float64


@pytest.mark.parametrize("alpha", [0.0, 0.05])
def test_logit_preprocessing_of_a_logistic_model_is_uniform_in_pixel_space(alpha):
    """A standard logistic density on ``x = logit(α + (1 − 2α) y)`` is the uniform density ``1 − 2α`` on
    ``y ∈ [0, 1)^d``, so with L levels it scores ``log₂ L − log₂(1 − 2α)`` bits/dim whatever the pixels."""
    y = torch.rand(6, 64, dtype=D, generator=torch.Generator().manual_seed(0)) * 0.98 + 0.01
    x, logdet = Logit(alpha)(y)
    logistic = (-x - 2 * torch.nn.functional.softplus(-x)).sum(1)
    bpd = image_bits_per_dim(logistic, logdet, 64, 17)
    expected = math.log2(17) - math.log2(1 - 2 * alpha)
    torch.testing.assert_close(bpd, torch.full_like(bpd, expected), rtol=1e-12, atol=0)


def test_affine_preprocessing_of_a_uniform_model_scores_log2_levels():
    """The uniform density ``a^{−d}`` on ``x = a (y − ½) ∈ [−a/2, a/2)^d`` is 1 on the pixels: ``log₂ 256`` = 8
    bits/dim, the discrete uniform model's exact value."""
    y = torch.rand(5, 784, dtype=D, generator=torch.Generator().manual_seed(1))
    x, logdet = Affine(3.0)(y)
    bpd = image_bits_per_dim(torch.full((5,), -784 * math.log(3.0), dtype=D), logdet, 784, 256)
    torch.testing.assert_close(bpd, torch.full_like(bpd, 8.0), rtol=1e-14, atol=0)


def test_bad_preprocessing_settings_are_refused():
    with pytest.raises(ValueError, match="`alpha` must lie in"):
        Logit(0.5)
    with pytest.raises(ValueError, match="`scale` must be a positive"):
        Affine(0.0)


N_TEST = 8  # held-out digits (the tiny setting's 64 cost most of a run; the closed form below holds for each)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny run on ``N_TEST`` held-out digits, shared by the tests that read it (it changes nothing in it)."""
    return flows_digits.run("tiny", 0, tmp_path_factory.mktemp("flows_digits"), n_test=N_TEST)


@pytest.mark.slow
def test_flows_digits_tiny(tiny_run):
    res = tiny_run
    rows = {r["setting"]: r["ours"] for r in res["rows"]}
    # the untrained flow is the identity (zero last layer): log p(y) = log N(g(y)) + log |det ∂g/∂y|, by hand
    s = flows_digits.SETTINGS["tiny"]
    y = dequantize(digits(0, image=False).x_test[:N_TEST], 17, seed=1000).double()
    u = s["alpha"] + (1 - 2 * s["alpha"]) * y
    x = torch.log(u / (1 - u))
    log_p = -0.5 * x.square().sum(1) - 32 * math.log(2 * math.pi)
    log_p = log_p + (math.log(1 - 2 * s["alpha"]) - torch.log(u) - torch.log(1 - u)).sum(1)
    expected = float(((-log_p / 64 + math.log(17)) / math.log(2)).mean())
    assert rows["held-out bits/dim at initialisation (identity flow)"] == pytest.approx(expected, rel=1e-6)
    for variant in flows_digits.VARIANTS:
        assert rows[f"{variant}: steps in the budget"] == s["max_steps"]
        assert math.isfinite(rows[f"{variant}: held-out bits/dim"])
        assert rows[f"{variant}: forward NFE per step"] >= 6  # dopri5: at least one step of six evaluations
        # early stopping: the held-out number is that of the weights at the lowest validation bits/dim
        hist = next(r["history"] for r in res["rows"] if r["setting"] == f"{variant}: held-out bits/dim")
        assert len(hist) == s["max_steps"]  # snapshot_s = 0: a record, with its validation, after every step
        best = min(hist, key=lambda h: h["val_bpd"])
        assert rows[f"{variant}: step of the best validation"] == best["steps"]
        if best is hist[-1]:
            assert (
                rows[f"{variant}: held-out bits/dim"] == rows[f"{variant}: held-out bits/dim at the end of the budget"]
            )


@pytest.mark.slow
def test_a_resumed_run_ends_as_an_uninterrupted_one(tmp_path, tiny_run):
    """One step, snapshotted; resumed with a budget of two: the same numbers as two steps at once (the shared
    tiny run, made without snapshots)."""

    def measured(res):
        return [(r["setting"], r["ours"]) for r in res["rows"] if "CPU" not in r["setting"]]

    whole = tiny_run
    with snapshotting(tmp_path / "ckpt"):
        flows_digits.run("tiny", 0, tmp_path / "b", n_test=N_TEST, max_steps=1)
    with snapshotting(tmp_path / "ckpt", resume=True):
        resumed = flows_digits.run("tiny", 0, tmp_path / "b", n_test=N_TEST)
    assert measured(resumed) == measured(whole)
    assert len(list((tmp_path / "ckpt").glob("*.snapshot"))) == len(flows_digits.VARIANTS)
