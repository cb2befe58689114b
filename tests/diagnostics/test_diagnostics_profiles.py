"""Depth profiles (B §8, S §4.3) on sequences with closed-form values."""

import pytest
import torch

from cde_nets.diagnostics import (
    cosine_profile,
    depth_profile,
    norm_profile,
    perturbation_ratio,
    piece_gradient_norms,
)
from cde_nets.fields import CubicFriction


def test_profiles_of_a_geometric_sequence(f64):
    """x_l = 1.1^l x_0: ‖x_l‖ = 1.1^l ‖x_0‖, successive updates parallel, ratio exactly 0.1."""
    x0 = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    states = [1.1**l * x0 for l in range(6)]
    assert torch.allclose(norm_profile(states), 1.1 ** torch.arange(6.0) * x0.norm(dim=1).mean())
    assert perturbation_ratio(states) == pytest.approx(0.1, rel=1e-12)
    p = depth_profile(states)
    assert torch.allclose(p["update_cosine"], torch.ones(4))


def test_alternating_updates_have_cosine_minus_one(f64):
    u = torch.randn(4, 2, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(cosine_profile([u, -u, u]), -torch.ones(2))


def test_gradient_profiles(f64):
    f = CubicFriction(2, layers=3, zero_init=False)
    x = torch.randn(4, 2, requires_grad=True)
    states = [x]
    for l in range(3):
        states.append(states[-1] + f.grid.h * f.evaluate(l, states[-1]))
    loss = states[-1].pow(2).sum()
    p = depth_profile(states, loss)
    assert p["grad_norms"][-1] == pytest.approx(float((2 * states[-1].detach()).norm(dim=1).mean()))
    loss.backward()
    norms = piece_gradient_norms(f)
    assert norms.shape == (3,)
    expect = (f.W.data.grad.flatten(1).pow(2).sum(1) + f.b.data.grad.pow(2).sum(1)).sqrt()
    assert torch.allclose(norms, expect)
    with pytest.raises(ValueError, match="at least two"):
        norm_profile([x])
