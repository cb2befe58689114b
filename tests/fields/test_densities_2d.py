"""The 2-D flow densities: closed-form densities normalised, samples distributed as documented, determinism,
dequantisation."""

import math

import pytest
import torch

from cde_nets import datasets as ds


def _all(name, n, seed=0):
    d = ds.density_2d(name, n, seed=seed, dtype=torch.float64)
    return torch.cat([d.x_train, d.x_test]), torch.cat([d.y_train, d.y_test])


@pytest.mark.parametrize("name", ["eight_gaussians", "checkerboard"])
def test_closed_form_densities_integrate_to_one(name):
    h = 0.01
    g = torch.arange(-6 + h / 2, 6, h, dtype=torch.float64)
    grid = torch.cartesian_prod(g, g)
    total = ds.density_2d_log_prob(name, grid).exp().sum() * h * h
    assert float(total) == pytest.approx(1.0, abs=1e-6)


def test_eight_gaussians_mass_within_three_sigma_of_each_component():
    """``P(‖x − μ_k‖ < 3σ) = 1 − e^{−9/2}`` for a 2-D Gaussian; 20000 samples, within 3 standard errors."""
    x, k = _all("eight_gaussians", 20000)
    mu = 2 * math.sqrt(2) * torch.stack([torch.cos(k * math.pi / 4), torch.sin(k * math.pi / 4)], 1)
    inside = ((x - mu).norm(dim=1) < 3 * 0.5 / math.sqrt(2)).double()
    p = 1 - math.exp(-4.5)
    assert abs(float(inside.mean()) - p) < 3 * math.sqrt(p * (1 - p) / len(x))
    assert torch.isfinite(ds.density_2d_log_prob("eight_gaussians", x)).all()


def test_checkerboard_covers_the_dark_squares_uniformly():
    x, k = _all("checkerboard", 16000)
    assert torch.isfinite(ds.density_2d_log_prob("checkerboard", x)).all()
    counts = torch.bincount(k, minlength=8).double()
    assert len(counts) == 8 and float(((counts - 2000) ** 2 / 2000).sum()) < 24.3  # χ²(7) at 0.001
    assert float(ds.density_2d_log_prob("checkerboard", torch.tensor([[1.0, -1.0]]))) == -math.inf


def test_rings_radii_and_noise():
    x, ring = _all("rings", 20000)
    dr = x.norm(dim=1) - 0.75 * (ring + 1)
    assert abs(float(dr.mean())) < 3 * 0.08 / math.sqrt(len(x))
    assert float(dr.std()) == pytest.approx(0.08, rel=0.03)


def test_two_moons_and_pinwheel_components():
    x, moon = _all("two_moons", 4000)
    u = (x - torch.tensor([-1.0, -0.2], dtype=torch.float64)) / 2  # back to the unit arcs plus N(0, 0.1²)
    centre = torch.where(moon[:, None] == 0, 0.0, torch.tensor([1.0, 0.5], dtype=torch.float64))
    dist = (u - centre).norm(dim=1) - 1
    assert float(dist.abs().mean()) < 0.1 and set(moon.tolist()) == {0, 1}
    x, arm = _all("pinwheel", 5000)
    assert set(arm.tolist()) == set(range(5)) and float((x.norm(dim=1) / 2).mean()) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("name", ds.DENSITIES_2D)
def test_seeded_and_deterministic(name):
    a, b, c = (ds.density_2d(name, 200, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.x_train, b.x_train) and not torch.equal(a.x_train, c.x_train)
    assert a.x_train.shape == (100, 2) and a.x_train.dtype == torch.float32


def test_dequantize_keeps_the_pixel_level_and_fills_its_bin():
    x = ds.digits(seed=0).x_train.double()
    y = ds.dequantize(x, 17, seed=1)
    assert float(y.min()) >= 0 and float(y.max()) < 1
    assert torch.equal(torch.floor(y * 17), torch.round(x * 16))
    u = y * 17 - torch.floor(y * 17)
    assert abs(float(u.mean()) - 0.5) < 3 * math.sqrt(1 / 12 / u.numel())


def test_errors():
    with pytest.raises(ValueError, match="`name` must be one of"):
        ds.density_2d("spiral")
    with pytest.raises(ValueError, match="closed-form density only"):
        ds.density_2d_log_prob("rings", torch.zeros(1, 2))
    with pytest.raises(ValueError, match="`levels` must be"):
        ds.dequantize(torch.zeros(2), 1)
