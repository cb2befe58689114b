"""Runge-Kutta-Nyström methods (solvers/steppers/nystrom_tableaux.py, nystrom_ode.py, schemes/nystrom.py) on q'' = f(q,
q')."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cde_nets import discretize, solve_second_order
from cde_nets.fields import Hamiltonian, SecondOrder
from cde_nets.solvers.steppers.nystrom_tableaux import NYSTROM_TABLEAUX, dense_weights
from cde_nets.solvers.steppers.order_conditions import nystrom_defects

D = torch.float64


class _Linear(torch.nn.Module):
    """``f(x) = −K x``."""

    def __init__(self, K: torch.Tensor):
        super().__init__()
        self.K = K

    def forward(self, x):
        return -x @ self.K.T


def _oscillator(damping: bool, layers: int = 1, T: float = 5.0) -> SecondOrder:
    """``x'' = −γ x' − K x`` (γ = 0.3 with damping), frequencies 1.00 and 2.92: the seeds' second-order field with
    a linear restoring force."""
    M = torch.randn(2, 2, generator=torch.Generator().manual_seed(0), dtype=D)
    K = M @ M.T + torch.eye(2, dtype=D)
    return SecondOrder(2, layers=layers, T=T, damping=damping, f=_Linear(K), learn=False, gamma=0.3).double()


def _exact(f: SecondOrder, y0: torch.Tensor, t: float) -> torch.Tensor:
    A = f(0.0, torch.eye(4, dtype=D)).T.detach()
    return y0 @ torch.linalg.matrix_exp(A * t).T


def test_tables_check_their_conditions_and_refuse_a_wrong_one():
    """Each table's solution, embedded solution and dense output meet their order conditions to 1e-12 (checked on
    construction) and miss those of the next order; a changed coefficient or an overstated order is refused."""
    for tab in NYSTROM_TABLEAUX.values():
        for b, bp, order in [
            (tab.b, tab.bp, tab.order),
            *([(*tab.embedded, tab.embedded_order)] if tab.embedded else []),
        ]:
            assert max(abs(d[0]) for d in nystrom_defects(tab.c, tab.a, b, bp, order, tab.av)) <= 1e-12
            nxt = nystrom_defects(tab.c, tab.a, b, bp, order + 1, tab.av)
            assert max(abs(d[0]) for d in nxt if d[2] == order + 1) > 1e-7
    dp = NYSTROM_TABLEAUX["dprkn6"]
    assert dp.fsal and dp.adaptive and not dp.velocity_dependent
    bq, bv = dense_weights(dp, 1.0)
    assert max(abs(x - y) for x, y in zip((*bq, *bv), (*dp.b, *dp.bp))) <= 1e-13
    with pytest.raises(ValueError, match="dprkn6: the solution misses an order-7 condition"):
        dataclasses.replace(dp, order=7)
    a = [list(r) for r in dp.a]
    a[3][1] += 1e-9
    with pytest.raises(ValueError, match="dprkn6: the solution misses an order-"):
        dataclasses.replace(dp, a=tuple(tuple(r) for r in a))
    with pytest.raises(ValueError, match="strictly lower triangular"):
        dataclasses.replace(dp, a=tuple(tuple(1.0 for _ in r) for r in dp.a))


@pytest.mark.parametrize(
    ("method", "damping", "Ns"),
    [
        ("nystrom4", False, (90, 128, 181, 256)),
        ("nystrom4", True, (90, 128, 181, 256)),
        ("dprkn6", False, (64, 90, 128, 181)),
        ("dprkn8", False, (12, 16, 20, 24, 28, 32)),
    ],
)
def test_fitted_order_on_the_linear_oscillator(method, damping, Ns):
    """``x'' = −K x`` (and ``−γ x' − K x`` for ``nystrom4``, which allows ``f(x, x')``) over T = 5 against
    ``expm``, fixed steps, float64: fitted order within 0.1 of the method's."""
    f = _oscillator(damping)
    y0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    exact = _exact(f, y0, 5.0)
    with torch.no_grad():
        errs = [float((solve_second_order(f, y0, method=method, step_size=5.0 / N).y - exact).abs().max()) for N in Ns]
    fitted = -np.polyfit(np.log(Ns), np.log(errs), 1)[0]
    assert abs(fitted - NYSTROM_TABLEAUX[method].order) < 0.1, (fitted, errs)


def test_dense_output_is_sixth_order_between_the_steps():
    """dprkn6 with fixed steps and ``dense=True``: the states at times inside the steps (θ = 0.3, 0.7 of each
    step) have the order of the steps themselves (fitted order of the largest error within 0.1 of 6), and at a
    step's end the dense output is the step."""
    f = _oscillator(False)
    y0 = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(2))
    Ns, errs = (32, 45, 64, 90), []
    for N in Ns:
        h = 5.0 / N
        with torch.no_grad():
            sol = solve_second_order(f, y0, method="dprkn6", step_size=h, dense=True)
            ts = [h * (k + th) for k in range(N) for th in (0.3, 0.7)]
            got = sol.evaluate(ts)
            errs.append(max(float((g - _exact(f, y0, t)).abs().max()) for g, t in zip(got, ts)))
            assert float((sol.evaluate(5.0) - sol.y).abs().max()) <= 1e-14
    fitted = -np.polyfit(np.log(Ns), np.log(errs), 1)[0]
    assert abs(fitted - 6) < 0.1, (fitted, errs)


def test_adaptive_dprkn6_meets_its_tolerance_and_stops_at_jumps():
    """Adaptive dprkn6 on the oscillator: the error at T falls with the tolerance (within 30× tol from 1e-5 to
    1e-10), first same as last (≤ 5 new evaluations per accepted step); on a 3-piece field with different
    parameters per piece it matches a fine fixed-step solve (steps end on the jumps) to 1e-9."""
    f = _oscillator(False)
    y0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(3))
    exact = _exact(f, y0, 5.0)
    for tol in (1e-5, 1e-7, 1e-10):
        with torch.no_grad():
            sol = solve_second_order(f, y0, rtol=tol, atol=tol)
        assert float((sol.y - exact).abs().max()) <= 30 * tol
        s = sol.stats
        assert s["nfe_forward"] <= 5 * (s["steps_forward"] + s["rejected_forward"]) + 2
    g = SecondOrder(2, layers=3, T=3.0, damping=False, generator=torch.Generator().manual_seed(4)).double()
    t = torch.tensor([0.0, 0.5, 1.7, 3.0], dtype=D)
    with torch.no_grad():
        adaptive = solve_second_order(g, y0, t, rtol=1e-11, atol=1e-11)
        fine = solve_second_order(g, y0, t, method="dprkn6", step_size=0.05)
    assert adaptive.ys.shape == (4, 3, 4)
    assert float((adaptive.ys - fine.ys).abs().max()) <= 1e-9


def test_gradient_through_the_steps_equals_central_differences():
    """Fixed-step dprkn6 and nystrom4 on a nonlinear 2-piece second-order field: the gradient of ``Σ y(T)²`` with
    respect to ``y0`` and to a parameter equals central differences (float64, steps 1e-6) to 1e-7."""
    for method, damping in (("dprkn6", False), ("nystrom4", True)):
        f = SecondOrder(2, layers=2, T=1.0, damping=damping, generator=torch.Generator().manual_seed(5)).double()
        y0 = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(6))

        def loss(y, f=f, method=method):
            return (solve_second_order(f, y, method=method, step_size=0.1).y ** 2).sum()

        x = y0.clone().requires_grad_(True)
        W = f.f.W1.data
        gx, gW = torch.autograd.grad(loss(x), [x, W])
        eps = 1e-6
        for idx in ((0, 0), (1, 3)):
            e = torch.zeros_like(y0)
            e[idx] = eps
            with torch.no_grad():
                fd = (loss(y0 + e) - loss(y0 - e)) / (2 * eps)
            assert abs(float(fd) - float(gx[idx])) <= 1e-7
        with torch.no_grad():
            W[0, 1, 0] += eps
            up = loss(y0)
            W[0, 1, 0] -= 2 * eps
            down = loss(y0)
            W[0, 1, 0] += eps
        assert abs(float((up - down) / (2 * eps)) - float(gW[0, 1, 0])) <= 1e-7


def test_discrete_layer_is_the_hand_written_nystrom_step(f64):
    """Discrete mode on the damped second-order field (5 pieces): each ``nystrom4`` layer is Nyström's formula
    written out (A&S 25.5.20) to 1e-12, outputs and gradients; the architecture names it."""
    L, T = 5, 1.5
    h = T / L
    f = SecondOrder(2, layers=L, T=T, generator=torch.Generator().manual_seed(7))

    def acc(l, x, v):
        return f.evaluate_part(l, torch.cat([x, v], 1), 1)

    def by_hand(y):
        x, v = y[:, :2], y[:, 2:]
        for l in range(L):
            k1 = acc(l, x, v)
            k2 = acc(l, x + h / 2 * v + h * h / 8 * k1, v + h / 2 * k1)
            k3 = acc(l, x + h / 2 * v + h * h / 8 * k1, v + h / 2 * k2)
            k4 = acc(l, x + h * v + h * h / 2 * k3, v + h * k3)
            x, v = x + h * v + h * h / 6 * (k1 + k2 + k3), v + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return torch.cat([x, v], 1)

    net = discretize(f, "nystrom4")
    assert net.architecture == ("second-order residual net by the Nyström step, order 4", "B §8; A&S 25.5.20")
    y0 = torch.randn(3, 4)
    ya, yb = y0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
    out_net, out_hand = net(ya), by_hand(yb)
    assert float((out_net - out_hand).detach().abs().max()) <= 1e-12
    params = list(f.parameters())
    g1 = torch.autograd.grad(out_net.square().sum(), [ya, *params], allow_unused=True)
    g2 = torch.autograd.grad(out_hand.square().sum(), [yb, *params], allow_unused=True)
    for u, v in zip(g1, g2):
        assert (u is None) == (v is None) and (u is None or float((u - v).abs().max()) <= 1e-12)


def test_refusals_name_the_fix():
    y0 = torch.randn(2, 4, dtype=D)
    with pytest.raises(ValueError, match="damping −γ q' makes f depend on q'. Use method='nystrom4'"):
        solve_second_order(_oscillator(True), y0)
    with pytest.raises(ValueError, match="Hamiltonian is not such a field. Use SecondOrder"):
        solve_second_order(Hamiltonian(4).double(), y0)
    with pytest.raises(ValueError, match="no embedded error estimate: give `step_size`"):
        solve_second_order(_oscillator(True), y0, method="nystrom4")
    with pytest.raises(ValueError, match="unknown Nyström method 'dprkn12'"):
        solve_second_order(_oscillator(False), y0, method="dprkn12")
    with pytest.raises(ValueError, match="'dprkn8' has no dense output; drop `dense`"):
        solve_second_order(_oscillator(False), y0, method="dprkn8", dense=True)
    with pytest.raises(ValueError, match="`rtol` must be a finite number > 0"):
        solve_second_order(_oscillator(False), y0, rtol=-1.0)
    with pytest.raises(ValueError, match="does not apply to 'dprkn6'"):
        discretize(_oscillator(False), "dprkn6", split=(2, 2))


def test_adaptive_dprkn8_ends_steps_on_the_requested_times():
    """dprkn8 has no dense output: adaptive steps end on each requested time, where the states match the closed
    form to 30× the tolerance; first same as last (≤ 8 new evaluations per step)."""
    f = _oscillator(False)
    y0 = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(8))
    t = torch.tensor([0.0, 0.3, 2.0, 5.0], dtype=D)
    with torch.no_grad():
        sol = solve_second_order(f, y0, t, method="dprkn8", rtol=1e-10, atol=1e-10)
    for ti, yi in zip(t.tolist(), sol.ys):
        assert float((yi - _exact(f, y0, ti)).abs().max()) <= 30 * 1e-10
    s = sol.stats
    assert s["nfe_forward"] <= 8 * (s["steps_forward"] + s["rejected_forward"]) + 1 + 3
