"""Inputs and failures that used to be answered by a message naming the wrong thing (or nothing): each now raises
an error that names the argument and the fix, with a machine-readable reason, or returns the right empty answer."""

import warnings

import pytest
import torch
from torch import nn

from cde_nets import ContinuousFlow, ODEBlock, discretize, odeint, odeint_adjoint
from cde_nets.functional import METHODS
from cde_nets.solvers.errors import Reason
from cde_nets.solvers.steppers.implicit import ImplicitSolveError

F64 = torch.float64


class Lin(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.lin = nn.Linear(n, n).double()

    def forward(self, t, y):
        return torch.tanh(self.lin(y))


T3 = torch.tensor([0.0, 0.5, 1.0], dtype=F64)


# -- non-finite and half-precision inputs -----------------------------------------------------------------------


def test_nan_in_y0_names_y0_and_no_tolerance_advice():
    y0 = torch.tensor([[1.0, float("nan"), 0.0]], dtype=F64)
    for method in ("dopri5", "rk4"):
        with pytest.raises(
            ValueError, match=r"`y0` holds 1 non-finite value\(s\) \(NaN or inf\), the first at index \(0, 1\)"
        ) as info:
            odeint(Lin(), y0, T3, method=method)
        assert "rtol" not in str(info.value)
    with pytest.raises(ValueError, match=r"`y0\[1\]` holds 1 non-finite value"):
        odeint(lambda t, s: s, (torch.ones(2, dtype=F64), torch.tensor([float("inf")], dtype=F64)), T3)


def test_nan_in_flow_data_names_x():
    flow = ContinuousFlow(Lin(2))
    x = torch.randn(5, 2, dtype=F64)
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"`x` holds 1 non-finite value\(s\) \(NaN or inf\), first in sample 3"):
        flow.log_prob(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_refused_by_adaptive_methods_as_the_block_refuses_it(dtype):
    y0 = torch.ones(2, 3, dtype=dtype)
    with pytest.raises(ValueError, match=r"adaptive method='dopri5' does not support .*16 states.*method='rk4'"):
        odeint(lambda t, y: -y, y0, T3.to(dtype))
    out = odeint(lambda t, y: -y, y0, T3.to(dtype), method="rk4", options={"step_size": 0.25})
    assert out.dtype == dtype and abs(float(out[-1, 0, 0]) - 0.3679) < 2e-2  # e^(-1), in half precision


# -- an empty batch ------------------------------------------------------------------------------------------------


def _empty_options(method):
    return (
        {"step_size": 0.25}
        if method not in ("dopri5", "tsit5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun", "scipy_solver")
        else None
    )


@pytest.mark.parametrize("method", METHODS)
def test_empty_batch_returns_an_empty_result_in_every_method(method):
    """``(len(t), 0, 3)``, joined to the field's graph (its parameters receive zero gradients), as ODEBlock's."""
    f = Lin()
    y0 = torch.ones(0, 3, dtype=F64, requires_grad=True)
    ys = odeint(f, y0, T3, method=method, options=_empty_options(method))
    assert ys.shape == (3, 0, 3)
    ys.sum().backward()
    assert y0.grad is not None and y0.grad.shape == (0, 3)
    assert f.lin.weight.grad is not None and not f.lin.weight.grad.any()


@pytest.mark.parametrize("gradient", ["checkpoint", "symplectic", "adjoint"])
def test_empty_batch_in_every_gradient_mode_and_controller(gradient):
    f = Lin()
    y0 = torch.ones(0, 3, dtype=F64)
    assert odeint(f, y0, T3, gradient=gradient).shape == (3, 0, 3)
    assert odeint(f, y0, T3, controller="per_sample", gradient=gradient).shape == (3, 0, 3)
    assert odeint_adjoint(f, y0, T3).shape == (3, 0, 3)
    a, b = odeint(lambda t, s: (-s[0], s[1]), (torch.ones(0, dtype=F64), torch.ones(2, 0, dtype=F64)), T3)
    assert a.shape == (3, 0) and b.shape == (3, 2, 0)


# -- a singular Newton matrix ------------------------------------------------------------------------------------


class Square(nn.Module):
    """``y' = y²``: implicit midpoint's stage ``Y = y_0 + (h/2) Y²`` has no real root for ``y_0 = 1, h = 1``, and
    its Newton matrix ``1 − h Y`` at the start ``Y = 1`` is singular."""

    def forward(self, t, y):
        return y * y


SINGULAR = (
    r"Newton matrix I − h A ⊗ J of the implicit step at t=0 \(h=1\) is singular in sample\(s\) \[0\].*smaller steps"
)


@pytest.mark.parametrize(
    "solve",
    [
        lambda y: odeint(
            Square(), y[0], torch.tensor([0.0, 1.0], dtype=F64), method="implicit_midpoint", options={"step_size": 1.0}
        ),
        lambda y: ODEBlock(Square(), T=1.0, method="implicit_midpoint", step_size=1.0)(y),
        lambda y: discretize(Square(), "implicit_midpoint", T=1.0, steps=1)(y),
    ],
    ids=["odeint", "block", "discrete"],
)
def test_singular_newton_matrix_is_an_implicit_solve_error(solve):
    with pytest.raises(ImplicitSolveError, match=SINGULAR) as info:
        solve(torch.ones(1, 1, dtype=F64))
    assert info.value.reason is Reason.NEWTON_SINGULAR


# -- a NAIS net that breaks Condition N1 -------------------------------------------------------------------------


def _nais(project: bool, layers: int = 1):
    from cde_nets.fields import NAIS

    g = torch.Generator().manual_seed(0)
    field = NAIS(8, 3, layers=layers, T=1.0, eps=0.1, init_std=3.0, generator=g).double()
    if project:
        field.project_()
    return field, torch.zeros(16, 8, dtype=F64), torch.randn(16, 3, dtype=F64, generator=g)


def test_nais_net_without_stopping_warns_once_when_its_weights_break_condition_n1():
    field, x0, u = _nais(project=False)
    net = discretize(field, "euler")
    assert field.stability_margin(x0, u, h=1.0) > 100
    with pytest.warns(UserWarning, match=r"stability_margin\(x, u\)` = [0-9.]+ >= 1.*project_\(\)") as record:
        net(x0, u=u)
        net(x0, u=u)
    assert len([w for w in record if "stability_margin" in str(w.message)]) == 1  # once per net
    with pytest.warns(UserWarning, match="stability_margin"):
        discretize(field, "euler")(x0, u=u)  # another net warns again


def test_nais_stopping_net_warns_once_per_net():
    from cde_nets import Stop

    field, x0, u = _nais(project=False)
    net = discretize(field, "euler", stop=Stop(eps=1e-3, max_depth=20))
    with pytest.warns(UserWarning, match="stability_margin") as record:
        for _ in range(3):
            net.solve(x0, u=u)
    assert len([w for w in record if "stability_margin" in str(w.message)]) == 1


def test_projected_nais_net_is_silent():
    field, x0, u = _nais(project=True, layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        discretize(field, "euler")(x0, u=u)
