"""Continuous normalizing flows and trajectory regularisers against closed forms, torch.func Jacobians and
quadrature (float64)."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from cde_nets import Backprop, ODEBlock, Regularisation, integrated_terms, odeint
from cde_nets.flows import ContinuousFlow, standard_normal_log_prob
from cde_nets.regularisers import jacobian_frobenius, kinetic_energy, taylor

TOL = dict(rtol=1e-10, atol=1e-10)


class TanhField(nn.Module):
    """``F(t, z) = W₂ tanh(W₁ [z, t] + b₁) + b₂``: non-autonomous, so ``∂F/∂t ≠ 0``."""

    def __init__(self, d=2, h=6, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(h, d + 1, generator=g, dtype=torch.float64))
        self.b1 = nn.Parameter(torch.randn(h, generator=g, dtype=torch.float64))
        self.w2 = nn.Parameter(0.5 * torch.randn(d, h, generator=g, dtype=torch.float64))

    def forward(self, t, z):
        tz = torch.cat([z, t.expand(*z.shape[:-1], 1)], -1)
        return torch.tanh(tz @ self.w1.T + self.b1) @ self.w2.T


class Linear(nn.Module):
    def __init__(self, A):
        super().__init__()
        self.A = nn.Parameter(A)

    def forward(self, t, z):
        return z @ self.A.T


def _x(n=4, d=2, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _gauss_legendre(fn, T, n=40):
    """``∫₀ᵀ fn(t) dt`` by ``n``-point Gauss-Legendre (exact for polynomials of degree < 2n)."""
    nodes, weights = np.polynomial.legendre.leggauss(n)
    return sum(w * T / 2 * fn(T / 2 * (s + 1)) for s, w in zip(nodes, weights))


def test_log_prob_equals_change_of_variables_with_torch_func_jacobian():
    field, x, T = TanhField(), _x(), 0.8
    flow = ContinuousFlow(field, T, trace="exact", **TOL)

    def phi(xi):
        return odeint(field, xi.unsqueeze(0), torch.tensor([0.0, T], dtype=torch.float64), **TOL)[-1, 0]

    expected = torch.stack(
        [standard_normal_log_prob(phi(xi)[None])[0] + torch.linalg.slogdet(torch.func.jacrev(phi)(xi))[1] for xi in x]
    )
    torch.testing.assert_close(flow.log_prob(x), expected, rtol=0, atol=1e-6)


def test_linear_field_closed_forms():
    """``F = Az``: ``z(t) = e^{At} x``, ``log p = log N(e^{AT} x) + T Tr A``, ``∫‖∂F/∂z‖²_F = T‖A‖²_F`` and the
    kinetic and second-derivative integrals by quadrature of ``‖A e^{At} x‖²``, ``‖A² e^{At} x‖²``."""
    A = torch.tensor([[-0.3, 1.1], [-0.7, 0.2]], dtype=torch.float64)
    T, x = 1.3, _x()
    flow = ContinuousFlow(Linear(A), T, trace="exact", regularisers=("kinetic", "jacobian", "taylor2"), **TOL)
    z, logdet, regs = flow.transform(x)
    torch.testing.assert_close(z, x @ torch.linalg.matrix_exp(A * T).T, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(logdet, torch.full((4,), T * float(A.trace()), dtype=torch.float64))
    torch.testing.assert_close(regs["jacobian"], torch.full((4,), T * float(A.square().sum()), dtype=torch.float64))
    kin = _gauss_legendre(lambda t: (x @ (A @ torch.linalg.matrix_exp(A * t)).T).square().sum(1), T)
    tay = _gauss_legendre(lambda t: (x @ (A @ A @ torch.linalg.matrix_exp(A * t)).T).square().sum(1), T)
    torch.testing.assert_close(regs["kinetic"], kin, rtol=1e-8, atol=0)
    torch.testing.assert_close(regs["taylor2"], tay, rtol=1e-8, atol=0)


def test_regularisers_match_quadrature_of_the_integrands_on_a_nonlinear_field():
    """Along the trajectory, ``‖F‖²``, ``‖∂F/∂z‖²_F`` (torch.func.jacrev) and ``‖∂F/∂t + (∂F/∂z) F‖²``
    (torch.func.jvp, forward mode) integrated by Gauss-Legendre match the integrated state."""
    field, x, T = TanhField(), _x(2), 1.0
    flow = ContinuousFlow(field, T, trace="exact", regularisers=("kinetic", "jacobian", "taylor2"), **TOL)
    _, _, regs = flow.transform(x)
    nodes, weights = np.polynomial.legendre.leggauss(30)
    ts = torch.tensor([0.0, *(T / 2 * (nodes + 1))], dtype=torch.float64)
    with torch.no_grad():
        zs = odeint(field, x, ts, **TOL)[1:]
    kin, jac, tay = (torch.zeros(2, dtype=torch.float64) for _ in range(3))
    for w, t, z in zip(weights, ts[1:], zs):
        for i in range(2):
            F = field(t, z[i : i + 1])[0]
            J = torch.func.jacrev(lambda zi, s=t: field(s, zi[None])[0])(z[i])
            _, d2 = torch.func.jvp(lambda s, zi: field(s, zi[None])[0], (t, z[i]), (torch.ones_like(t), F))
            kin[i] += w * T / 2 * F.square().sum()
            jac[i] += w * T / 2 * J.square().sum()
            tay[i] += w * T / 2 * d2.square().sum()
    for name, q in (("kinetic", kin), ("jacobian", jac), ("taylor2", tay)):
        # the regularisers stay out of the step-size control: good to ~100× the solver's 1e-10, not to it
        torch.testing.assert_close(regs[name].detach(), q.detach(), rtol=1e-7, atol=0)


@pytest.mark.parametrize("noise", ["gaussian", "rademacher"])
def test_hutchinson_is_unbiased_within_three_standard_errors(noise):
    """One probe per sample: the mean of 4000 copies of one point estimates the exact ``ℓ(T)`` and ‖J‖²_F."""
    field, T, m = TanhField(d=3), 0.7, 4000
    x = _x(1, 3).expand(m, 3).contiguous()
    exact = ContinuousFlow(field, T, trace="exact", regularisers=("jacobian",), rtol=1e-8, atol=1e-8)
    hutch = ContinuousFlow(field, T, trace="hutchinson", noise=noise, regularisers=("jacobian",), rtol=1e-8, atol=1e-8)
    with torch.no_grad():
        _, l_exact, r_exact = exact.transform(x[:1])
        _, l_est, r_est = hutch.transform(x, generator=torch.Generator().manual_seed(3))
    for est, ref in ((l_est, l_exact), (r_est["jacobian"], r_exact["jacobian"])):
        se = est.std() / math.sqrt(m)
        assert abs(float(est.mean() - ref[0])) < 3 * float(se)
        assert float(se) > 0  # the estimates do vary: one probe per sample


@pytest.mark.slow
def test_hutchinson_probe_is_fixed_per_solve_so_the_adjoint_matches_backprop():
    """One probe per solve: the adjoint's backward solve reads the forward's probe, so its gradient is that of the
    same estimate, equal to backprop's on the steps' mesh (the adjoint differentiates the ODE, whose gradient the
    mesh's discretises; backprop's default also differentiates the step sizes, an O(tol) difference) to the
    tolerance, and the replays equal backprop's."""
    grads = {}
    for gradient in ("backprop", Backprop(steps="fixed"), "adjoint", "checkpoint", "symplectic"):
        field = TanhField(seed=2)
        flow = ContinuousFlow(
            field, 0.9, trace="hutchinson", noise="rademacher", regularisers=("kinetic", "jacobian", "taylor2"),
            gradient=gradient, **TOL,
        )  # fmt: skip
        with integrated_terms() as terms:
            lp = flow.log_prob(_x(3), generator=torch.Generator().manual_seed(5))
        loss = -lp.mean() + sum(terms.values())
        grads[str(gradient)] = torch.autograd.grad(loss, list(field.parameters()))
    for gradient, ref in (
        ("adjoint", "Backprop(steps='fixed')"),
        ("checkpoint", "backprop"),
        ("symplectic", "backprop"),
    ):
        for a, b in zip(grads[gradient], grads[ref]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_log_prob_gradient_against_finite_differences():
    field, x = TanhField(seed=4), _x(3)
    flow = ContinuousFlow(field, 0.6, trace="exact", regularisers=("kinetic",), gradient="adjoint", **TOL)

    def loss():
        z, logdet, regs = flow.transform(x)
        return -(standard_normal_log_prob(z) + logdet).mean() + regs["kinetic"].mean()

    (g,) = torch.autograd.grad(loss(), [field.b1])
    fd = torch.zeros_like(g)
    with torch.no_grad():
        for i in range(len(fd)):
            for s in (1, -1):
                field.b1[i] += s * 1e-5
                fd[i] += s * loss() / 2e-5
                field.b1[i] -= s * 1e-5
    torch.testing.assert_close(g, fd, rtol=1e-6, atol=1e-8)


def test_sample_inverts_the_flow_map():
    field = TanhField(seed=6)
    flow = ContinuousFlow(field, 1.0, **TOL)
    x = flow.sample(5, generator=torch.Generator().manual_seed(0), shape=(2,))
    z, _, _ = flow.transform(x)
    torch.testing.assert_close(z, torch.randn(5, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    with pytest.raises(ValueError, match="pass `shape`, one sample's shape"):
        flow.sample(3)  # a plain module declares no state_shape, and the flow keeps none from its data


def test_float32_input_gives_float32_density_and_counts_evaluations():
    flow = ContinuousFlow(TanhField().float(), trace="hutchinson", regularisers=("kinetic", "jacobian"))
    with integrated_terms() as terms:
        lp = flow.log_prob(_x().float())
    assert lp.dtype == torch.float32 and lp.shape == (4,)
    assert terms.nfe_forward >= 8 and set(terms) == {"kinetic", "jacobian"}
    assert terms["kinetic"].dtype == torch.float32


def test_steer_draws_the_end_time_in_training_only():
    """Linear field: ``ℓ(T_end) = T_end Tr A``, so the log-determinant reveals the end time drawn."""
    A = torch.diag(torch.tensor([0.5, 0.25], dtype=torch.float64))
    flow = ContinuousFlow(Linear(A), 1.0, steer=0.5, **TOL)
    x = _x()
    ends = [float(flow.transform(x)[1][0].detach()) / 0.75 for _ in range(20)]
    assert all(0.5 <= e <= 1.5 for e in ends) and max(ends) - min(ends) > 0.1
    flow.eval()
    assert float(flow.transform(x)[1][0].detach()) == pytest.approx(0.75, rel=1e-9)


def test_regularised_blocks_with_the_trainer_regularisers():
    field, x = TanhField(), _x()
    regs = ("kinetic", "jacobian", "taylor2")
    block = ODEBlock(field, 0.5, **TOL, regularisation=Regularisation(regs))
    torch.manual_seed(0)
    first = block.solve(x)
    torch.testing.assert_close(first.y, odeint(field, x, torch.tensor([0.0, 0.5], dtype=torch.float64), **TOL)[-1])
    second = ODEBlock(TanhField(seed=3), 0.5, **TOL, regularisation=Regularisation(regs))
    torch.manual_seed(1)
    after = second.solve(first.y)
    model = nn.Sequential(block, second, nn.Linear(2, 1).double())
    with integrated_terms():
        torch.manual_seed(0)
        y = block(x)
        torch.manual_seed(1)
        model[2](second(y))
        for make, name in ((kinetic_energy, "kinetic"), (jacobian_frobenius, "jacobian"), (taylor, "taylor2")):
            reg = make(0.1)
            both = first.regularisation[name] + after.regularisation[name]
            assert reg.name == name and float(reg.fn(model).detach()) == float(both.detach()) > 0
    with integrated_terms(), pytest.raises(ValueError, match="no block of the model integrated 'kinetic'"):
        kinetic_energy(1.0).fn(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(trace="diag"), "`trace` must be"),
        (dict(noise="uniform"), "`noise` must be"),
        (dict(steer=1.5), "`steer` must be"),
        (dict(regularisers=("kinetic", "kinetic")), "`regularisers` must hold distinct"),
        (dict(regularisers=("energy",)), "`regularisers` must hold distinct names"),
        (dict(T=-1.0), "`T` must be"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ContinuousFlow(TanhField(), **kwargs)


def test_a_field_of_the_wrong_shape_is_named():
    flow = ContinuousFlow(lambda_field := Linear(torch.eye(2, dtype=torch.float64)))
    lambda_field.forward = lambda t, z: z[:, :1]  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="shaped like z"):
        flow.log_prob(_x())


def test_bits_per_dim_of_the_uniform_density_is_log2_levels():
    """``p(y) = 1`` on ``[0, 1)^d`` gives the discrete uniform over ``L^d`` values: ``log₂ L`` bits per dimension."""
    from cde_nets.flows import bits_per_dim

    bpd = bits_per_dim(torch.zeros(3, dtype=torch.float64), 64, 17)
    assert float(bpd[0]) == pytest.approx(math.log2(17), rel=1e-12)


def test_trainer_fits_a_flow_on_its_negative_log_likelihood_with_integrated_regularisers():
    from cde_nets.train.trainer import Trainer, evaluate

    x = _x(32)
    flow = ContinuousFlow(TanhField(seed=7), 0.5, regularisers=("kinetic", "jacobian"), rtol=1e-6, atol=1e-6)
    before = evaluate(flow, x, torch.zeros(32, dtype=torch.long), task="density")["loss"]
    assert before == pytest.approx(float(-flow.log_prob(x).mean().detach()), rel=1e-12)
    regs = [kinetic_energy(0.01), jacobian_frobenius(0.01)]
    hist = Trainer(task="density", lr=1e-2, regularisers=regs, progress=False).fit(
        flow, (x, torch.zeros(32, dtype=torch.long), None, None), epochs=3, batch_size=32
    )
    assert hist[-1]["reg_kinetic"] > 0 and hist[-1]["reg_jacobian"] > 0
    assert evaluate(flow, x, torch.zeros(32, dtype=torch.long), task="density")["loss"] < before


def test_image_shaped_states_take_hutchinson_and_exact_names_the_fix():
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 3, padding=1)

        def forward(self, t, z):
            return torch.tanh(self.conv(z))

    x = torch.rand(3, 1, 8, 8)
    flow = ContinuousFlow(Conv(), trace="hutchinson", regularisers=("kinetic", "jacobian", "taylor2"))
    assert flow.log_prob(x).shape == (3,) and flow.sample(2, shape=(1, 8, 8)).shape == (2, 1, 8, 8)
    with pytest.raises(ValueError, match="trace='exact' needs a \\(batch, dim\\) state.*use 'hutchinson'"):
        ContinuousFlow(Conv()).log_prob(x)


@pytest.mark.slow
def test_regularisers_do_not_steer_the_step_size():
    """The integrated regularisers feed nothing back: with the same field, a regularised solve takes exactly the
    unregularised solve's steps (their error left out of the adaptive norm) and gives the same log p."""
    field = TanhField(d=2, h=16, seed=8)
    with torch.no_grad():
        for p in field.parameters():
            p.mul_(3)
    x = _x(64, seed=9)
    plain = ContinuousFlow(field, rtol=1e-6, atol=1e-6)
    regularised = ContinuousFlow(field, rtol=1e-6, atol=1e-6, regularisers=("kinetic", "jacobian", "taylor2"))
    with integrated_terms() as counted_plain:
        lp_plain = plain.log_prob(x)
    with integrated_terms() as counted_reg:
        lp_reg = regularised.log_prob(x)
    assert counted_reg.nfe_forward == counted_plain.nfe_forward
    torch.testing.assert_close(lp_reg, lp_plain, rtol=0, atol=1e-9)


@pytest.mark.slow
def test_regularised_block_gradients_agree_across_gradient_methods():
    grads = {}
    for gradient in ("backprop", "adjoint", "checkpoint"):
        field = TanhField(seed=10)
        block = ODEBlock(
            field, 0.7, gradient=gradient, **TOL, regularisation=Regularisation(("kinetic", "jacobian", "taylor2"))
        )
        torch.manual_seed(0)  # the same Hutchinson probe in every mode
        sol = block.solve(_x(3))
        loss = sol.y.square().sum() + sum(sol.regularisation.values())
        grads[gradient] = torch.autograd.grad(loss, list(field.parameters()))
    for gradient in ("adjoint", "checkpoint"):
        for a, b in zip(grads[gradient], grads["backprop"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
