"""NAIS field (Ciccone et al. 2018): Alg. 1/2 projections give Condition 1, the tanh equilibrium is reached
geometrically, the input-output gain bound (eq. 10) holds, the call's input follows compacted rows."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cde_nets import ODEBlock, discretize
from cde_nets.blocks.gathering import gathered
from cde_nets.fields import NAIS, NAISConv


@settings(max_examples=8, deadline=None)
@given(scale=st.floats(2.0, 50.0), seed=st.integers(0, 10_000), eps=st.floats(0.01, 0.4), loose=st.booleans())
def test_projection_makes_the_block_stable(scale, seed, eps, loose):
    """After Alg. N1, ρ(I + h σ' A) < 1 for h = 1 (Theorem N2), for δ = 1 − 2ε and the looser 2(1 − ε)."""
    g = torch.Generator().manual_seed(seed)
    delta = 2 * (1 - eps) if loose else None
    field = NAIS(5, 3, layers=2, eps=eps, delta=delta, init_std=scale, generator=g).double()
    with torch.no_grad():
        field.b.data.normal_(0, 1, generator=g)
    u = torch.randn(16, 3, generator=g, dtype=torch.float64)
    x = torch.randn(16, 5, generator=g, dtype=torch.float64)
    # Large R: Condition N1 fails before the projection (ρ(I + A) > 1 at σ' = 1, the unsaturated limit)
    assert torch.linalg.eigvalsh(torch.eye(5) + field.A(0).detach()).abs().max() > 1
    field.project_()
    for l in range(2):
        R = field.R.data.detach()[l]
        assert float(torch.linalg.matrix_norm(R.T @ R)) == pytest.approx(field.delta, rel=1e-12)
        assert field.stability_margin(x, u, h=1.0, l=l) < 1
    R1 = field.R.data.clone()
    field.project_()
    assert torch.equal(field.R.data, R1)  # idempotent


def test_projection_leaves_a_feasible_R_alone(f64):
    field = NAIS(4, 2, eps=0.1, init_std=0.05)
    R0 = field.R.data.clone()
    field.project_()
    assert torch.equal(field.R.data, R0)


def test_steady_state_reached_geometrically_from_two_starts(f64):
    """x̄ = −A⁻¹(Bu + b) (tanh(0) = 0) is reached from x(0) = 0 and from a far start;
    the error falls geometrically, at the rate ρ(J(x̄)) <= ρ̄."""
    g = torch.Generator().manual_seed(0)
    field = NAIS(4, 2, T=1.0, eps=0.1, init_std=1.0, generator=g).project_()
    with torch.no_grad():
        field.b.data.normal_(0, 0.3, generator=g)
    u = torch.randn(1, 2, generator=g)
    with torch.no_grad():
        x_star = -torch.linalg.solve(field.A(0), (u @ field.B[0].T + field.b[0]).T).T
    net = discretize(field, "euler")
    rho_star = field.stability_margin(x_star, u, h=1.0)
    for x0 in (torch.zeros(1, 4), 3 * torch.randn(1, 4, generator=g)):
        x, errs, xs = x0, [], [x0]
        with torch.no_grad():
            for _ in range(300):
                x = net.step(0, (x,), u=u)[0]
                errs.append((x - x_star).norm().item())
                xs.append(x)
        assert errs[-1] < 1e-6
        rho_bar = field.stability_margin(torch.cat(xs), u.expand(301, 2), h=1.0)  # sup along the run
        assert rho_star <= rho_bar < 1
        ratios = [b / a for a, b in zip(errs[100:200], errs[101:201])]
        assert max(ratios) <= rho_bar + 1e-3
        slope = (math.log(errs[200]) - math.log(errs[100])) / 100  # fitted rate: the linearisation at x̄
        assert math.exp(slope) == pytest.approx(rho_star, abs=2e-3)


def test_input_output_gain_bound(f64):
    """‖x(u + w) − x(u)‖ <= h ‖B‖ ‖w‖ / (1 − ρ̄) (eq. N10) along the whole run, for random perturbations w.

    ρ̄: the largest ‖I + h D̃ A‖₂ along the run, D̃ the secant slopes of tanh (so e(k+1) = (I + h D̃ A) e(k) +
    h D̃ B w with ‖D̃‖ <= 1, and the bound follows by induction from e(0) = 0).
    """
    g = torch.Generator().manual_seed(1)
    field = NAIS(4, 3, T=0.5, eps=0.1, init_std=1.0, generator=g).project_()
    h, B, A = 0.5, field.B[0], field.A(0)
    net = discretize(field, "euler")
    worst = 0.0
    for _ in range(5):
        u = 0.3 * torch.randn(1, 3, generator=g)
        w = 0.1 * torch.randn(1, 3, generator=g)
        x, xw, rho = torch.zeros(1, 4), torch.zeros(1, 4), 0.0
        bound_parts = []
        for _ in range(60):
            z = field.preactivation(0, x, u)
            zw = field.preactivation(0, xw, u + w)
            dz = zw - z
            D = torch.where(dz.abs() > 1e-12, (torch.tanh(zw) - torch.tanh(z)) / dz, 1 - torch.tanh(z) ** 2)
            rho = max(rho, torch.linalg.matrix_norm(torch.eye(4) + h * D[0, :, None] * A, 2).item())
            x = net.step(0, (x,), u=u)[0]
            xw = net.step(0, (xw,), u=u + w)[0]
            bound_parts.append((xw - x).norm().item())
        assert rho < 1
        bound = (h * torch.linalg.matrix_norm(B, 2) * w.norm() / (1 - rho)).item()
        assert max(bound_parts) <= bound
        worst = max(worst, max(bound_parts) / bound)
    assert worst > 0.05  # the bound is not vacuous on these inputs


def test_rows_restrict_the_call_input(f64):
    from cde_nets.fields.bound import BoundField

    field = NAIS(3, 2, layers=2, generator=torch.Generator().manual_seed(2))
    x, u = torch.randn(5, 3), torch.randn(5, 2)
    bound = BoundField(field, u)
    full = bound(0.7, x)
    assert torch.equal(full, field(0.7, x, u))
    idx = torch.tensor([4, 1, 3])
    rows = bound.rows(idx)
    assert torch.allclose(rows(0.7, x[idx]), full[idx], atol=1e-15, rtol=0)
    assert torch.equal(bound(0.7, x), full)  # the bound field itself is unchanged


def conv_jacobian_radius(field, x, u, h=1.0):
    """ρ(∂(x + h F(x))/∂x) of the dense Jacobian (Lemma N1) at the state ``x``."""
    n = x.numel()
    J = torch.autograd.functional.jacobian(lambda z: (z + h * field(0.0, z, u)).reshape(-1), x).reshape(n, n)
    return torch.linalg.eigvals(J).abs().max().item()


def test_conv_projection_alg_N2(f64):
    """Alg. N2: centre taps −1 − δ_c with |δ_c| <= 1 − η, off-centre absolute sums <= 1 − ε − |δ_c|
    (Gershgorin), so the dense Jacobian of the Euler block has spectral radius < 1 for h = 1 even after a
    large kernel."""
    g = torch.Generator().manual_seed(3)
    field = NAISConv(2, kernel_size=3, eps=0.05, eta=0.1, generator=g).double()
    x, u = torch.randn(1, 2, 4, 4, generator=g), torch.randn(1, 2, 4, 4, generator=g)
    with torch.no_grad():
        field.C.data.mul_(20)
        field.delta.data.copy_(torch.tensor([[2.0, -0.3]]))
    assert conv_jacobian_radius(field, x, u) > 1
    field.project_()
    C, d = field.kernel(0).detach(), field.delta.data.detach()[0]
    assert torch.allclose(d, torch.tensor([0.9, -0.3]))  # clamped to [−1 + η, 1 − η]
    for c in range(2):
        assert C[c, c, 1, 1] == -1 - d[c]
        others = C[c].abs().sum() - C[c, c, 1, 1].abs()
        budget = 1 - 0.05 - float(d[c].abs())
        assert float(others) == pytest.approx(budget, rel=1e-12)  # scaled onto the budget
    assert conv_jacobian_radius(field, x, u) < 1
    K = field.C.data.clone()
    field.project_()
    assert torch.equal(field.C.data, K)  # idempotent
    y = ODEBlock(field, method="euler", gradient="backprop")(x, u=u)
    y.sum().backward()
    assert y.shape == x.shape
    assert field.delta.data.grad.abs().sum() > 0  # δ_c reaches the kernel, so it trains


def test_errors(f64):
    field = NAIS(4, 2)
    with pytest.raises(ValueError, match=r"needs its block input: call it as field\(t, y, u\)"):
        field(0.0, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="needs its block input: pass `u=`"):
        ODEBlock(NAIS(4, 2))(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"`u` has shape \(3, 5\), but NAIS expects \(batch, 2\)"):
        ODEBlock(field)(torch.zeros(3, 4), u=torch.zeros(3, 5))
    with pytest.raises(TypeError, match="`u` must be a torch.Tensor"):
        ODEBlock(field)(torch.zeros(1, 4), u=[[0.0, 0.0]])
    with pytest.raises(ValueError, match="`u` has batch 2 but the state has batch 3"):
        field(0.0, torch.zeros(3, 4), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"`eps` must lie in \(0, 0.5\)"):
        NAIS(4, 2, eps=0.6)
    with pytest.raises(ValueError, match=r"`delta` must lie in \(0, 2\(1 − eps\)\]"):
        NAIS(4, 2, eps=0.1, delta=1.9)
    with pytest.raises(ValueError, match="`h` must be a finite number > 0"):
        field.stability_margin(torch.zeros(3, 4), torch.zeros(3, 2), h=0.0)
    with pytest.raises(ValueError, match=r"`x` has shape \(3, 5\), but NAIS expects \(batch, 4\)"):
        field.stability_margin(torch.zeros(3, 5), torch.zeros(3, 2), h=1.0)
    conv = NAISConv(2)
    with pytest.raises(ValueError, match=r"`u` has spatial size \(3, 3\) but the state has \(4, 4\)"):
        conv(0.0, torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="Alg. N2 needs 0 < eps < eta < 1"):
        NAISConv(2, eps=0.2, eta=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_A_in_one_kernel_equals_the_two_step_formula(dtype):
    """``A = −εI − RᵀR`` with β = −ε on a stored identity gives the bits of ``εI`` built first and subtracted
    (eq. N13), in both dtypes, outside and inside a block call."""
    torch.manual_seed(3)
    field = NAIS(5, 3, layers=4).to(dtype)
    for l in range(4):
        R = field.R.data[l]
        eps_eye = field.eps * torch.eye(5, dtype=dtype)
        direct = torch.addmm(eps_eye, R.T, R, beta=-1.0, alpha=-1.0)
        assert torch.equal(field.A(l), direct)
        with gathered(field):
            assert torch.allclose(field.A(l), direct, rtol=0, atol=4 * torch.finfo(dtype).eps)
