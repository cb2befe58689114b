"""SecondOrder field (blog; Hauser): damped oscillator closed form, the order-k chain, the blog block bridge."""

import pytest
import torch
from torchdiffeq import odeint

from cde_nets import ODEBlock, discretize
from cde_nets.fields import SecondOrder


def linear(W):
    f = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
    with torch.no_grad():
        f.weight.copy_(W)
    return f


def test_damped_oscillator_closed_form(f64):
    """x'' + γ x' + ω² x = 0 per channel (η = 1, f(x) = −ω² x): channel 0 underdamped, channel 1 overdamped;
    x(t) = Re(c₁ e^{r₁t} + c₂ e^{r₂t}), r² + γ r + ω² = 0, against torchdiffeq's dopri5 to 1e-6."""
    gamma, omega2, T = torch.tensor([0.4, 5.0]), torch.tensor([4.0, 2.0]), 3.0
    field = SecondOrder(2, T=T, f=linear(-torch.diag(omega2)), eta=1.0)
    with torch.no_grad():
        field.gamma_raw.copy_(torch.log(torch.expm1(gamma)))  # softplus⁻¹
    assert torch.allclose(field.gamma, gamma, atol=1e-14) and torch.allclose(field.eta, torch.ones(2), atol=1e-14)
    x0, v0 = torch.tensor([[1.0, -0.5]]), torch.tensor([[0.3, 0.2]])
    t = torch.linspace(0, T, 7)
    ys = odeint(field, torch.cat([x0, v0], 1), t, method="dopri5", rtol=1e-10, atol=1e-10)
    disc = torch.sqrt((gamma**2 - 4 * omega2).to(torch.complex128))
    r1, r2 = (-gamma + disc) / 2, (-gamma - disc) / 2
    c2 = (v0 - r1 * x0) / (r2 - r1)
    c1 = x0 - c2
    tt = t[:, None, None]
    exact = (c1 * torch.exp(r1 * tt) + c2 * torch.exp(r2 * tt)).real
    assert torch.allclose(ys[..., :2], exact, atol=1e-6, rtol=0)
    assert torch.allclose(ys[..., 2:], (c1 * r1 * torch.exp(r1 * tt) + c2 * r2 * torch.exp(r2 * tt)).real, atol=1e-6)
    # the block gives the same end point
    assert torch.allclose(ODEBlock(field, rtol=1e-10, atol=1e-10)(ys[0]), ys[-1], atol=1e-8)


def companion(W, eta, gamma, k):
    """The first-order chain q₁' = q₂, ..., q_k' = −γ q_k + η W q₁ as one (k·d × k·d) matrix."""
    d = W.shape[0]
    M = torch.zeros(k * d, k * d)
    for i in range(k - 1):
        M[i * d : (i + 1) * d, (i + 1) * d : (i + 2) * d] = torch.eye(d)
    M[(k - 1) * d :, :d] += eta * W
    M[(k - 1) * d :, (k - 1) * d :] -= torch.diag(gamma)
    return M


@pytest.mark.parametrize("k, damping", [(1, False), (2, True), (3, False), (3, True), (4, False)])
def test_order_k_flow_equals_the_first_order_chain(f64, k, damping):
    """With linear f the order-k field is y' = M y, M the companion matrix: y(T) = exp(T M) y(0) to 1e-8."""
    g = torch.Generator().manual_seed(k)
    W = torch.randn(3, 3, generator=g) / 2
    field = SecondOrder(3, order=k, f=linear(W), eta=0.7, gamma=0.3, damping=damping, T=1.5)
    assert field.state_shape == (3 * k,) and field.order == k
    assert field.split == ((3, 3) if k == 2 else None)
    y0 = torch.randn(2, 3 * k, generator=g)
    got = ODEBlock(field, rtol=1e-11, atol=1e-11)(y0)
    gamma = field.gamma.detach() if damping and k >= 2 else torch.zeros(3)
    M = companion(W, float(field.eta.detach()[0]), gamma, k)
    assert torch.allclose(got, y0 @ torch.linalg.matrix_exp(1.5 * M).T, atol=1e-8, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_order_k_field_with_the_default_network(f64, k):
    """Pointwise, time-varying default f: (q₂, ..., q_k, η f_l(q₁)) with the piece in force at t."""
    field = SecondOrder(3, layers=2, order=k, damping=False, eta=0.7, layer_norm=True)
    y = torch.randn(5, 3 * k)
    qs = y.chunk(k, 1)
    for t, l in ((0.2, 0), (0.8, 1)):
        chain = list(qs[1:]) + [0.7 * field.f.evaluate(l, qs[0])]
        assert torch.allclose(field(t, y), torch.cat(chain, 1), atol=1e-14)
    assert not torch.allclose(field.f.evaluate(0, qs[0]), field.f.evaluate(1, qs[0]))  # time-varying


def test_semi_implicit_euler_is_the_blog_block(f64):
    """v first then x, velocity scaled by h: m = 1 − hγ and η_blog = h² η (blog; Hauser, B §8)."""
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


def test_gamma_and_eta_stay_positive_and_train(f64):
    field = SecondOrder(2, f=linear(-torch.eye(2)))
    with torch.no_grad():
        field.gamma_raw.fill_(-40.0)
        field.eta_raw.fill_(-40.0)
    assert (field.gamma > 0).all() and (field.eta > 0).all()
    field.gamma_raw.data.fill_(0.0)
    y = field(0.0, torch.ones(1, 4))
    y.sum().backward()
    # ∂/∂γ_raw of Σ(−γ v) = −v · sigmoid(γ_raw) = −0.5 per channel
    assert torch.allclose(field.gamma_raw.grad, torch.full((2,), -0.5), atol=1e-14)
    first = SecondOrder(2, order=1)  # x' = η f(x): no damping parameter at all
    assert first.gamma_raw is None and torch.equal(first.gamma, torch.zeros(2))


def test_errors(f64):
    with pytest.raises(ValueError, match="`order` must be a positive integer"):
        SecondOrder(2, order=0)
    with pytest.raises(ValueError, match="`dim` must be a positive integer"):
        SecondOrder(0)
    with pytest.raises(ValueError, match="`hidden` must be a positive integer"):
        SecondOrder(2, hidden=0)
    with pytest.raises(ValueError, match="`gamma` must be a finite number > 0"):
        SecondOrder(2, gamma=0.0)
    with pytest.raises(ValueError, match="`eta` must be a finite number > 0"):
        SecondOrder(2, eta=-1.0)
    with pytest.raises(ValueError, match=r"`y0` has shape \(3, 5\), but SecondOrder expects \(batch, 4\)"):
        ODEBlock(SecondOrder(2))(torch.zeros(3, 5))
    field = SecondOrder(2, order=3)
    with pytest.raises(ValueError, match=r"splits it into 3 blocks of 2: expected \(batch, 6\)"):
        field(0.0, torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"splits it into 2 blocks of 2: expected \(batch, 4\)"):
        SecondOrder(2).evaluate_part(0, torch.zeros(3, 5), 1)
