"""The fast forward path (:mod:`cde_nets.solvers.steppers.fast_rk`) is torchdiffeq step for step: the same accepted and
rejected steps and field evaluations, results (and backprop gradients) equal to 1e-12 in float64, for every method
it covers, on every field, with jumps and several output times; where it does not apply, torchdiffeq runs."""

from __future__ import annotations

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.fields import MS1, MS2, MS3, NAIS, CubicFriction, CubicFrictionConv, Hamiltonian, NAISConv, SecondOrder
from cde_nets.fields.bound import BoundField
from cde_nets.solvers import ADAPTIVE_METHODS, Adjoint, SolverOptions, adapter, engine
from cde_nets.solvers.counting import SolverStats, counted
from cde_nets.solvers.errors import SolverError
from cde_nets.solvers.gradients import Backprop
from cde_nets.solvers.gradients.replay import record_steps
from cde_nets.solvers.grids import jump_options
from cde_nets.solvers.steppers import fast_rk
from cde_nets.solvers.steppers.fast_rk import FAST_METHODS, fast_applies, odeint_fast

T = 2.0
FIELDS = {
    "hamiltonian": (lambda: Hamiltonian(4, layers=3, T=T), (4,), None),
    "cubic_friction": (lambda: CubicFriction(4, layers=2, T=T, zero_init=False), (4,), None),
    "cubic_friction_conv": (lambda: CubicFrictionConv(2, layers=2, T=T), (2, 3, 3), None),
    "second_order": (lambda: SecondOrder(2, layers=2, T=T), (4,), None),
    "nais": (lambda: NAIS(3, 2, layers=2, T=T), (3,), (2,)),
    "nais_conv": (lambda: NAISConv(2, layers=2, T=T), (2, 3, 3), (2, 3, 3)),
    "ms1": (lambda: MS1(4, layers=2, T=T), (4,), None),
    "ms2": (lambda: MS2(4, layers=2, T=T), (4,), None),
    "ms3": (lambda: MS3(4, layers=2, T=T), (4,), None),
}
STATS = ("nfe_forward", "steps_forward", "rejected_forward", "nfe_backward")
TIMES = [0.0, 0.35, 1.0, 1.2, T]  # 1.0 lies on a piece boundary


def _block(name: str, method: str, gradient) -> tuple[ODEBlock, torch.Tensor, torch.Tensor | None]:
    make, shape, ushape = FIELDS[name]
    torch.manual_seed(0)
    field = make().double()
    kw = dict(rtol=1e-6, atol=1e-8) if method in ADAPTIVE_METHODS else dict(step_size=0.05)
    if method in ("fehlberg2", "adaptive_heun"):  # second order: a few dozen steps at these tolerances
        kw = dict(rtol=1e-3, atol=1e-5)
    block = ODEBlock(field, method=method, gradient=gradient, **kw)
    y0 = torch.randn(5, *shape, dtype=torch.float64)
    u = None if ushape is None else torch.randn(5, *ushape, dtype=torch.float64)
    return block, y0, u


def _solve(block: ODEBlock, y0, u, fast: bool, monkeypatch, grad: bool):
    monkeypatch.setattr(fast_rk, "ENABLED", fast)
    y0 = y0.clone().requires_grad_(grad)
    if grad:
        sol = block.solve(y0, u, t=TIMES)
        (sol.ys.square().sum() + sol.ys[1].sum()).backward()
        grads = [y0.grad] + [p.grad.clone() for p in block.parameters()]
        block.zero_grad()
    else:
        with torch.no_grad():
            sol = block.solve(y0, u, t=TIMES)
        grads = []
    return sol.ys.detach(), {k: sol.stats[k] for k in STATS}, grads


@pytest.mark.parametrize("method", [m for m in FAST_METHODS if m != "dopri8"])  # dopri8: its own test, below
@pytest.mark.parametrize("name", list(FIELDS))
def test_fast_path_is_torchdiffeq_step_for_step(name, method, monkeypatch):
    # backprop as torchdiffeq's: the first step size differentiated, every later one a constant
    for gradient, grad in (("adjoint", False), (Backprop(steps="torchdiffeq"), True)):
        block, y0, u = _block(name, method, gradient)
        ys_ref, stats_ref, g_ref = _solve(block, y0, u, False, monkeypatch, grad)
        ys, stats, g = _solve(block, y0, u, True, monkeypatch, grad)
        assert stats == stats_ref, (gradient, stats, stats_ref)
        assert stats["rejected_forward"] > 0 or method not in ("dopri5", "bosh3") or name != "hamiltonian"
        # tsit5's interpolant weights reach 88 (Tsitouras' b_i(θ) in monomials; dopri5's: 10), summed in another
        # order by the two paths: measured 3e-12 of the largest gradient on the Hamiltonian field
        tol = 1e-11 if method == "tsit5" else 1e-12
        assert (ys - ys_ref).abs().max() <= tol * max(1.0, float(ys_ref.abs().max()))
        for a, b in zip(g, g_ref):
            assert (a - b).abs().max() <= tol * max(1.0, float(b.abs().max())), gradient


def _step_ends(block: ODEBlock, y0, u) -> list[float]:
    """The ends of the accepted steps of ``block``'s solve over ``TIMES`` (recorded from its callbacks)."""
    bound = BoundField(block.field, u)
    func = counted(bound, SolverStats(), 10_000, adaptive=True, count_vjp=False)
    opts = jump_options(block.method, block.field.grid.jumps, None)
    _, steps = record_steps(
        func,
        y0,
        torch.tensor(TIMES, dtype=torch.float64),
        method=block.method,
        rtol=block.rtol,
        atol=block.atol,
        options=opts,
        adaptive=True,
    )
    return steps.t1


@pytest.mark.parametrize("name", ["hamiltonian", "nais", "cubic_friction_conv"])
def test_dopri8_is_torchdiffeq_step_for_step(name, monkeypatch):
    """dopri8 takes torchdiffeq's accepted and rejected steps and evaluations, and reads its outputs off its own
    seventh-order extension, whose five stages cost five evaluations for each step that holds an output. At the
    step ends, where both dense outputs are the step itself, values and gradients (torchdiffeq's backprop) are
    torchdiffeq's to 1e-12."""
    block, y0, u = _block(name, "dopri8", Backprop(steps="torchdiffeq"))
    ends = _step_ends(block, y0, u)
    holding = len({min(i for i, e in enumerate(ends) if e >= tj) for tj in TIMES[1:]})
    inner = [e for e in ends if e < T]  # the last step overshoots T
    for times, extra in ((TIMES, 5 * holding), ([0.0, *inner], 5 * len(inner))):
        out = {}
        for fast in (False, True):
            monkeypatch.setattr(fast_rk, "ENABLED", fast)
            y = y0.clone().requires_grad_()
            sol = block.solve(y, u, t=times)
            grads = torch.autograd.grad(sol.ys.square().sum(), [y, *block.parameters()])
            out[fast] = (sol.ys.detach(), {k: sol.stats[k] for k in STATS[:3]}, grads)
        (ys_td, st_td, g_td), (ys, st, g) = out[False], out[True]
        assert st == {**st_td, "nfe_forward": st_td["nfe_forward"] + extra}, (st, st_td)
        if times is not TIMES:
            assert (ys - ys_td).abs().max() <= 1e-12 * float(ys_td.abs().max())
            for a, b in zip(g, g_td):
                assert (a - b).abs().max() <= 1e-12 * max(1.0, float(b.abs().max()))


def test_fast_path_is_taken_and_falls_back(monkeypatch):
    """The dispatch: forward-only calls and backprop take the fast path (with step_t too); adjoint gradients,
    decreasing times and methods it does not implement go to torchdiffeq."""
    y0 = torch.randn(3, 4, dtype=torch.float64)
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    p = torch.zeros(2, requires_grad=True)
    assert fast_applies("dopri5", False, y0, t, [p], {}) is False  # a graph to build: the adjoint's
    with torch.no_grad():
        assert fast_applies("dopri5", False, y0, t, [p], {})
    assert fast_applies("rk4", True, y0, t, [p], {"perturb": True})
    assert not fast_applies("explicit_adams", True, y0, t, [p], {})
    assert not fast_applies("dopri5", True, y0, t.flip(0), [p], {})
    assert fast_applies("dopri5", True, y0, t, [p], {"step_t": t, "norm": lambda x: x.abs().max()})
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["method"])
        return odeint_fast(*args, **kwargs)

    monkeypatch.setattr(engine, "odeint_fast", spy)
    field = Hamiltonian(4, layers=2).double()
    block = ODEBlock(field, rtol=1e-6, atol=1e-8, gradient="checkpoint")
    block(y0.requires_grad_()).sum().backward()  # the replay records its steps itself
    with torch.no_grad():
        block(y0)
    assert calls == ["dopri5"]
    ODEBlock(field, rtol=1e-6, atol=1e-8)(y0).sum().backward()  # the default at this size, backprop: with its graph
    assert calls == ["dopri5", "dopri5"]


@pytest.mark.parametrize("method", ["dopri5", "rk4"])
def test_float32_takes_the_same_steps(method, monkeypatch):
    torch.manual_seed(1)
    field = Hamiltonian(8, layers=4, T=T)
    kw = dict(rtol=1e-5, atol=1e-6) if method == "dopri5" else dict(step_size=0.1)
    block = ODEBlock(field, method=method, gradient="backprop", **kw)
    y0 = torch.randn(16, 8)
    out = {}
    for fast in (False, True):
        monkeypatch.setattr(fast_rk, "ENABLED", fast)
        with torch.no_grad():
            sol = block.solve(y0, t=TIMES)
            out[fast] = (sol.ys, sol.stats.as_dict())
    assert out[True][1] == out[False][1]
    assert (out[True][0] - out[False][0]).abs().max() <= 1e-5


def test_options_and_errors_as_torchdiffeq(monkeypatch):
    """first_step/max_step/safety options give the same steps; max_steps and a non-finite state raise the same
    named errors."""
    y0 = torch.randn(4, 4, dtype=torch.float64)
    field = Hamiltonian(4, layers=2, T=T).double()
    opts = dict(first_step=0.05, max_step=0.3, safety=0.8, ifactor=5.0, dfactor=0.3)
    res = {}
    for fast in (False, True):
        monkeypatch.setattr(fast_rk, "ENABLED", fast)
        block = ODEBlock(field, rtol=1e-7, atol=1e-9, options=opts)
        with torch.no_grad():
            sol = block.solve(y0)
            res[fast] = (sol.y, sol.stats.as_dict())
        msgs = []
        t = torch.tensor([0.0, T], dtype=torch.float64)
        nan = y0.clone().index_fill_(0, torch.tensor([1]), float("nan"))
        for kw, x in ((dict(max_steps=5), y0), ({}, nan)):
            with pytest.raises(SolverError) as info, torch.no_grad():
                adapter.integrate(field, x, t, solver=SolverOptions("dopri5", 1e-7, 1e-9, **kw), gradient=Adjoint())
            msgs.append(str(info.value))
        res[fast] += (msgs,)
    assert res[True][1:] == res[False][1:]
    assert (res[True][0] - res[False][0]).abs().max() <= 1e-12


@pytest.mark.parametrize("method", ["dopri5", "rk4"])
def test_graph_and_no_graph_give_the_same_bits(method):
    """With and without a graph the fast path runs the same kernels on the same values: a forward-only call
    and a backprop call agree bit for bit (so "checkpoint"/"symplectic", which record without a graph, replay
    exactly the steps "backprop" takes)."""
    block, y0, u = _block("nais", method, "backprop")
    with torch.no_grad():
        a = block.solve(y0, u, t=TIMES).ys
    b = block.solve(y0.requires_grad_(), u, t=TIMES).ys
    assert torch.equal(a, b.detach())
