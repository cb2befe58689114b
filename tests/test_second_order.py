"""SecondOrder field (SPEC §3): damped oscillator closed form, the order-k chain, the blog block bridge."""

import math

import pytest
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.fields import SecondOrder


def linear(dim, omega2):
    f = torch.nn.Linear(dim, dim, bias=False)
    with torch.no_grad():
        f.weight.copy_(-omega2 * torch.eye(dim))
    return f


def test_damped_oscillator_closed_form(f64):
    """x'' + γ x' + ω² x = 0 (η = 1, f(x) = −ω² x), underdamped, against dopri5 to 1e-6."""
    gamma, omega2, T = 0.4, 4.0, 3.0
    field = SecondOrder(2, T=T, f=linear(2, omega2), gamma=gamma, eta=1.0)
    x0, v0 = torch.tensor([[1.0, -0.5]]), torch.tensor([[0.3, 0.2]])
    t = torch.linspace(0, T, 7)
    ys = ODEBlock(field, rtol=1e-10, atol=1e-10).trajectory(torch.cat([x0, v0], 1), t)
    wd = math.sqrt(omega2 - gamma**2 / 4)
    tt = t[:, None, None]
    exact = torch.exp(-gamma * tt / 2) * (x0 * torch.cos(wd * tt) + (v0 + gamma * x0 / 2) / wd * torch.sin(wd * tt))
    assert torch.allclose(ys[..., :2], exact, atol=1e-6, rtol=0)
    assert torch.allclose(field.gamma, torch.full((2,), gamma)) and torch.allclose(field.eta, torch.ones(2))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_order_k_equals_the_first_order_chain(f64, k):
    """order=k, no damping: q1' = q2, ..., qk' = η f(q1)."""
    field = SecondOrder(3, layers=2, order=k, damping=False, eta=0.7)
    y = torch.randn(5, 3 * k)
    out = field(0.2, y)
    qs = y.chunk(k, 1)
    chain = list(qs[1:]) + [0.7 * field.f.evaluate(0, qs[0])]
    assert torch.allclose(out, torch.cat(chain, 1), atol=1e-14)
    assert field.state_shape == (3 * k,)


def test_semi_implicit_euler_is_the_blog_block(f64):
    """v first then x, velocity scaled by h: m = 1 − hγ and η_blog = h² η (SPEC §3, B §8)."""
    L, T = 6, 1.5
    h = T / L
    field = SecondOrder(3, layers=L, T=T, gamma=0.8, eta=1.3, layer_norm=True)
    x0 = torch.randn(4, 3)
    net = discretize(field, "symplectic_euler_qp")
    out = net(torch.cat([x0, torch.zeros_like(x0)], 1))
    x, vt = x0, torch.zeros_like(x0)  # ṽ = h v
    m, eta_blog = 1 - h * field.gamma, h * h * field.eta
    for l in range(L):
        u = field.f.evaluate(l, x)  # f_l(LN(x_l))
        vt = m * vt + eta_blog * u
        x = x + vt
    assert torch.allclose(out[:, :3], x, atol=1e-12) and torch.allclose(out[:, 3:] * h, vt, atol=1e-12)
    assert net.architecture[0].startswith("second-order residual")


def test_errors():
    with pytest.raises(ValueError, match="`order` must be a positive integer"):
        SecondOrder(2, order=0)
    with pytest.raises(ValueError, match="`gamma` must be > 0"):
        SecondOrder(2, gamma=0.0)
    with pytest.raises(ValueError, match=r"`y0` has shape \(3, 5\), but SecondOrder expects \(batch, 4\)"):
        ODEBlock(SecondOrder(2))(torch.zeros(3, 5))
