"""``odeint_event`` on event functions that torchdiffeq's own examples write: a branch that returns a value without
a graph (``learn_physics.py``'s terminal-time guard), and an event that never changes sign. Compared live with
torchdiffeq's event time, and with the closed form of ``y' = −1``."""

import math
import re

import pytest
import torch
from torch import nn

import cde_nets
from cde_nets import functional, odeint_event
from cde_nets.solvers.errors import Reason, SolverError

torchdiffeq = pytest.importorskip("torchdiffeq")

F64 = torch.float64
TOL = dict(rtol=1e-8, atol=1e-8)


class Fall(nn.Module):
    """``y' = −1``: from ``y_0`` at ``t_0`` the level ``y = 1`` is reached at ``t* = t_0 + y_0 − 1``."""

    def forward(self, t, y):
        return -torch.ones_like(y)


def guarded(end: float):
    """torchdiffeq's ``learn_physics.py`` pattern: past ``end`` the event function returns ``zeros_like(t)``, a
    value that depends on neither ``t`` nor ``y`` (no graph), so the search stops at ``end`` at the latest."""

    def event_fn(t, y):
        if t > end:
            return torch.zeros_like(t)
        return y - 1.0

    return event_fn


def _event(lib, y0: float, t0: float, end: float):
    y = torch.tensor(y0, dtype=F64, requires_grad=True)
    t = torch.tensor(t0, dtype=F64, requires_grad=True)
    event_t, sol = lib.odeint_event(Fall(), y, t, event_fn=guarded(end), **TOL)
    return y, t, event_t, sol


def test_guard_without_graph_stops_where_torchdiffeq_stops_with_zero_gradient():
    """The reduced reproducer of ``learn_physics.py``: ``y_0 = 10`` would reach ``y = 1`` at ``t = 9``, but the
    guard at ``t = 2`` stops the search there first. The event time is torchdiffeq's (``2 + 1.2e-10``, the root
    finder's bracket on the jump); the guard's time does not move with ``y_0`` or ``t_0``, so ``∂t*/∂y_0 = 0``
    and ``∂t*/∂t_0 = 0`` (torchdiffeq's formula gives 0 for ``y_0``: ``∂g/∂y = 0``), and the state there,
    ``y(t*) = y_0 − (t* − t_0)``, has ``∂y(t*)/∂y_0 = 1``, ``∂y(t*)/∂t_0 = 1``."""
    y0, t0, event_t, sol = _event(cde_nets, 10.0, 0.0, 2.0)
    ty0, _, ref_t, ref_sol = _event(torchdiffeq, 10.0, 0.0, 2.0)
    assert abs(float(ref_t.detach()) - 2.0) < 1e-9 and float(ref_t.detach()) > 2.0
    assert float(event_t.detach()) == float(ref_t.detach())
    assert abs(float(sol[-1].detach()) - float(ref_sol[-1].detach())) < 1e-12
    gy, gt = torch.autograd.grad(event_t, (y0, t0), retain_graph=True)
    (ref_gy,) = torch.autograd.grad(ref_t, ty0)
    assert float(gy.detach()) == float(ref_gy.detach()) == 0.0
    assert float(gt.detach()) == 0.0
    gy, gt = torch.autograd.grad(sol[-1], (y0, t0))
    assert abs(float(gy.detach()) - 1.0) < 1e-9 and abs(float(gt.detach()) - 1.0) < 1e-9


def test_guard_not_reached_gives_the_level_crossing_and_its_gradient():
    """With the guard at ``t = 20`` the level is crossed first, at ``t* = t_0 + y_0 − 1``: ``∂t*/∂y_0 = 1``
    (torchdiffeq's formula ``−(∂g/∂y)/(dg/dt) = −1/(−1)``), ``∂t*/∂t_0 = 1``; the central difference of the
    event time in ``y_0`` agrees."""
    y0, t0, event_t, _ = _event(cde_nets, 10.0, 0.5, 20.0)
    ty0, _, ref_t, _ = _event(torchdiffeq, 10.0, 0.5, 20.0)
    assert abs(float(event_t.detach()) - 9.5) < 1e-8
    assert float(event_t.detach()) == float(ref_t.detach())
    gy, gt = torch.autograd.grad(event_t, (y0, t0))
    (ref_gy,) = torch.autograd.grad(ref_t, ty0)
    assert abs(float(gy.detach()) - 1.0) < 1e-12
    assert abs(float(ref_gy.detach()) - 1.0) < 1e-11  # torchdiffeq adds 1e-12 to dg/dt
    assert abs(float(gt.detach()) - 1.0) < 1e-12
    h = 1e-3
    with torch.no_grad():
        up = float(_event(cde_nets, 10.0 + h, 0.5, 20.0)[2])
        down = float(_event(cde_nets, 10.0 - h, 0.5, 20.0)[2])
    assert abs((up - down) / (2 * h) - 1.0) < 1e-6


def test_event_that_never_changes_sign_is_named_with_its_last_value():
    """``y' = −y`` from 1 never reaches ``y = −1``: the search stops at its step limit and says so, with the
    event function's value where it started (``g = 2``) and where it stopped: ``g = 1 + e^(−t)`` there."""
    pattern = (
        r"never changed sign within max_num_steps=50 steps: g = 2 at t = 0 \(the start\), "
        r"g = ([0-9.e+-]+) at t = ([0-9.e+-]+) \(the last time searched\)"
    )
    with pytest.raises(SolverError, match=pattern) as info:
        odeint_event(
            lambda t, y: -y,
            torch.ones((), dtype=F64),
            torch.tensor(0.0, dtype=F64),
            event_fn=lambda t, y: y + 1.0,
            options={"max_num_steps": 50},
        )
    assert info.value.reason is Reason.NO_EVENT
    g_last, t_last = (float(v) for v in re.search(pattern, str(info.value)).groups())
    assert t_last > 1.0 and abs(g_last - (1.0 + math.exp(-t_last))) < 1e-5


def test_event_search_has_a_default_step_limit(monkeypatch):
    """torchdiffeq searches without end (the decaying ``y`` above would run for ever); here a default limit of
    steps (``EVENT_MAX_STEPS``, lowered for the test) stops it, and the message names how to raise it."""
    assert functional.EVENT_MAX_STEPS == 100_000  # the blocks' `max_steps` default
    monkeypatch.setattr(functional, "EVENT_MAX_STEPS", 40)
    calls = []

    def field(t, y):
        calls.append(1)
        return -y

    with pytest.raises(SolverError, match=r"never changed sign within 40 steps.*options\['max_num_steps'\]"):
        odeint_event(
            field,
            torch.ones((), dtype=F64),
            torch.tensor(0.0, dtype=F64),
            event_fn=lambda t, y: y + 1.0,
            rtol=1e-3,
            atol=1e-6,
        )
    assert len(calls) <= 6 * 41 + 2  # dopri5: six evaluations a step, two for the first step size


def test_fixed_step_event_search_that_never_changes_sign_is_named():
    """torchdiffeq's fixed-step search gives up after 20000 steps with a bare RuntimeError: named the same way."""
    with pytest.raises(SolverError, match=r"never changed sign within 20000 steps .*g = 2 at t = 0 ") as info:
        odeint_event(
            lambda t, y: -y,
            torch.ones((), dtype=F64),
            torch.tensor(0.0, dtype=F64),
            event_fn=lambda t, y: y + 1.0,
            method="euler",
            options={"step_size": 1.0},
        )
    assert info.value.reason is Reason.NO_EVENT


@pytest.mark.parametrize("method", ["gl4", "implicit_euler"])
def test_adjoint_event_on_an_implicit_method_is_served(method: str) -> None:
    """The implicit methods' adjoint is the backsolve of their own steps; the event's re-solve asked it with the
    forward tolerances spelled out as backward ones, which that adjoint refuses. ``y' = −1`` from 2: the level 1 at
    ``t* = 1`` exactly (every Runge-Kutta method is exact on it), ``dt*/dy_0 = 1``."""
    y = torch.tensor(2.0, dtype=F64, requires_grad=True)
    t0 = torch.tensor(0.0, dtype=F64)
    event_t, sol = odeint_event(
        Fall(), y, t0, event_fn=lambda t, y: y - 1.0, method=method, options={"step_size": 0.25}, atol=1e-10,
        odeint_interface=cde_nets.odeint_adjoint,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(event_t, y)
    assert abs(float(event_t.detach()) - 1.0) < 1e-9
    assert abs(float(grad) - 1.0) < 1e-12


def test_per_sample_events_stop_each_sample_at_its_own_root() -> None:
    """``y' = −1`` from ``y_0 = (2, 3.5)``: the level 1 at ``t* = y_0 − 1 = (1, 2.5)``, ``dt*_i/dy_{0,i} = 1``; a
    sample with no root in the span stops at its end (``y_0 = 5``: at ``t = 3``, ``y = 2``)."""
    y0 = torch.tensor([[2.0], [3.5], [5.0]], dtype=F64, requires_grad=True)
    t = torch.tensor([0.0, 3.0], dtype=F64)
    event_t, sol = cde_nets.odeint(Fall(), y0, t, event_fn=lambda t, y: y[:, 0] - 1.0, event_mode="per_sample", **TOL)
    torch.testing.assert_close(event_t, torch.tensor([1.0, 2.5, 3.0], dtype=F64), rtol=0, atol=1e-9)
    torch.testing.assert_close(sol[-1, :, 0], torch.tensor([1.0, 1.0, 2.0], dtype=F64), rtol=0, atol=1e-9)
    (grad,) = torch.autograd.grad(event_t[:2].sum(), y0)
    torch.testing.assert_close(grad[:, 0], torch.tensor([1.0, 1.0, 0.0], dtype=F64), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="odeint_event searches without an end time.*event_mode='per_sample'"):
        odeint_event(Fall(), y0, t[0], event_fn=lambda t, y: y[:, 0] - 1.0, event_mode="per_sample")


def test_odeint_dense_reads_the_trajectory_anywhere() -> None:
    """``y' = −1``: ``y(s) = y_0 − s`` at any ``s`` of the span, ``∂y(s)/∂y_0 = 1`` (the Hermite interpolant is
    exact on a line)."""
    y0 = torch.tensor([[2.0], [3.0]], dtype=F64, requires_grad=True)
    dense = cde_nets.odeint_dense(Fall(), y0, torch.tensor([0.0, 2.0], dtype=F64), **TOL)
    ys = dense.evaluate([0.3, 1.7])
    torch.testing.assert_close(ys[:, :, 0], torch.tensor([[1.7, 2.7], [0.3, 1.3]], dtype=F64), rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(ys.sum(), y0)
    torch.testing.assert_close(grad, torch.full_like(y0, 2.0), rtol=0, atol=1e-12)
