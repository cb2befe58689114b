"""The engine's recipes: a new explicit Runge-Kutta method is one tableau plus one line of ``TABLEAUX``, a new
step-size controller one class plus one line of ``CONTROLLERS``; each is then served by both doors (``ODEBlock``
and ``cde_nets.odeint``), by every gradient method that serves its kind, and listed in the capability table. (The
gradient recipe: tests/solvers/gradients/test_gradient_objects.py.)"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, odeint
from cde_nets.solvers.capabilities import markdown
from cde_nets.solvers.controllers import CONTROLLERS, Integral
from cde_nets.solvers.options import ADAPTIVE_METHODS, FIXED_METHODS
from cde_nets.solvers.steppers.tableaux import TABLEAUX

sys.path.insert(0, str(Path(__file__).parent))
from toy_controller import Elementary  # noqa: E402
from toy_stepper import RALSTON  # noqa: E402

F64 = torch.float64


class Linear(nn.Module):
    def __init__(self, a: torch.Tensor):
        super().__init__()
        self.a = nn.Parameter(a.clone())
        self.accepted: list[tuple[float, torch.Tensor, float]] = []

    def forward(self, t, y):
        return y @ self.a.T

    def callback_accept_step(self, t0, y0, dt):
        self.accepted.append((float(t0), y0.detach().clone(), float(dt)))


def _field() -> Linear:
    return Linear(torch.tensor([[-0.5, 1.0], [-1.0, -0.3]], dtype=F64))


def _y0() -> torch.Tensor:
    return torch.tensor([[1.0, 0.5], [-0.3, 0.8]], dtype=F64, requires_grad=True)


def _both_doors(field: Linear, y0: torch.Tensor, t: torch.Tensor, gradient: str, block_kw: dict, odeint_kw: dict):
    """(values, gradients) of the same solve through each door."""
    out = []
    for door in ("block", "odeint"):
        if door == "block":
            ys = ODEBlock(field, float(t[-1]), gradient=gradient, **block_kw).solve(y0, t=t).ys
        else:
            ys = odeint(field, y0, t, gradient=gradient, **odeint_kw)
        out.append((ys.detach(), torch.autograd.grad(ys.square().sum(), [y0, field.a])))
    return out


def test_a_new_runge_kutta_method_is_one_tableau_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(TABLEAUX, "ralston", RALSTON)  # the one registry line
    assert FIXED_METHODS["ralston"] == 2 and "ralston" not in ADAPTIVE_METHODS
    assert "`ralston`" in markdown()
    field, y0 = _field(), _y0()
    # one step on y' = A y is the degree-2 Taylor polynomial of exp(hA), as for every 2-stage second-order method
    h = 0.1
    one = odeint(field, y0, torch.tensor([0.0, h], dtype=F64), method="ralston", options={"step_size": h})[-1]
    hA = h * field.a.detach()
    expected = y0.detach() @ (torch.eye(2, dtype=F64) + hA + hA @ hA / 2).T
    assert torch.allclose(one.detach(), expected, rtol=1e-15, atol=1e-16)
    # second order: halving the step divides the error at t = 1 by 4
    exact = y0.detach() @ torch.linalg.matrix_exp(field.a.detach()).T
    errs = []
    for n in (20, 40, 80):
        ys = odeint(field, y0, torch.tensor([0.0, 1.0], dtype=F64), method="ralston", options={"step_size": 1 / n})
        errs.append(float((ys[-1].detach() - exact).abs().max()))
    orders = [math.log2(a / b) for a, b in zip(errs, errs[1:])]
    assert all(abs(p - 2.0) < 0.05 for p in orders), orders
    # both doors, the same values and gradients, and the exact replays equal backprop through the same steps
    t = torch.tensor([0.0, 0.5, 1.0], dtype=F64)
    results = {}
    for gradient in ("backprop", "checkpoint", "symplectic"):
        (vb, gb), (vo, go) = _both_doors(
            field,
            y0,
            t,
            gradient,
            dict(method="ralston", step_size=0.1),
            dict(method="ralston", options={"step_size": 0.1}),
        )
        assert torch.allclose(vb, vo, rtol=1e-12, atol=1e-14)  # as the engine matrix test
        for a, b in zip(gb, go):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
        results[gradient] = gb
    for gradient in ("checkpoint", "symplectic"):
        for a, b in zip(results[gradient], results["backprop"]):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def _dopri5_ratio(field: Linear, t0: float, y0: torch.Tensor, h: float, rtol: float, atol: float) -> float:
    """The error ratio of one dopri5 step, by hand from its tableau (Dormand & Prince 1980)."""
    tab = TABLEAUX["dopri5"]
    a, b, c, e = tab.tableau.a, tab.tableau.b, tab.tableau.c, tab.error
    ks: list[torch.Tensor] = []
    with torch.no_grad():
        for i in range(len(b)):
            yi = y0 + h * sum((aij * k for aij, k in zip(a[i], ks)), torch.zeros_like(y0))
            ks.append(field(t0 + c[i] * h, yi))
        y1 = y0 + h * sum(bi * k for bi, k in zip(b, ks))
        err = h * sum(ei * k for ei, k in zip(e, ks))
        scale = atol + rtol * torch.maximum(y0.abs(), y1.abs())
        return float((err / scale).square().mean().sqrt())


def test_a_new_step_size_controller_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(CONTROLLERS, "elementary", Elementary)  # the one registry line
    field, y0 = _field(), _y0()
    rtol, atol = 1e-6, 1e-9
    t = torch.tensor([0.0, 4.0], dtype=F64)
    kw = dict(method="dopri5", rtol=rtol, atol=atol, controller="elementary")
    # every accepted step's successor is h · min(10, max(0.9 r^(-1/6), 1)) of that step's error ratio
    with torch.no_grad():
        odeint(field, y0, t, **kw)
    steps = field.accepted
    assert len(steps) > 10
    checked = 0
    for (t0, y, h), (t1, _, h_next) in zip(steps, steps[1:-1]):
        if not math.isclose(t1, t0 + h, rel_tol=1e-12):  # a rejection between them
            continue
        r = _dopri5_ratio(field, t0, y, h, rtol, atol)
        mine, torchdiffeqs = Elementary().factor(r, 5), Integral().factor(r, 5)
        assert math.isclose(h_next, h * mine, rel_tol=1e-7), (h_next / h, mine, r)  # r by hand, to rounding
        checked += abs(mine - torchdiffeqs) > 1e-3 * mine
    assert checked > 5  # steps where the two rules differ
    # both doors, by name and as an object; replays (checkpoint) follow the same rule
    grads = {}
    for controller in ("elementary", Elementary()):
        for gradient in ("backprop", "checkpoint"):
            field.accepted.clear()
            tt = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
            opts = dict(method="dopri5", rtol=rtol, atol=atol, controller=controller)
            (vb, gb), (vo, go) = _both_doors(field, y0, tt, gradient, opts, opts)
            assert torch.allclose(vb, vo, rtol=1e-12, atol=1e-14)
            for a, b in zip(gb, go):
                assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
            grads[gradient] = gb
        for a, b in zip(grads["checkpoint"], grads["backprop"]):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_a_shared_step_controller_is_refused_where_it_would_be_ignored():
    field, y0, t = _field(), _y0(), torch.tensor([0.0, 1.0], dtype=F64)
    for door in (
        lambda: odeint(field, y0, t, method="rk4", options={"step_size": 0.1}, controller=Integral(safety=0.8)),
        lambda: ODEBlock(field, 1.0, method="rk4", step_size=0.1, controller=Integral(safety=0.8)),
    ):
        with pytest.raises(ValueError, match=r"controller=Integral\(safety=0.8.*method='rk4'.*controller='batch'"):
            door()
    with pytest.raises(ValueError, match=r"options \['safety'\] and controller=.*set them on the object"):
        odeint(field, y0, t, options={"safety": 0.5}, controller=Integral(safety=0.8))
    with pytest.raises(ValueError, match=r"`controller` must be one of \('batch', 'per_sample'\)"):
        odeint(field, y0, t, controller="pid")
    with pytest.raises(ValueError, match=r"Integral.safety"):
        Integral(safety=-1.0)


def test_the_per_sample_controller_object_carries_its_constants_to_both_doors():
    from cde_nets.solvers.controllers import PerSample

    field, y0, t = _field(), _y0(), torch.tensor([0.0, 1.0], dtype=F64)
    with torch.no_grad():
        by_options = odeint(field, y0, t, controller="per_sample", options={"safety": 0.7}, rtol=1e-6, atol=1e-9)
        by_object = odeint(field, y0, t, controller=PerSample(safety=0.7), rtol=1e-6, atol=1e-9)
        default = odeint(field, y0, t, controller="per_sample", rtol=1e-6, atol=1e-9)
        block = ODEBlock(field, 1.0, rtol=1e-6, atol=1e-9, controller=PerSample(safety=0.7)).solve(y0, t=t).ys
    assert torch.equal(by_object, by_options) and torch.equal(block, by_options)
    assert not torch.equal(by_options, default)  # the constant is honoured, not ignored


def test_a_registered_controller_takes_its_constants_from_options_in_both_doors(monkeypatch):
    """``controller="elementary", options={"safety": 0.7}`` is ``controller=Elementary(safety=0.7)``: the name's
    constants come from torchdiffeq's options, in both doors (neither ignored nor refused)."""
    monkeypatch.setitem(CONTROLLERS, "elementary", Elementary)
    field, y0, t = _field(), _y0(), torch.tensor([0.0, 1.0], dtype=F64)
    kw = dict(method="dopri5", rtol=1e-6, atol=1e-9)
    with torch.no_grad():
        by_object = odeint(field, y0, t, controller=Elementary(safety=0.7), **kw)
        by_name = odeint(field, y0, t, controller="elementary", options={"safety": 0.7}, **kw)
        block = ODEBlock(field, 1.0, controller="elementary", options={"safety": 0.7}, **kw).solve(y0, t=t).ys
        default = odeint(field, y0, t, controller="elementary", **kw)
    assert torch.equal(by_name, by_object) and torch.equal(block, by_object)
    assert not torch.equal(default, by_object)


class VanDerPol(nn.Module):
    def __init__(self, mu: float):
        super().__init__()
        self.mu = nn.Parameter(torch.tensor(mu, dtype=F64))

    def forward(self, t, y):
        x, v = y[..., 0], y[..., 1]
        return torch.stack([v, self.mu * (1 - x**2) * v - x], dim=-1)


@pytest.mark.parametrize("door", ["block", "odeint"])
def test_a_new_controllers_step_sizes_are_differentiated_on_a_stiff_sample(monkeypatch, door):
    """Van der Pol at mu = 20 under the toy controller: the gradient (step sizes differentiated through the
    controller's own rule, by the base class) is the central difference of the same solve, in both doors; the
    replay (checkpoint) gives the same gradient."""
    monkeypatch.setitem(CONTROLLERS, "elementary", Elementary)
    field = VanDerPol(20.0)
    y0 = torch.tensor([[2.0, 0.0]], dtype=F64)
    t = torch.tensor([0.0, 1.0], dtype=F64)
    kw = dict(method="dopri5", rtol=1e-5, atol=1e-7, controller="elementary")

    def loss(gradient: str = "backprop") -> torch.Tensor:
        if door == "block":
            ys = ODEBlock(field, 1.0, gradient=gradient, **kw).solve(y0, t=t).ys
        else:
            ys = odeint(field, y0, t, gradient=gradient, **kw)
        return ys[-1].sum()

    grads = {g: torch.autograd.grad(loss(g), field.mu)[0] for g in ("backprop", "checkpoint")}
    h = 1e-6
    with torch.no_grad():
        field.mu += h
        up = float(loss())
        field.mu -= 2 * h
        down = float(loss())
        field.mu += h
    fd = (up - down) / (2 * h)
    # relative 1e-5: holding the step sizes fixed instead (the derivative of another map) is 5e-4 off here
    assert abs(float(grads["backprop"]) - fd) < 1e-5 * abs(fd), (float(grads["backprop"]), fd)
    assert torch.allclose(grads["checkpoint"], grads["backprop"], rtol=1e-10, atol=1e-12)


def test_a_block_with_a_controller_object_deepcopies_and_moves_dtype():
    import copy

    field, y0 = _field(), _y0().detach()
    block = ODEBlock(field, 1.0, method="dopri5", rtol=1e-6, atol=1e-9, controller=Elementary(safety=0.7))
    twin = copy.deepcopy(block)
    assert twin.solver.controller == Elementary(safety=0.7)
    with torch.no_grad():
        assert torch.equal(twin(y0), block(y0))
        low = copy.deepcopy(block).to(torch.float32)(y0.float())
    assert low.dtype == torch.float32 and torch.allclose(low.double(), block(y0), rtol=1e-4, atol=1e-5)
