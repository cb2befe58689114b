"""Cubic-friction field against Ruseckas's closed forms (Ruseckas, R §4.1)."""

import math

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.fields import CubicFriction, CubicFrictionConv


def field_with(dim=1, w=None, b=None, gamma=0.5, learn_gamma=False, T=1.0):
    f = CubicFriction(dim, T=T, gamma=gamma, learn_gamma=learn_gamma)
    with torch.no_grad():
        if w is not None:
            f.W.data[0] = torch.as_tensor(w)
        if b is not None:
            f.b.data[0] = torch.as_tensor(b)
    return f


def test_eq_R87_free_decay(f64):
    """w = b = 0: x(t) = x0 / sqrt(1 + 2 γ x0² t)."""
    gamma, T = 0.7, 3.0
    f = field_with(2, gamma=gamma, T=T)
    x0 = torch.tensor([[1.5, -0.4], [3.0, 0.1]])
    t = torch.linspace(0, T, 7)
    xs = ODEBlock(f, rtol=1e-11, atol=1e-12).solve(x0, t=t).ys
    exact = x0 / torch.sqrt(1 + 2 * gamma * x0**2 * t[:, None, None])
    assert torch.allclose(xs, exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("w", [-0.8, 0.6])
def test_eq_R85_linear_plus_cubic(f64, w):
    """Diagonal constant w, b = 0: x(t) = x0 e^{wt} / sqrt(1 + (γ x0²/w)(e^{2wt} − 1))."""
    gamma, T = 0.3, 2.0
    f = field_with(1, w=[[w]], gamma=gamma, T=T)
    x0 = torch.tensor([[0.9], [-2.0]])
    t = torch.linspace(0, T, 5)
    xs = ODEBlock(f, rtol=1e-11, atol=1e-12).solve(x0, t=t).ys
    e = torch.exp(w * t)[:, None, None]
    exact = x0 * e / torch.sqrt(1 + gamma * x0**2 / w * (e**2 - 1))
    assert torch.allclose(xs, exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("gradient", ["adjoint", "backprop"])
def test_eq_R90_gradient(f64, gradient):
    """a(0) = a(T) (1 / (1 + 2γ x0² T))^{3/2} and ∂x(T)/∂γ = −x0³ T (1 + 2γ x0² T)^{-3/2}."""
    gamma, T = 0.4, 2.5
    f = CubicFriction(1, T=T, gamma=gamma, learn_gamma=True)
    x0 = torch.tensor([[1.2]], requires_grad=True)
    xT = ODEBlock(f, rtol=1e-11, atol=1e-12, gradient=gradient)(x0)
    gx, graw = torch.autograd.grad(xT.sum(), (x0, f.friction.gamma_raw))
    s = 1 + 2 * gamma * 1.2**2 * T
    assert math.isclose(gx.item(), s**-1.5, rel_tol=1e-6)
    dgamma = graw.item() / torch.sigmoid(f.friction.gamma_raw).item()  # γ = softplus(raw)
    assert math.isclose(dgamma, -(1.2**3) * T * s**-1.5, rel_tol=1e-6)


def test_stationary_value(f64):
    """w = 0, constant b: x → (b/γ)^{1/3} (eq. R92), from both sides."""
    b, gamma = 0.5, 2.0
    f = field_with(1, b=[b], gamma=gamma, T=200.0)
    xT = ODEBlock(f, rtol=1e-10, atol=1e-12)(torch.tensor([[0.0], [3.0]]))
    assert torch.allclose(xT, torch.full_like(xT, (b / gamma) ** (1 / 3)), rtol=1e-8, atol=0)


def test_noether_charge_is_constant(f64):
    """a(t)·F(x(t)) is constant along a time-invariant trajectory (eq. R24)."""
    g = torch.Generator().manual_seed(0)
    f = CubicFriction(3, T=2.0, gamma=0.8, zero_init=False, generator=g)
    with torch.no_grad():
        f.b.data.normal_(0, 0.5, generator=g)
    x0 = torch.randn(1, 3, generator=g)
    c = torch.randn(1, 3, generator=g)
    T = 2.0
    charges = []
    for t in (0.0, 0.5, 1.0, 1.5):
        xt = x0 if t == 0 else ODEBlock(f, T=t, rtol=1e-12, atol=1e-13, gradient="backprop")(x0)
        xt = xt.detach().requires_grad_(True)
        xT = ODEBlock(f, T=T - t, rtol=1e-12, atol=1e-13, gradient="backprop")(xt)
        (a,) = torch.autograd.grad((c * xT).sum(), xt)
        charges.append((a * f(0.0, xt)).sum().item())
    assert max(charges) - min(charges) < 1e-6 * max(abs(q) for q in charges)


def test_divergence_is_the_trace(f64):
    f = CubicFriction(4, gamma=0.6, zero_init=False)
    x = torch.randn(3, 4)
    jac = torch.autograd.functional.jacobian(lambda z: f.evaluate(0, z).sum(0), x)  # (4, 3, 4)
    traces = torch.stack([torch.diagonal(jac[:, i, :]).sum() for i in range(3)])
    assert torch.allclose(f.divergence(0, x), traces, atol=1e-12)


def test_generalised_power(f64):
    f = CubicFriction(2, gamma=0.5, mu=2.5, learn_gamma=False)
    x = torch.tensor([[-2.0, 3.0]])
    assert torch.allclose(f(0.0, x), -0.5 * torch.sign(x) * x.abs() ** 2.5)


def test_parameter_counts_match_ruseckas():
    """Models 1 and 2 of R §5.1 (601, 240) and the MNIST convolution (18 201)."""
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(CubicFriction(2, layers=100, T=100.0)) == 601
    assert n(CubicFriction(3, layers=20, T=20.0, gamma=0.1, learn_gamma=False)) == 240
    assert n(CubicFrictionConv(10, layers=20, T=20.0, kernel_size=3)) == 18201


def test_conv_field_is_a_same_size_convolution(f64):
    f = CubicFrictionConv(2, gamma=0.1, learn_gamma=False, zero_init=False)
    x = torch.randn(3, 2, 5, 6)
    out = f(0.0, x)
    assert out.shape == x.shape
    ref = torch.nn.functional.conv2d(x, f.kernel[0], f.bias[0], padding=1) - 0.1 * x**3
    assert torch.allclose(out, ref, atol=1e-14)
    y = ODEBlock(f, method="rk4", gradient="backprop")(x)
    assert y.shape == x.shape


def test_errors():
    with pytest.raises(ValueError, match="`mu` must be > 1"):
        CubicFriction(2, mu=1.0)
    with pytest.raises(ValueError, match="`gamma` must be a finite number >= 0"):
        CubicFriction(2, gamma=-1.0)
    with pytest.raises(ValueError, match="`gamma=0` cannot be learned"):
        CubicFriction(2, gamma=0.0)
    with pytest.raises(ValueError, match="`kernel_size` must be a positive odd integer"):
        CubicFrictionConv(3, kernel_size=2)
    f = CubicFrictionConv(3)
    with pytest.raises(ValueError, match=r"expects \(batch, 3, \*, \*\)"):
        ODEBlock(f)(torch.zeros(1, 2, 4, 4))
