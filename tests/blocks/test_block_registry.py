"""Every method the block registers, with every gradient it accepts for it, answers every per-call question.

``solve(t=...)``, ``solve(event=)``, ``solve(t_end=)`` and ``solve(dense=True)`` on ``y' = −k y``
(``y(t) = y_0 e^{−kt}``), checked against the closed form to a tolerance set by the method's order, and the
gradient of a ``t_end`` solve against ``dy(t_e)/dy_0 = e^{−k t_e}``. The combinations come from the registry,
not from a list here, so a method or gradient added later is checked too.
"""

import math

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock
from cde_nets.solvers.adapter import integrate
from cde_nets.solvers.gradients import GRADIENTS, Backprop, as_gradient
from cde_nets.solvers.options import (
    ADAPTIVE_METHODS,
    FIXED_METHODS,
    IMPLICIT_METHODS,
    REVERSIBLE_METHODS,
    SolverOptions,
    is_adaptive,
)

ODE_GRADIENTS = tuple(GRADIENTS)

K, T, STEP = 0.7, 2.0, 0.05


def _accepted(method: str, gradient: str) -> bool:
    return as_gradient(gradient).supports(method)


# (method, fixed): alf is adaptive by default and fixed-step with `step_size`
_METHODS = [(m, False) for m in ADAPTIVE_METHODS] + [(m, True) for m in FIXED_METHODS]
_METHODS += [(m, fixed) for m in REVERSIBLE_METHODS for fixed in (False, True) if fixed or is_adaptive(m)]
# the implicit methods run on a fixed grid; the symplectic compositions need a separable field (not this one:
# tests/solvers/schemes/test_symplectic_layers.py covers them)
_METHODS += [(m, True) for m in IMPLICIT_METHODS]
CASES = [(m, fixed, g) for m, fixed in _METHODS for g in ODE_GRADIENTS if _accepted(m, g)]


def _order(method: str) -> int:
    return {**ADAPTIVE_METHODS, **FIXED_METHODS, **REVERSIBLE_METHODS, **IMPLICIT_METHODS}[method]


def _rtol(method: str) -> float:
    """Adaptive tolerances (``rtol = atol``): looser for second-order methods, which would take thousands of
    steps at 1e-7."""
    return 1e-7 if _order(method) >= 3 else 1e-5


def _tolerance(method: str, fixed: bool) -> float:
    """Fixed steps: the global error ``C h^p`` of an order-``p`` method, ``C = 1`` (``y'' = k² y``, ``k < 1``).
    Adaptive: a hundred times the tolerance (local errors accumulate over the steps); dopri8 too, whose values
    between its steps (``h ≈ 0.7`` here) torchdiffeq reads off a quartic, about 2·10⁻⁴ off."""
    if fixed:
        return STEP ** _order(method)
    return 100 * _rtol(method)


class _Decay(nn.Module):
    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -K * y


def test_every_method_and_gradient_is_covered():
    methods = {m for m, _, _ in CASES}
    assert methods == {*ADAPTIVE_METHODS, *FIXED_METHODS, *REVERSIBLE_METHODS, *IMPLICIT_METHODS}
    assert {g for _, _, g in CASES} == set(ODE_GRADIENTS)


@pytest.mark.parametrize(("method", "fixed", "gradient"), CASES, ids=[f"{m}{'-fixed' * f}-{g}" for m, f, g in CASES])
def test_every_question_on_a_closed_form(f64, method, fixed, gradient):
    kw = dict(step_size=STEP) if fixed else dict(rtol=_rtol(method), atol=_rtol(method))
    block = ODEBlock(_Decay(), T=T, method=method, gradient=gradient, **kw)
    tol = _tolerance(method, fixed)
    y0 = torch.tensor([[1.0], [0.8]])
    exact = lambda t: y0 * torch.exp(-K * torch.as_tensor(t)).reshape(-1, 1)  # noqa: E731

    plain = block.solve(y0).stats["nfe_forward"]
    times = [0.0, 0.25, 1.1, T]
    sol = block.solve(y0, t=times)
    assert sol.ys is not None
    for j, tj in enumerate(times):
        assert torch.allclose(sol.ys[j], exact(tj), rtol=0, atol=tol), (tj, sol.ys[j], exact(tj))

    # y falls through 0.5 at ln(y_0 / 0.5) / k
    ev = block.solve(y0, event=lambda t, y: y[:, 0] - 0.5)
    assert ev.fired is not None and ev.stop_times is not None and bool(ev.fired.all())
    want = torch.log(y0[:, 0] / 0.5) / K
    assert torch.allclose(ev.stop_times.detach(), want, rtol=0, atol=10 * tol / (K * 0.5))
    assert torch.allclose(ev.y.detach(), torch.full_like(y0, 0.5), rtol=0, atol=10 * tol)

    t_end = torch.tensor([0.3, 1.7])
    y0g = y0.clone().requires_grad_(True)
    end = block.solve(y0g, t_end=t_end)
    assert torch.allclose(end.y.detach(), y0 * torch.exp(-K * t_end)[:, None], rtol=0, atol=tol)
    (grad,) = torch.autograd.grad(end.y.sum(), y0g)
    assert torch.allclose(grad, torch.exp(-K * t_end)[:, None].expand_as(y0), rtol=0, atol=10 * tol)

    dense = block.solve(y0, dense=True)
    assert torch.allclose(dense.y, exact(T), rtol=0, atol=tol)
    for tj in (0.13, 0.9, 1.77):
        assert torch.allclose(dense.evaluate(tj), exact(tj), rtol=0, atol=tol), tj
    # segments of a few steps each cost at most a few times the plain solve (3x for dopri8, 1.6x for alf); the
    # alf planner used to halve every segment until max_steps ran out. The reversible Runge-Kutta methods step to
    # every sub-point too (no dense output), each forced step at 2s evaluations: 5.6x for reversible_dopri5
    bound = 6 if method.startswith("reversible_") and not fixed else 4
    assert dense.stats["nfe_forward"] <= bound * plain


def test_alf_lands_on_an_output_time_its_step_rounds_onto(f64):
    """From t = 1 a step one ulp short of 0.5 ends on 1.5 after rounding: that is landing there. It used to be
    taken for a step short of 1.5, and the next one, of size 1.5 − 1.5 = 0, failed as a step size underflow
    (seen in the event loop's segments)."""
    h = math.nextafter(0.5, 0.0)
    assert 1.0 + h == 1.5 and h < 1.5 - 1.0
    t = torch.tensor([1.0, 1.5])
    y0 = torch.ones(1, 1)
    solver = SolverOptions("alf", rtol=1.0, atol=1.0, options={"first_step": h})
    ys, stats = integrate(_Decay(), y0, t, solver=solver, gradient=Backprop())
    assert stats.steps_forward == 1
    # one leapfrog step: z_½ = z_0 + (h/2) v_0, v_1 = 2 F(z_½) − v_0, z_1 = z_½ + (h/2) v_1
    zm = 1.0 - 0.5 * h * K
    v1 = 2 * (-K * zm) + K
    assert float(ys[-1, 0, 0]) == pytest.approx(zm + 0.5 * h * v1, rel=1e-15)
