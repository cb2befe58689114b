"""``cde_nets.odeint``/``odeint_adjoint``/``odeint_event``: torchdiffeq's semantics on this library's engine.

Values against torchdiffeq's own functions (same steps: equal to rounding) and against closed forms; gradients
against torchdiffeq, closed forms and finite differences (float64)."""

import math

import pytest
import torch
import torchdiffeq
from torch import nn
from torchdiffeq_reference import torchdiffeq_method

from cde_nets import odeint, odeint_adjoint, odeint_event
from cde_nets.solvers import SolverError
from cde_nets.solvers.gradients import Backprop

F64 = torch.float64


class Field(nn.Module):
    """A non-autonomous nonlinear field with parameters."""

    def __init__(self, dim=2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.W = nn.Parameter(torch.randn(dim, dim, generator=g, dtype=F64) * 0.8)
        self.b = nn.Parameter(torch.randn(dim, generator=g, dtype=F64) * 0.1)

    def forward(self, t, y):
        return torch.tanh(y @ self.W.T + self.b) * torch.cos(t)


def _y0(shape=(3, 2), dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=dtype).requires_grad_()


TIMES = {
    "increasing": torch.tensor([0.5, 0.9, 2.0], dtype=F64),
    "decreasing": torch.tensor([2.0, 1.2, -0.5], dtype=F64),
}
# dopri8 reads its outputs off its own extension (docs/guides/torchdiffeq_differences.md): its own test below
CASES = [("dopri5", None), ("bosh3", None), ("adaptive_heun", None), ("fehlberg2", None)]
CASES += [(m, {"step_size": 0.1}) for m in ("euler", "midpoint", "heun2", "heun3", "rk4", "explicit_adams")]


@pytest.mark.parametrize("times", TIMES)
@pytest.mark.parametrize("method,options", CASES)
def test_values_and_gradients_are_torchdiffeqs(method, options, times):
    """Same steps as torchdiffeq: values and backprop gradients equal to rounding, from any start, either way.
    bosh3, fehlberg2 and adaptive_heun read outputs off a corrected interpolant (a deliberate difference, see
    tests/torchdiffeq_reference.py): compared with torchdiffeq's loop running that interpolant."""
    f, y0, t = Field(), _y0(), TIMES[times]
    # the second-order adaptive methods at 1e-7 take thousands of steps: a looser tolerance keeps this fast
    tol = dict(rtol=1e-5, atol=1e-7) if method in ("adaptive_heun", "fehlberg2") else {}
    # torchdiffeq's backprop holds every step size after the first fixed: compare with that setting
    ours = odeint(f, y0, t, method=method, options=options, gradient=Backprop(steps="torchdiffeq"), **tol)
    theirs = torchdiffeq.odeint(f, y0, t, method=torchdiffeq_method(method), options=options, **tol)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    g_ours = torch.autograd.grad(ours.square().sum(), (y0, f.W))
    g_theirs = torch.autograd.grad(theirs.square().sum(), (y0, f.W))
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


class Logged(Field):
    """:class:`Field` with torchdiffeq's step callbacks, which log ``(kind, t0, dt)``."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, float, float]] = []

    def callback_step(self, t0, y0, dt):
        self.log.append(("step", float(t0), float(dt)))

    def callback_accept_step(self, t0, y0, dt):
        self.log.append(("accept", float(t0), float(dt)))

    def callback_reject_step(self, t0, y0, dt):
        self.log.append(("reject", float(t0), float(dt)))


@pytest.mark.parametrize("times", TIMES)
@pytest.mark.parametrize("method", ["fehlberg2", "adaptive_heun"])
def test_callbacks_are_torchdiffeqs(method, times):
    """The methods that carry their last stage into the next step call every callback as torchdiffeq does, at
    the same times and step sizes, rejections included, either way in time."""
    ours_f, theirs_f, y0, t = Logged(), Logged(), _y0(), TIMES[times]
    with torch.no_grad():
        odeint(ours_f, y0, t, method=method, rtol=1e-4, atol=1e-6)
        torchdiffeq.odeint(theirs_f, y0, t, method=torchdiffeq_method(method), rtol=1e-4, atol=1e-6)
    assert ours_f.log == theirs_f.log and any(kind == "reject" for kind, _, _ in ours_f.log)


@pytest.mark.parametrize("times", TIMES)
def test_dopri8_takes_torchdiffeqs_steps(times):
    """dopri8 through the odeint door takes torchdiffeq's steps (every callback, either way in time); at the ends
    of its steps, where both dense outputs are the step, values and torchdiffeq's backprop gradients are its."""
    ours_f, theirs_f, y0, t = Logged(), Logged(), _y0(), TIMES[times]
    with torch.no_grad():
        odeint(ours_f, y0, t, method="dopri8", rtol=1e-9, atol=1e-11)
        torchdiffeq.odeint(theirs_f, y0, t, method="dopri8", rtol=1e-9, atol=1e-11)
    assert ours_f.log == theirs_f.log and any(kind == "reject" for kind, _, _ in ours_f.log)
    sign = 1.0 if times == "increasing" else -1.0  # the callbacks give t0 in the user's time, dt > 0
    ends = [t0 + sign * dt for kind, t0, dt in ours_f.log if kind == "accept"]
    inner = torch.tensor([float(t[0]), *(e for e in ends if sign * (float(t[-1]) - e) > 0)], dtype=F64)
    f = Field()
    ours = odeint(f, y0, inner, method="dopri8", rtol=1e-9, atol=1e-11, gradient=Backprop(steps="torchdiffeq"))
    theirs = torchdiffeq.odeint(f, y0, inner, method="dopri8", rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    g_ours = torch.autograd.grad(ours.square().sum(), (y0, f.W))
    g_theirs = torch.autograd.grad(theirs.square().sum(), (y0, f.W))
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("times", TIMES)
def test_adjoint_agrees_with_torchdiffeqs_seminorm_adjoint(times):
    """The backward solve is torchdiffeq's with ``norm="seminorm"`` (Kidger et al. 2021), whose norm also holds
    ``|t|``: the gradients agree to the tolerance (1e-8), the values exactly."""
    f, y0, t = Field(), _y0(), TIMES[times]
    ours = odeint_adjoint(f, y0, t, rtol=1e-8, atol=1e-10)
    theirs = torchdiffeq.odeint_adjoint(f, y0, t, rtol=1e-8, atol=1e-10, adjoint_options=dict(norm="seminorm"))
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    g_ours = torch.autograd.grad(ours.square().sum(), (y0, f.W, f.b))
    g_theirs = torch.autograd.grad(theirs.square().sum(), (y0, f.W, f.b))
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-7)


@pytest.mark.parametrize("gradient", ["checkpoint", "symplectic"])
def test_replayed_gradients_equal_backprop(gradient):
    """The exact gradients of the steps, also for decreasing times (the engine sees them negated): equal to
    backprop's on a fixed grid; with adaptive steps backprop also differentiates the step sizes' dependence on
    the state (torchdiffeq's), a difference of the order of the tolerance."""
    f, y0 = Field(), _y0()
    for t in TIMES.values():
        for kw, tol in ((dict(method="rk4", options=dict(step_size=0.1)), 1e-12), ({}, 1e-6)):
            ref = torch.autograd.grad(odeint(f, y0, t, **kw).sum(), (y0, f.W))
            got = torch.autograd.grad(odeint(f, y0, t, gradient=gradient, **kw).sum(), (y0, f.W))
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("gradient", ["backprop", "adjoint", "checkpoint"])
def test_time_gradients_closed_form(gradient):
    """``y' = −y``: ``y(t_i) = y_0 e^{−(t_i − t_0)}``, so for ``ℒ = Σ_i y(t_i)`` (``i ≥ 1``)
    ``∂ℒ/∂t_i = −y(t_i)`` and ``∂ℒ/∂t_0 = Σ_i y(t_i)``; decreasing times likewise."""

    class Decay(nn.Module):
        def forward(self, t, y):
            return -y

    for tl in ([0.3, 1.0, 2.5], [2.5, 1.0, 0.3]):
        t = torch.tensor(tl, dtype=F64, requires_grad=True)
        ys = odeint(Decay(), torch.tensor(2.0, dtype=F64), t, gradient=gradient, rtol=1e-12, atol=1e-14)
        ys[1:].sum().backward()
        y = 2.0 * torch.exp(-(t.detach() - tl[0]))
        expected = torch.cat([y[1:].sum().reshape(1), -y[1:]])
        torch.testing.assert_close(t.grad, expected, atol=1e-10, rtol=0)


def test_time_gradients_against_finite_differences():
    """A non-autonomous nonlinear field, a moving start included: central differences in float64."""
    f, y0 = Field(), _y0()
    w = torch.randn(3, 3, 2, generator=torch.Generator().manual_seed(2), dtype=F64)
    t = torch.tensor([0.2, 0.9, 1.7], dtype=F64, requires_grad=True)
    kw = dict(rtol=1e-12, atol=1e-14)
    (odeint_adjoint(f, y0, t, **kw) * w).sum().backward()
    h, fd = 1e-6, []
    for i in range(3):
        e = torch.zeros(3, dtype=F64)
        e[i] = h
        with torch.no_grad():
            hi = (odeint(f, y0, t.detach() + e, **kw) * w).sum()
            lo = (odeint(f, y0, t.detach() - e, **kw) * w).sum()
        fd.append(float(hi - lo) / (2 * h))
    torch.testing.assert_close(t.grad, torch.tensor(fd, dtype=F64), atol=1e-7, rtol=1e-7)


def test_tuple_states_and_any_shape():
    """A ``(z, logp)``-like tuple state equals the parts solved alone; a 0-d state works; one time is ``y0``."""
    f = Field()
    z0, c0 = _y0(), torch.tensor(1.5, dtype=F64)
    t = TIMES["decreasing"]
    z, c = odeint(lambda t, s: (f(t, s[0]), -s[1]), (z0, c0), t)
    torch.testing.assert_close(z, odeint(f, z0, t), atol=1e-7, rtol=1e-7)
    torch.testing.assert_close(c, 1.5 * torch.exp(t[0] - t), atol=1e-7, rtol=1e-7)
    assert z.shape == (3, 3, 2) and c.shape == (3,)
    one = odeint(f, z0, t[:1])
    assert one.shape == (1, 3, 2) and torch.equal(one[0], z0)


def test_callbacks_are_called_as_torchdiffeq_calls_them():
    """Forward and adjoint step callbacks: the same counts as torchdiffeq's (the engine takes its steps)."""

    def counted(module):
        counts = {}
        for name in ("callback_step", "callback_accept_step", "callback_reject_step"):
            for suffix in ("", "_adjoint"):
                key = name + suffix
                counts[key] = 0
                setattr(module, key, lambda t0, y0, dt, key=key: counts.__setitem__(key, counts[key] + 1))
        return counts

    f, y0, t = Field(), _y0(), TIMES["increasing"]
    ours, theirs = counted(f), None
    odeint(f, y0, t).sum().backward()
    mine = dict(ours)
    g = Field()
    theirs = counted(g)
    torchdiffeq.odeint(g, y0, t).sum().backward()
    assert mine == theirs and mine["callback_step"] > 0
    assert mine["callback_step"] == mine["callback_accept_step"] + mine["callback_reject_step"]

    for k in ours:
        ours[k] = 0
    odeint_adjoint(f, y0, t).sum().backward()
    assert ours["callback_step_adjoint"] > 0
    assert ours["callback_step_adjoint"] == ours["callback_accept_step_adjoint"] + ours["callback_reject_step_adjoint"]


def test_fixed_step_options():
    """``step_size`` steps of torchdiffeq's grid; ``perturb`` moves evaluations off the grid points; a
    ``grid_constructor`` is called with the times as given (decreasing ones too)."""
    seen = []

    def f(t, y):
        seen.append(float(t))
        return y

    y0 = torch.tensor(1.0, dtype=F64)
    t = torch.tensor([0.0, 1.0], dtype=F64)
    y = odeint(f, y0, t, method="euler", options=dict(step_size=0.1))
    assert abs(float(y[-1]) - 1.1**10) < 1e-12 and 0.5 in [round(s, 12) for s in seen]
    seen.clear()
    odeint(f, y0, t, method="euler", options=dict(step_size=0.5, perturb=True))
    assert 0.0 not in seen and 0.5 not in seen
    got = []
    y = odeint(
        f,
        y0,
        t.flip(0),
        method="euler",
        options=dict(grid_constructor=lambda func, y0, tt: got.append(tt.tolist()) or torch.linspace(1, 0, 5)),
    )
    assert got == [[1.0, 0.0]] and abs(float(y[-1]) - 0.75**4) < 1e-12


def test_bad_input_raises_by_name():
    f, y0, t = Field(), _y0(), TIMES["increasing"]
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['step_sise'\]"):
        odeint(f, y0, t, method="rk4", options=dict(step_sise=0.1))
    with pytest.raises(ValueError, match="`method`='dopri4' is unknown"):
        odeint(f, y0, t, method="dopri4")
    with pytest.raises(ValueError, match="strictly increasing or strictly decreasing"):
        odeint(f, y0, torch.tensor([0.0, 1.0, 0.5], dtype=F64))
    with pytest.raises(ValueError, match="adjoint_params"):
        odeint_adjoint(lambda t, y: -y, y0, t)
    with pytest.raises(SolverError, match="max_num_steps=3"):
        odeint(f, y0, t, options=dict(max_num_steps=3))
    with pytest.raises(ValueError, match="`gradient` must be one of"):
        odeint(f, y0, t, gradient="adjiont")
    f.callback_accept_step = lambda t0, y0, dt: None
    with pytest.warns(UserWarning, match="never calls"):
        odeint(f, y0, t, method="euler")


def test_user_exception_propagates_unchanged():
    class Boom(Exception):
        pass

    def f(t, y):
        raise Boom("mine")

    with pytest.raises(Boom, match="mine"):
        odeint(f, torch.ones(2, dtype=F64), torch.tensor([0.0, 1.0], dtype=F64))


@pytest.mark.parametrize("interface", [odeint, odeint_adjoint])
def test_event_closed_form(interface):
    """A ball falling from height ``h`` at speed ``v``: it lands at ``t* = t0 + (v + √(v² + 2gh)) / g``;
    ``∂t*/∂t0 = 1``, ``∂t*/∂h = 1/√(v² + 2gh)``, ``∂t*/∂v = (1 + v/√(v² + 2gh)) / g``; the state there is
    ``(0, −√(v² + 2gh))``."""
    g = 9.81

    class Fall(nn.Module):
        def forward(self, t, y):
            return torch.stack([y[1], torch.full_like(y[1], -g)])

    h, v = 1.0, -0.5
    t0 = torch.tensor(0.3, dtype=F64, requires_grad=True)
    y0 = torch.tensor([h, v], dtype=F64, requires_grad=True)
    kw = dict(adjoint_params=()) if interface is odeint_adjoint else {}
    event_t, sol = odeint_event(
        Fall(), y0, t0, event_fn=lambda t, y: y[0], odeint_interface=interface, rtol=1e-10, atol=1e-12, **kw
    )
    root = math.sqrt(v * v + 2 * g * h)
    assert abs(float(event_t.detach()) - (0.3 + (v + root) / g)) < 1e-9
    torch.testing.assert_close(sol[-1].detach(), torch.tensor([0.0, -root], dtype=F64), atol=1e-8, rtol=0)
    gt0, gy0 = torch.autograd.grad(event_t, (t0, y0), retain_graph=True)
    assert abs(float(gt0) - 1.0) < 1e-9
    torch.testing.assert_close(gy0, torch.tensor([1 / root, (1 + v / root) / g], dtype=F64), atol=1e-7, rtol=0)
    # the landing speed -sqrt(v² + 2gh): d/dh = -g/root
    (gy,) = torch.autograd.grad(sol[-1][1], y0)
    assert abs(float(gy[0]) + g / root) < 1e-6


def test_custom_adjoint_norm_sees_the_users_parts():
    """A callable ``adjoint_options["norm"]`` gets ``(t, *y parts, *adjoint parts, *parameter gradients)``."""
    seen = []

    def norm(state):
        seen.append(tuple(s.shape for s in state))
        return max(s.abs().max() for s in state)

    params = (torch.rand(7, dtype=F64, requires_grad=True), torch.rand((), dtype=F64, requires_grad=True))
    x0 = (torch.tensor(1.0, dtype=F64), torch.full((2, 2), 0.5, dtype=F64))
    xs = odeint_adjoint(
        lambda t, x: x,
        x0,
        torch.tensor([0.0, 1.0], dtype=F64),
        adjoint_params=params,
        adjoint_options=dict(norm=norm),
    )
    xs[0].sum().backward()
    assert seen and set(seen) == {((), (), (2, 2), (), (2, 2), (7,), ())}


def test_shim_runs_a_suite_written_for_torchdiffeq(tmp_path):
    """``import torchdiffeq`` resolves to a module of the three functions alone; every case of the tiny suite
    (dopri5, rk4, tsit5, dopri8, gl4 and radauIIA5 on a closed form, and the
    module's contents) passes; a method cde_nets lacks is counted as not served."""
    from cde_nets.benchmarks.torchdiffeq_suite import run

    res = run(tiny=True, out_dir=tmp_path)
    assert res["counts"] == {"pass": 7, "fail": 0, "error": 0, "not_served": 1}
    assert [r["test"].split(".")[-1] for r in res["rows"]] == ["test_a_method_cde_nets_lacks"]
    import sys

    assert sys.modules["torchdiffeq"] is torchdiffeq  # restored afterwards
