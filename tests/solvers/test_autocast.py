"""Mixed precision (solvers.precision): the field under torch.autocast in bfloat16, the state, the error estimate and
the step control in float32, in both doors and beneath every gradient method.

bfloat16 keeps 8 significant bits: its unit roundoff is u = 2⁻⁸. The numbers below are fixed by it: a linear
field rounded to bfloat16 differs from the float32 one by at most u·(2‖A‖₂ + ‖A‖_F)·‖y‖ per evaluation (the state,
the weights and the product each rounded once), so on a norm-preserving flow the two solves differ by at most
T times that at ‖y0‖; a replay of the same steps is the same computation, so its gradient is backprop's up to the
order of float32 sums.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, odeint
from cde_nets.solvers.gradients import Adjoint, Backprop, Checkpoint, Interpolating, Symplectic
from cde_nets.solvers.options import SolverOptions
from cde_nets.solvers.precision import check_autocast_state, min_rtol

U = 2.0**-8  # bfloat16's unit roundoff
BF16 = torch.bfloat16


class Probe(nn.Module):
    """A 4-16-4 tanh MLP that records the dtype its hidden layer ran in."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.l1, self.l2 = nn.Linear(4, 16), nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.seen: set[torch.dtype] = set()

    def forward(self, t, y):
        h = torch.tanh(self.l1(y))
        self.seen.add(h.dtype)
        return self.l2(h)


def _y0() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


T01 = torch.tensor([0.0, 1.0])


def _grads(f: nn.Module, gradient, params=None, **kw) -> torch.Tensor:
    params = list(f.parameters()) if params is None else params
    ys = odeint(f, _y0(), T01, gradient=gradient, adjoint_params=params, **kw)
    g = torch.autograd.grad(ys[-1].square().sum(), params)
    return torch.cat([x.reshape(-1) for x in g])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_field_runs_in_bfloat16_and_the_solution_in_the_states_dtype_in_both_doors():
    f = Probe()
    ys = odeint(f, _y0(), T01, rtol=1e-2, atol=1e-4, options={"autocast": BF16})
    assert f.seen == {BF16} and ys.dtype == torch.float32
    f.seen.clear()
    block = ODEBlock(f, T=1.0, solver=SolverOptions(rtol=1e-2, atol=1e-4, autocast=BF16))
    y = block(_y0())
    assert f.seen == {BF16} and y.dtype == torch.float32
    # the same solve by the two doors: the same steps, the same bits
    assert torch.equal(y, ys[-1])
    f.seen.clear()
    assert odeint(f, _y0(), T01, rtol=1e-2, atol=1e-4)[-1].dtype == torch.float32 and f.seen == {torch.float32}
    # per-sample steps and the whole-state event search evaluate the same wrapped field
    f.seen.clear()
    per = ODEBlock(f, T=1.0, solver=SolverOptions(rtol=1e-2, atol=1e-4, autocast=BF16, controller="per_sample"))
    assert per(_y0()).dtype == torch.float32 and f.seen == {BF16}
    f.seen.clear()
    sol = block.solve(_y0(), event=lambda t, y: y[:, 0].sum() - 10.0, event_mode="first")
    assert sol.y.dtype == torch.float32 and f.seen == {BF16}
    # an implicit method's Newton iteration evaluates the field (and its Jacobian) under the same autocast
    f.seen.clear()
    implicit = ODEBlock(f, T=1.0, solver=SolverOptions("gl4", step_size=0.25, autocast=BF16), gradient="checkpoint")
    assert implicit(_y0()).dtype == torch.float32 and f.seen == {BF16}


def test_a_bfloat16_linear_field_stays_within_its_rounding_bound_of_float32():
    """y' = A y, A skew (a norm-preserving flow), rk4 on one grid: ‖y_bf16(T) − y_f32(T)‖ ≤ u (2‖A‖₂ + ‖A‖_F) T
    ‖y0‖ per sample; and the difference is bfloat16's, far above float32's rounding (so the field really ran in
    bfloat16)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 8, generator=g)
    lin = nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_((a - a.T) / 4)
    A, y0, T = lin.weight.detach(), torch.randn(16, 8, generator=g), 2.0

    def f(t, y):
        return lin(y)

    kw = dict(method="rk4", adjoint_params=())
    with torch.no_grad():
        y32 = odeint(f, y0, torch.tensor([0.0, T]), options={"step_size": 0.05}, **kw)[-1]
        y16 = odeint(f, y0, torch.tensor([0.0, T]), options={"step_size": 0.05, "autocast": BF16}, **kw)[-1]
    bound = U * (2 * torch.linalg.matrix_norm(A, 2) + torch.linalg.matrix_norm(A)) * T * y0.norm(dim=1)
    diff = (y16 - y32).norm(dim=1)
    assert bool((diff <= bound).all())
    assert float(diff.max()) > 100 * torch.finfo(torch.float32).eps * float(y0.norm(dim=1).max())


def test_replays_are_backprop_of_the_same_autocast_solve():
    """Checkpoint and Symplectic replay the recorded steps: on a fixed grid, and with the step sizes held fixed on
    an adaptive one, they evaluate the field at the forward solve's inputs bit for bit (the test above), bfloat16
    evaluations included. Checkpoint then differs from backprop's gradient only by the order in which float32
    parameter gradients add over the steps: to 1e-6 relative (measured: 0 here, 2.2e-8 on an 8-32-8 MLP; 9e-8 in
    float32). Symplectic sums each stage's cotangent by its own recursion, a float32 ulp from backprop's, and the
    field's bfloat16 vector-Jacobian product may round it the other way: to 1e-5 (measured 2.9e-6 on the 8-32-8
    MLP). With the step sizes differentiated, the derivative of the error estimate (a cancellation of bfloat16
    stages) enters each bfloat16 vector-Jacobian product rounded in another order: the two then agree to within
    u."""
    f, opts = Probe(), {"autocast": BF16}
    rk4 = dict(method="rk4", options={**opts, "step_size": 0.1})
    ref = _grads(f, "backprop", **rk4)
    for g, tol in (("checkpoint", 1e-6), ("symplectic", 1e-5)):
        assert _rel(_grads(f, g, **rk4), ref) <= tol
    dopri = dict(rtol=1e-2, atol=1e-4, options=opts)
    ref = _grads(f, Backprop(steps="fixed"), **dopri)
    for cls, tol in ((Checkpoint, 1e-6), (Symplectic, 1e-5)):
        assert _rel(_grads(f, cls(steps="fixed"), **dopri), ref) <= tol
    ref = _grads(f, Backprop(), **dopri)
    assert 1e-5 < _rel(_grads(f, Checkpoint(), **dopri), ref) <= U


def test_the_checkpoint_replay_evaluates_the_field_where_the_forward_solve_did():
    """A replay recomputes each step from its recorded start: its stage inputs ``y_n + Σ_j k_j (h a_ij)`` and times
    must be the forward solve's bit for bit, and its graph must add the cotangents as the solve's does. One float32
    ulp apart, a value lands on the other side of a bfloat16 rounding boundary with probability about 2⁻¹⁶ per
    element, and then moves by u = 2⁻⁸: on a batch of 256 states (an 8-32-8 field, dopri5, ~20 evaluations) that
    happens a few times. The replay that summed the stages in its own order left backprop's gradient by 3.8e-4;
    with the solve's sums but the end state a node apart from the last stage's input (the step holding the output
    adds their cotangents separately), one cotangent still rounded the other way: 9.9e-5. With the same inputs,
    the same bfloat16 evaluations and the same cotangents, only the order in which the float32 parameter gradients
    add over the steps remains: within 1e-6 (measured 1.2e-8)."""
    g = torch.Generator().manual_seed(9)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    seen: list[tuple[float, torch.Tensor]] = []

    def f(t, y):
        seen.append((float(t.detach()), y.detach().clone()))
        return net(y)

    y0, params = torch.randn(256, 8, generator=torch.Generator().manual_seed(10)), list(net.parameters())
    kw = dict(rtol=2.0**-6, atol=1e-5, options={"autocast": BF16}, adjoint_params=params)
    grads, inputs = {}, {}
    for name, gradient in (("backprop", Backprop(steps="fixed")), ("checkpoint", Checkpoint(steps="fixed"))):
        seen.clear()
        ys = odeint(f, y0, T01, gradient=gradient, **kw)
        n_forward = len(seen)
        grads[name] = torch.cat([x.reshape(-1) for x in torch.autograd.grad(ys[-1].square().sum(), params)])
        inputs[name] = (seen[:n_forward], seen[n_forward:])
    forward, _ = inputs["backprop"]
    _, replayed = inputs["checkpoint"]
    assert len(replayed) > 10
    for t, y in replayed:
        assert any(t == tf and torch.equal(y, yf) for tf, yf in forward)
    assert _rel(grads["checkpoint"], grads["backprop"]) <= 1e-6


def test_a_callers_autocast_region_leaves_the_gradients_as_they_are():
    """Inside an autocast region of the caller's, autocast caches the low-precision copy of each weight for the
    whole region: had the evaluations used that cache, all of them would share one bfloat16 copy, and backprop
    would sum each weight's gradient over every evaluation in bfloat16 (1.1e-2 from the float32 sum of an 8-32-8
    field over 20 evaluations), while a replay, which runs after the region, sums in float32. Each evaluation
    casts its own copy, so the region changes no bit of backprop's gradient or of the checkpoint's."""
    f = Probe()
    kw = dict(rtol=1e-2, atol=1e-4, options={"autocast": BF16})
    for gradient in (Backprop(steps="fixed"), Checkpoint(steps="fixed")):
        plain = _grads(f, gradient, **kw)
        with torch.autocast("cpu", dtype=BF16):
            params = list(f.parameters())
            ys = odeint(f, _y0(), T01, gradient=gradient, adjoint_params=params, **kw)
            loss = ys[-1].square().sum()
        inside = torch.cat([x.reshape(-1) for x in torch.autograd.grad(loss, params)])
        assert torch.equal(inside, plain)


@pytest.mark.parametrize("gradient", ["adjoint", "interpolating", "gauss", "forward"])
def test_the_other_gradient_methods_match_backprop_of_the_autocast_solve_to_the_tolerance(gradient):
    """The continuous adjoints integrate the adjoint equation by their own steps, forward mode carries tangents
    through the steps: each differs from backprop by its own error at the tolerance (measured in float32, at
    rtol = u) plus at most 2u from its bfloat16 evaluations and vector-Jacobian products under the same autocast
    (measured 0.0023-0.0046 against float32's 0.000003-0.0044). Forward mode, whose cost grows with the
    parameters, differentiates the output layer's."""
    f = Probe()
    kw = dict(rtol=U, atol=1e-4, params=[f.l2.weight, f.l2.bias] if gradient == "forward" else None)
    own = _rel(_grads(f, gradient, **kw), _grads(f, "backprop", **kw))
    ref = _grads(f, "backprop", options={"autocast": BF16}, **kw)
    f.seen.clear()
    assert _rel(_grads(f, gradient, options={"autocast": BF16}, **kw), ref) <= own + 2 * U
    assert f.seen == {BF16}


class Timed(nn.Module):
    """An 8-32-8 tanh MLP (torch's default initialisation from seed 0) that records every time it is read at."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        self.times: list[float] = []

    def forward(self, t, y):
        self.times.append(float(t.detach()))
        return self.net(y)


@pytest.mark.parametrize("checkpoints", [False, True])
def test_interpolating_reads_no_dense_output_before_the_start_and_meets_the_float16_bound(checkpoints):
    """The interpolating adjoint reads y(t) off the forward solve's dense output, which covers [t_0, t_N] only: its
    backward solve lands on t_0 rather than stepping past it and interpolating back. Past t_0 it would read the
    first step's quartic extrapolated, whose error is its top coefficients' (float16 rounding of the stages here)
    times x⁴, x = (t − t_0)/h_0: here its last step ran to t = −2.1, and the gradient was 3.4e-2 from backprop's
    (on 16 other states, at x = −12 the state read was 10 from the solution for |y| ≈ 3). Within [t_0, t_N] it
    meets the bound of the other continuous adjoints, its own error in float32 plus 2u, u = 2⁻¹¹ (measured 3.5e-4,
    float32's own 5.1e-5)."""
    f = Timed()
    y0 = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    params, gradient = list(f.parameters()), Interpolating(checkpoints=checkpoints)

    def grads(method, autocast=None):
        ys = odeint(
            f,
            y0,
            T01,
            rtol=2.0**-6,
            atol=1e-5,
            gradient=method,
            adjoint_params=params,
            options={} if autocast is None else {"autocast": autocast},
        )
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(ys[-1].square().sum(), params)])

    own = _rel(grads(gradient), grads("backprop"))
    ref = grads("backprop", torch.float16)
    f.times.clear()
    got = grads(gradient, torch.float16)
    assert min(f.times) >= 0.0
    assert _rel(got, ref) <= own + 2 * 2.0**-11


def test_a_block_with_autocast_deep_copies_and_round_trips_its_state_dict():
    block = ODEBlock(Probe(), T=1.0, solver=SolverOptions(rtol=1e-2, atol=1e-4, autocast=BF16), gradient="adjoint")
    twin = copy.deepcopy(block)
    assert twin.solver.autocast is BF16 and torch.equal(twin(_y0()), block(_y0()))
    buffer = io.BytesIO()
    torch.save(block.state_dict(), buffer)
    fresh = ODEBlock(Probe(), T=1.0, options={"autocast": BF16}, rtol=1e-2, atol=1e-4, gradient="adjoint")
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert fresh.solver == block.solver and torch.equal(fresh(_y0()), block(_y0()))
    assert block.solver.replace(rtol=0.1).autocast is BF16


def test_what_autocast_cannot_serve_is_refused_by_name():
    f, y0 = Probe(), _y0()
    floor = min_rtol(BF16)
    assert floor == U
    with pytest.raises(ValueError, match=r"`rtol`=1e-06 is below .* Use rtol >= 0.0039"):
        SolverOptions(rtol=1e-6, autocast=BF16)
    with pytest.raises(ValueError, match=r"`rtol`=1e-07 is below .*options\['autocast'\]"):
        odeint(f, y0, T01, options={"autocast": BF16})  # torchdiffeq's default rtol
    with pytest.raises(ValueError, match=r"`adjoint_rtol`=0.0001 is below"):
        odeint(f, y0, T01, rtol=1e-2, options={"autocast": BF16}, gradient=Adjoint(rtol=1e-4))
    block = ODEBlock(f, T=1.0, solver=SolverOptions(rtol=1e-2, autocast=BF16), gradient=Adjoint(rtol=1e-4))
    with pytest.raises(ValueError, match=r"`Adjoint\(rtol=\)`=0.0001 is below"):
        block(y0)
    with pytest.raises(ValueError, match=r"`autocast`=torch.float32 is not a low-precision dtype"):
        SolverOptions(rtol=1e-2, autocast=torch.float32)
    with pytest.raises(ValueError, match=r"float64 state: torch.autocast casts only float32"):
        odeint(f.double(), y0.double(), T01, rtol=1e-2, options={"autocast": BF16})
    with pytest.raises(ValueError, match=r"SolverOptions\(autocast=\)`=torch.bfloat16 with a float64 state"):
        ODEBlock(Probe().double(), T=1.0, rtol=1e-2, options={"autocast": BF16})(y0.double())
    with pytest.raises(ValueError, match=r"method='yoshida4' is a composition"):
        odeint(f, y0, T01, method="yoshida4", options={"autocast": BF16, "step_size": 0.1})
    with pytest.raises(ValueError, match=r"`autocast`=torch.float16 and options\['autocast'\]=torch.bfloat16 disagree"):
        SolverOptions(rtol=1e-2, autocast=torch.float16, options={"autocast": BF16})
    with pytest.raises(ValueError, match=r"cannot run on the state's device 'meta'"):
        check_autocast_state(BF16, torch.empty(2, device="meta"))
    # fixed-step methods have no tolerance to refuse
    assert SolverOptions("rk4", step_size=0.1, autocast=BF16).autocast is BF16


def test_autocast_under_vmap_is_refused_in_both_doors():
    """torch does not autocast a vmapped ``nn.Linear`` (its batching rule runs below autocast: the field would run
    in float32 while the caller asked for bfloat16), so ``autocast`` under ``torch.vmap`` is refused by name."""
    f = Probe()
    Y = torch.stack([_y0(), -_y0()])
    with pytest.raises(ValueError, match=r"options\['autocast'\].*torch.vmap"):
        torch.func.vmap(lambda y: odeint(f, y, T01, rtol=U, atol=1e-4, options={"autocast": BF16}))(Y)
    block = ODEBlock(Probe(), T=1.0, solver=SolverOptions(rtol=U, atol=1e-4, autocast=BF16))
    with pytest.raises(ValueError, match=r"autocast=\).*torch.vmap"):
        torch.func.vmap(block)(Y)
    assert f.seen == set()  # refused before the field ran
