"""NAIS field (SPEC §4): projection (Alg. N1/N2), stability margin, steady state, input-output gain."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cde_nets import ODEBlock, discretize
from cde_nets.fields import NAIS, NAISConv


@settings(max_examples=15, deadline=None)
@given(scale=st.floats(2.0, 50.0), seed=st.integers(0, 10_000), eps=st.floats(0.01, 0.4))
def test_projection_makes_the_block_stable(scale, seed, eps):
    g = torch.Generator().manual_seed(seed)
    field = NAIS(5, 3, eps=eps, init_std=scale, generator=g).double()
    with torch.no_grad():
        field.b.data.normal_(0, 1, generator=g)
    field.bind(torch.randn(16, 3, generator=g, dtype=torch.float64))
    x = torch.randn(16, 5, generator=g, dtype=torch.float64)
    R = field.R.data[0]
    assert torch.linalg.matrix_norm(R.T @ R) > 1 - 2 * eps  # the projection has work to do
    field.project_()
    R1 = field.R.data.clone()
    assert field.stability_margin(x, h=1.0) < 1
    field.project_()
    assert torch.equal(field.R.data, R1)  # idempotent


def test_steady_state_reached_geometrically_from_two_starts(f64):
    g = torch.Generator().manual_seed(0)
    field = NAIS(4, 2, T=1.0, eps=0.1, init_std=1.0, generator=g).project_()
    with torch.no_grad():
        field.b.data.normal_(0, 0.3, generator=g)
    u = torch.randn(1, 2, generator=g)
    A = field.A(0)
    x_star = -torch.linalg.solve(A, (u @ field.B[0].T + field.b[0]).T).T
    step = discretize(field, "euler").step
    for x in (torch.zeros(1, 4), 3 * torch.randn(1, 4, generator=g)):
        field.bind(u)
        errs = []
        for _ in range(300):
            (x,) = step(0, (x,))
            errs.append((x - x_star).norm().item())
        assert errs[-1] < 1e-6
        rho = field.stability_margin(x_star, h=1.0)
        ratios = [b / a for a, b in zip(errs[100:200], errs[101:201])]
        assert max(ratios) <= rho + 1e-3  # ‖x(k+1) − x̄‖ <= ρ̄ ‖x(k) − x̄‖ near the equilibrium


def test_input_output_gain_bound(f64):
    """‖x(u + w) − x(u)‖ <= h ‖B‖ ‖w‖ / (1 − ρ̄), ρ̄ the largest ‖I + h D̃ A‖ along the run (secant slopes D̃)."""
    g = torch.Generator().manual_seed(1)
    field = NAIS(4, 3, T=0.5, eps=0.1, init_std=1.0, generator=g).project_()
    h, B, A = 0.5, field.B[0], field.A(0)
    for _ in range(5):
        u = 0.3 * torch.randn(1, 3, generator=g)  # moderate signals keep σ' near 1, where ρ̄ < 1 in the 2-norm
        w = 0.1 * torch.randn(1, 3, generator=g)
        x, xw, rho = torch.zeros(1, 4), torch.zeros(1, 4), 0.0
        for _ in range(60):
            z = field.bind(u).preactivation(0, x)
            zw = field.bind(u + w).preactivation(0, xw)
            D = torch.where((zw - z).abs() > 1e-12, (torch.tanh(zw) - torch.tanh(z)) / (zw - z), 1 - torch.tanh(z) ** 2)
            rho = max(rho, torch.linalg.matrix_norm(torch.eye(4) + h * D[0, :, None] * A, 2).item())
            x, xw = x + h * torch.tanh(z), xw + h * torch.tanh(zw)
        assert rho < 1
        bound = h * torch.linalg.matrix_norm(B, 2) * w.norm() / (1 - rho)
        assert (xw - x).norm() <= bound


def test_conv_projection_alg_N2(f64):
    field = NAISConv(3, kernel_size=3, eps=0.05, eta=0.1).double()
    with torch.no_grad():
        field.C.data.mul_(20)
        field.delta.data.fill_(2.0)
    field.project_()
    C, d = field.C.data[0], field.delta.data[0]
    assert torch.allclose(d, torch.full((3,), 0.9))  # clamped to 1 − η
    for c in range(3):
        assert C[c, c, 1, 1] == -1 - d[c]
        others = C[c].abs().sum() - C[c, c, 1, 1].abs()
        assert others <= 1 - 0.05 - d[c].abs() + 1e-12  # Gershgorin: the Jacobian's rows stay stable
    x = torch.randn(2, 3, 5, 5)
    assert ODEBlock(field, method="euler", gradient="backprop")(x, u=torch.randn(2, 3, 5, 5)).shape == x.shape


def test_errors(f64):
    field = NAIS(4, 2)
    with pytest.raises(ValueError, match="needs its block input: call `field.bind\\(u\\)`"):
        field(0.0, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="needs a block input: pass `u=`"):
        ODEBlock(NAIS(4, 2))(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"`u` has shape \(3, 5\), but NAIS expects \(batch, 2\)"):
        field.bind(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="the bound `u` has batch 2 but the state has batch 3"):
        field.bind(torch.zeros(2, 2))(0.0, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="`eps` must lie in \\(0, 0.5\\)"):
        NAIS(4, 2, eps=0.6)
