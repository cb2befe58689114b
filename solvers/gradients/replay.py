r"""Exact gradients of torchdiffeq's Runge-Kutta map from per-step checkpoints: ``"checkpoint"`` and ``"symplectic"``.

The forward pass is torchdiffeq's own solve, run without a graph; its step callbacks record every accepted
step ``[t_n, t_{n+1}]`` and its start state ``y_n`` (the checkpoints: ``O(N |y|)`` memory for ``N`` steps). The
backward pass walks the steps from the last to the first and carries the adjoint ``λ_{n+1} = ∂ℒ/∂y_{n+1}`` back
through one step at a time, recomputing the step with the method's own tableau (:mod:`solvers.steppers.tableaux`).
The gradient is that of the discrete map the solver applied (the same as backpropagating through its
operations), not of the ODE's flow: no backward solve, no integration error of its own. Written here with the
step sizes held fixed (``steps="fixed"``); with them differentiated (the default for adaptive methods) every
attempted step is replayed by :mod:`solvers.gradients.replay_controlled`.

``"checkpoint"`` (Zhuang et al. 2020, "Adaptive checkpoint adjoint method for gradient estimation in neural ODE",
ICML; diffrax's ``RecursiveCheckpointAdjoint`` with one checkpoint per step) rebuilds step ``n``'s graph from
``y_n`` and backpropagates through it: memory ``O(N |y| + s G)`` for ``s`` stages whose graphs take ``G`` each.

``"symplectic"`` (Matsubara, Miyatake & Yaguchi 2021, "Symplectic adjoint method for exact gradient of neural
ODE with minimal memory", NeurIPS) recomputes the stage values ``Y_i`` without a graph and integrates the
adjoint system ``λ' = −(∂F/∂y)ᵀ λ`` backwards with the symplectic partner of the forward scheme,

    ``λ_{n+1} = λ_n + h Σ_i b_i l_i``,   ``l_i = −(∂F/∂y(t_n + c_i h, Y_i))ᵀ Λ_i``,
    ``Λ_i = λ_n + h Σ_j (b_j − b_j a_ji / b_i) l_j``,

whose pairing with the forward scheme conserves ``λᵀ δy`` exactly, so the gradient is exact for the discrete
map. Written in stage form, which also covers ``b_i = 0`` (FSAL tableaux such as dopri5): with
``κ_i = ∂ℒ/∂k_i`` and ``μ_i = (∂F/∂y(t_n + c_i h, Y_i))ᵀ κ_i`` (``κ_i = h b_i Λ_i`` when ``b_i ≠ 0``),

    ``κ_i = h b_i λ_{n+1} + h Σ_{j>i} a_ji μ_j``  (``i = s, …, 1``),   ``λ_n = λ_{n+1} + Σ_i μ_i``,
    ``∂ℒ/∂θ += Σ_i (∂F/∂θ(t_n + c_i h, Y_i))ᵀ κ_i``,

one vector-Jacobian product per stage, each with the graph of a single evaluation: memory
``O(N |y| + s |y| + G)``. Each stage is evaluated twice in the backward pass (once to recover ``Y_i``, once for
its product), against once for ``"checkpoint"``.

Dense output. torchdiffeq's adaptive methods step past an output time and interpolate there with a quartic
through ``y_n, y_{n+1/2}, y_{n+1}`` and the slopes ``k_1, k_s`` of the step (``y_{n+1/2}`` from the method's
midpoint weights), or with the method's own continuous extension (tsit5; dopri8, whose extension has stages of
its own, evaluated here only for a step that holds an output); the interpolant is a linear function of ``y_n``
and the stages, differentiated here as part of its step. Fixed-step methods step onto every output time (the
adapter adds them to the grid).

Carried slopes. ``fehlberg2`` and ``adaptive_heun`` are not FSAL: their last stage ``k_s`` is the field at a state
other than ``y_{n+1}``, and the next step takes it as its first stage all the same. A step is then a map of
``(y_n, k_1)``: the recorder keeps the carried ``k_1`` of every step (one more state per step), the replay takes
it as given, and the backward pass returns its cotangent to the step before, where it joins that step's
``∂ℒ/∂k_s`` (``κ_s`` in the symplectic form).

Parameters constant on pieces of time (:class:`~solvers.gradients.piecewise_adjoint.PiecewiseParam`) are read through
fresh leaves of the pieces a step actually uses, so each step's product costs the pieces in force, not all
``L``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..controllers import Integral
from ..steppers.fast_rk import fast_applies, odeint_fast, stage_times
from ..steppers.rk_odeint import odeint_rk
from ..steppers.rk_stages import Graph
from ..steppers.tableaux import TABLEAUX, MethodTableau, dense_at
from .binomial import OnlineSchedule, walk_back
from .piece_grads import Grads, LazyPieces, PiecewiseParam, piece_slots
from .replay_controlled import attempts, checkpoint_attempt, controlled_replay, symplectic_attempt, taken
from .second_order import first_order, remember_inputs

__all__ = ["StepBack", "Steps", "checkpoint_step", "record_steps", "replay", "replay_gradient", "symplectic_step"]

_NONE, _NEXT, _PREV = 0, 1, -1

# (func, tableau, steps, n, cotangents of step n's end state and last slope, output indices inside step n, output
# cotangents, output times, gradient accumulator) -> the cotangents of its start state and carried slope
StepBack = Callable[..., tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass
class Steps:
    """The accepted steps of one solve: ``t0[n] → t1[n]`` from ``y0[n]``; the first stage of step ``n`` is
    evaluated at ``first[n] = (time, perturbation)`` (``±1``: just after/before the time), as the solver did, or
    is ``carried[n]``, the last stage of step ``n − 1``, where a method that is not FSAL reuses it."""

    t0: list[float]
    t1: list[float]
    dt: list[float]
    y0: list[torch.Tensor]
    first: list[tuple[float, int]]
    adaptive: bool
    carried: list[torch.Tensor | None] | None = None
    carries: list[bool] | None = None  # whether step n takes a carried slope (kept or not, with a budget)

    def carried_at(self, n: int) -> torch.Tensor | None:
        return None if self.carried is None else self.carried[n]

    def __len__(self) -> int:
        return len(self.t0)


class Recorder:
    """Collects accepted steps from the counting wrapper's callbacks (see ``counting.Counted``); with
    ``attempts``, every attempted step too, as :func:`solvers.gradients.replay_controlled.attempts` reads them:
    ``[t0, proposed size, size taken, accepted, y0, ended on a jump, carried slope, takes a carried slope]``. With
    ``carry`` (a method that is not FSAL), the slope each step's first stage reuses: the last evaluation of the
    accepted step before it (``None`` for the first step and after a jump, where the field is read afresh).
    With ``schedule`` (:class:`~solvers.gradients.binomial.OnlineSchedule`), only the step starts it keeps hold
    their state and carried slope (``None`` elsewhere); the most held at once goes to ``schedule.peak``."""

    def __init__(
        self,
        jumps: Sequence[float] = (),
        attempts: bool = False,
        carry: bool = False,
        schedule: OnlineSchedule | None = None,
    ) -> None:
        self.rows: list[list[Any]] = []  # [t0, dt, y0, ended on a jump, carried slope, takes a carried slope]
        self.after_accept = False
        self.jumps = list(jumps)
        self.tries: list[list[Any]] | None = [] if attempts else None
        self.proposed = math.nan  # the size the current attempt was proposed with (before a clip)
        self.reading = False  # set while a dense output evaluates stages of its own: those are no step's
        self.carry = carry
        self.last: torch.Tensor | None = None  # the latest evaluation (with ``carry``)
        self.carried: torch.Tensor | None = None  # the slope the next attempt's first stage takes
        self.start: torch.Tensor | None = None  # the one the current attempt took
        self.schedule = schedule
        self.admitted = 0  # the step starts the schedule has seen
        self.keeping = True  # whether the current step start is kept
        self.tries_of: list[list[int]] = []  # with a schedule: each step start's attempts (rows of ``tries``)
        self.held = 0  # the states kept now

    def _kept(self, y0: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The state and carried slope to record for the current step start (``None`` where not kept)."""
        if self.schedule is None:
            return y0, self.start
        i = len(self.rows)
        if i == self.admitted:  # the first attempt from this state
            self.admitted += 1
            self.tries_of.append([])
            self.keeping, drop = self.schedule.admit(i)
            if drop is not None:
                self._forget(drop)
            self.held += self.keeping
            self.schedule.peak = max(self.schedule.peak, self.held)
        if self.tries is not None:
            self.tries_of[i].append(len(self.tries))
        return (y0, self.start) if self.keeping else (None, None)

    def _forget(self, i: int) -> None:
        self.held -= 1
        if i < len(self.rows):
            self.rows[i][2] = self.rows[i][4] = None
        if self.tries is not None:
            for j in self.tries_of[i]:
                self.tries[j][4] = self.tries[j][6] = None

    def accept(self, t0, y0, dt) -> None:
        y, start = self._kept(y0)
        self.rows.append([float(t0), float(dt), y, False, start, self.start is not None])
        self.after_accept = True
        if self.tries is not None:
            self.tries.append([float(t0), self.proposed, float(dt), True, y, False, start, self.start is not None])
        if self.carry:
            self.carried = self.last

    def reject(self, t0, y0, dt) -> None:
        if self.tries is not None:
            y, start = self._kept(y0)
            self.tries.append([float(t0), self.proposed, float(dt), False, y, False, start, self.start is not None])

    def step(self, t0=None, y0=None, dt=None) -> None:
        self.after_accept = False
        self.start = self.carried
        if dt is not None:
            self.proposed = float(dt)

    def evaluated(self, out: torch.Tensor | None = None) -> None:
        if self.reading:
            return
        # torchdiffeq evaluates between an accepted step and the next step's start only to re-read the field on
        # the far side of a jump the step was clipped to
        if self.after_accept and self.rows:
            self.rows[-1][3] = True
            if self.tries:
                self.tries[-1][5] = True
            self.carried = None  # the next first stage is that re-read, at the step's end state
        elif self.carry:
            self.last = out

    def steps(self, t: torch.Tensor, adaptive: bool, perturb: bool = False) -> Steps:
        """The accepted steps; ``perturb``: a fixed-step solve's option (its first stages read just after
        ``t_0``)."""
        rows = self.rows
        t0 = [r[0] for r in rows]
        t1 = t0[1:]
        last = rows[-1]
        if adaptive:
            # the re-evaluation after a jump was at nextafter(jump, +inf); a step that was not clipped ends at
            # t0 + dt as the solver computed it
            t1.append(self._jump_end(last) if last[3] else last[0] + last[1])
            first = [(float(t[0]), _NONE)] + [(r0[0], _NEXT if prev[3] else _PREV) for prev, r0 in zip(rows, rows[1:])]
        else:
            t1.append(float(t[-1]))
            first = [(r[0], _NEXT if perturb else _NONE) for r in rows]
        carried = [r[4] for r in rows] if self.carry else None
        carries = [r[5] for r in rows] if self.carry else None
        return Steps(t0, t1, [r[1] for r in rows], [r[2] for r in rows], first, adaptive, carried, carries)

    def _jump_end(self, row) -> float:
        end = row[0] + row[1]  # the clipped dt is jump - t0, so t0 + dt lies within an ulp of the jump
        return min(self.jumps, key=lambda j: abs(j - end)) if self.jumps else end


def _time(t: float, perturb: int, dtype: torch.dtype, device) -> torch.Tensor:
    tt = torch.tensor(t, dtype=torch.float64).to(dtype)
    if perturb:
        tt = torch.nextafter(tt, tt.new_tensor(math.inf if perturb > 0 else -math.inf))
    return tt.to(device)


def _stage_time(tab: MethodTableau, steps: Steps, n: int, i: int) -> tuple[float, int]:
    if i == 0:
        return steps.first[n]
    c = tab.all_c[i]
    if c == 1.0:
        return steps.t1[n], _PREV
    return steps.t0[n] + c * _h(steps, n), _NONE


def _h(steps: Steps, n: int) -> float:
    # adaptive: the step size the solver recorded; fixed: the grid's t1 - t0 (the solver's own dt)
    return steps.dt[n] if steps.adaptive else steps.t1[n] - steps.t0[n]


def combine(y0: torch.Tensor, weights: Sequence[float], ks: Sequence[torch.Tensor], h: float) -> torch.Tensor:
    out = y0
    for w, k in zip(weights, ks):
        if w != 0.0:
            out = out + (w * h) * k
    return out


def _n_stages(tab: MethodTableau, dense: bool) -> int:
    """The stages a replayed step needs: an FSAL method's last stage only feeds the dense output, which may have
    stages of its own (dopri8's)."""
    if dense:
        return len(tab.all_c)
    return tab.stages - 1 if tab.fsal else tab.stages


def _engine(y0: torch.Tensor, tab: MethodTableau, adaptive: bool, h: float) -> Graph:
    """The forward solve's stage arithmetic for a step of size ``h`` (:class:`~solvers.steppers.rk_stages.Graph`,
    with the weight rows of :func:`~solvers.steppers.fast_rk.odeint_fast`)."""
    if adaptive:
        assert tab.error is not None
        last = (tab.error,) if tab.fsal else (tab.tableau.b, tab.error)
    else:
        last = (tab.tableau.b,)
    eng = Graph(y0, tab, last, 0.0, 0.0)
    eng.weights(h)
    return eng


def _stages(func, tab: MethodTableau, steps: Steps, n: int, y0: torch.Tensor, dense: bool, first=None):
    """Stage inputs ``Y_i``, slopes ``k_i`` and the end state ``y_1`` of step ``n`` (graph if grad is on); the
    first slope is ``first`` where given (a carried slope), else evaluated. The sums and the evaluation times are
    the forward solve's own (:class:`~solvers.steppers.rk_stages.Graph`,
    :func:`~solvers.steppers.fast_rk.stage_times`), so the field is evaluated where the solve evaluated it, bit
    for bit: under autocast an input one float32 ulp away may round to another low-precision value."""
    h, s = _h(steps, n), tab.stages
    eng = _engine(y0, tab, steps.adaptive, h)
    n_stages = _n_stages(tab, dense)
    times = _stage_times(tab, steps, n, y0, n_stages)
    Ys = [y0]
    ks = [first if first is not None else func(times[0], y0)]
    for i in range(1, min(n_stages, s)):
        Ys.append(eng.stage_sum(y0, ks, i - 1))
        ks.append(func(times[i], Ys[i]))
    if steps.adaptive and tab.fsal:
        # the last stage's input is the end state: one node, as in the solve, so that the cotangents of its two
        # uses (the last slope, the dense output) add before they reach the stages
        y1 = Ys[s - 1] if len(Ys) == s else eng.stage_sum(y0, ks, s - 2)
    else:
        y1 = eng.stage_sum(y0, ks, s - 1)
    all_a = tab.all_a
    for i in range(s, n_stages):  # a dense output's own stages (dopri8's), formed as the solve's dense output
        Ys.append(combine(y0, all_a[i], ks, h))
        ks.append(func(times[i], Ys[i]))
    return Ys, ks, y1


def _stage_times(tab: MethodTableau, steps: Steps, n: int, y: torch.Tensor, n_stages: int) -> list[torch.Tensor]:
    """The times at which step ``n`` evaluated its first ``n_stages`` stages in the forward solve: the first at
    ``steps.first[n]``, the step's own as :func:`~solvers.steppers.fast_rk.stage_times` makes them, a dense
    output's own stages (dopri8's) at ``t_n + c h`` rounded from float64."""
    t0, p0 = steps.first[n]
    own = stage_times(y, tab, steps.t0[n], steps.t1[n], _h(steps, n), steps.adaptive, p0 != _NONE)
    times = [_time(t0, p0, y.dtype, y.device), *own[: n_stages - 1]]
    for i in range(tab.stages, n_stages):
        ti, p = _stage_time(tab, steps, n, i)
        times.append(_time(ti, p, y.dtype, y.device))
    return times


def _dense(tab: MethodTableau, steps: Steps, n: int, y0, y1, ks, t: float) -> torch.Tensor:
    """At ``x = (t − t_n) / (t_{n+1} − t_n)``: the method's continuous extension where it has one, else the
    quartic ``p(x)`` with ``p(0) = y_0``, ``p'(0) = h k_1``, ``p(1/2) = y_{1/2}``, ``p(1) = y_1``,
    ``p'(1) = h k_s``, fitted and evaluated as the forward solve's (:class:`~solvers.steppers.rk_stages.Graph`)."""
    h = _h(steps, n)
    if tab.dense is not None:  # the method's own continuous extension (tsit5, dopri8)
        x = float((torch.tensor(t, dtype=torch.float64) - steps.t0[n]) / (steps.t1[n] - steps.t0[n]))
        return combine(y0, dense_at(tab, x), ks, h)
    eng = _engine(y0, tab, True, h)
    eng.ks[:] = ks[: tab.stages]
    x = (t - steps.t0[n]) / (steps.t1[n] - steps.t0[n])
    return eng.evaluate(eng.dense(y0, y1, h), eng.round(x))


def _outputs(steps: Steps, t: torch.Tensor) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Which step gives each output ``t[j]`` (``j ≥ 1``): interpolated inside it, or its end state."""
    inside: dict[int, list[int]] = {}
    at_end: dict[int, list[int]] = {}
    for j, tj in enumerate(t.tolist()[1:], start=1):
        n = min(bisect.bisect_left(steps.t1, tj), len(steps) - 1)
        if not steps.adaptive and steps.t1[n] == tj:
            at_end.setdefault(n, []).append(j)
        else:
            inside.setdefault(n, []).append(j)
    return inside, at_end


def _interpolate(tab: MethodTableau, steps: Steps, n: int, y0, y1, ks, t: float) -> torch.Tensor:
    if steps.adaptive:
        return _dense(tab, steps, n, y0, y1, ks, t)
    s = (t - steps.t0[n]) / (steps.t1[n] - steps.t0[n])  # torchdiffeq's linear interpolation off the grid
    return y0 + s * (y1 - y0)


def _times_of(options: dict, name: str) -> list[float]:
    v = options.get(name)
    return [] if v is None else [float(j) for j in torch.as_tensor(v).reshape(-1).tolist()]


def _solve_recorded(func, y0, t, rec: Recorder, method: str, rtol, atol, options: dict) -> torch.Tensor:
    """The solve without a graph, ``rec`` listening to its callbacks."""
    func.recorder = rec
    try:
        with torch.no_grad():
            if fast_applies(method, True, y0, t, (), options):  # the same steps, fewer operations
                return odeint_fast(func, y0, t, method=method, rtol=rtol, atol=atol, options=options)
            return odeint_rk(func, y0, t, rtol=rtol, atol=atol, method=method, options=options)
    finally:
        func.recorder = None


def _carries(method: str) -> bool:
    """Whether ``method`` reuses a last stage that is not ``F(t_1, y_1)`` as the next step's first."""
    tab = TABLEAUX.get(method)
    return tab is not None and tab.adaptive and not tab.fsal


def record_steps(
    func,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str,
    rtol: float,
    atol: float,
    options: dict,
    adaptive: bool,
    schedule: OnlineSchedule | None = None,
) -> tuple[torch.Tensor, Steps]:
    """torchdiffeq's ``odeint`` without a graph, and its accepted steps. ``func`` is the adapter's counting
    wrapper, whose ``recorder`` receives the callbacks. With ``schedule``, only the states it keeps are held."""
    rec = Recorder(_times_of(options, "jump_t"), carry=_carries(method), schedule=schedule)
    ys = _solve_recorded(func, y0, t, rec, method, rtol, atol, options)
    return ys, rec.steps(t, adaptive, bool(options.get("perturb", False)))


def record_attempts(func, y0: torch.Tensor, t: torch.Tensor, *, method: str, rtol, atol, options: dict, schedule=None):
    """As :func:`record_steps`, every attempted step of an adaptive solve
    (:class:`~solvers.gradients.replay_controlled.Attempt`)."""
    rec = Recorder(_times_of(options, "jump_t"), attempts=True, carry=_carries(method), schedule=schedule)
    ys = _solve_recorded(func, y0, t, rec, method, rtol, atol, options)
    assert rec.tries is not None
    clips = sorted({*_times_of(options, "jump_t"), *_times_of(options, "step_t")})
    return ys, attempts(rec.tries, float(t[0]), clips)


def replay(func, tab: MethodTableau, steps: Steps, y0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The solution at ``t`` recomputed from ``y0`` through the recorded steps, differentiably: backpropagating
    through it is "backprop through the same accepted steps"."""
    inside, at_end = _outputs(steps, t)
    out: list[torch.Tensor | None] = [None] * len(t)
    out[0] = y0
    y = y0
    last: torch.Tensor | None = None  # the step before's last slope, for a step that carries it
    for n in range(len(steps)):
        first = last if steps.carried_at(n) is not None else None
        _, ks, y1 = _stages(func, tab, steps, n, y, dense=n in inside, first=first)
        for j in inside.get(n, ()):
            out[j] = _interpolate(tab, steps, n, y, y1, ks, float(t[j]))
        for j in at_end.get(n, ()):
            out[j] = y1
        y, last = y1, ks[tab.stages - 1] if len(ks) >= tab.stages else None
    return torch.stack(out)  # type: ignore[arg-type]


def _vjp(outs, cots, leaves: Sequence[torch.Tensor], acc: Grads) -> list[torch.Tensor]:
    """``Σ cotᵀ ∂out/∂leaf`` for each leaf (zeros where none depends on it); the parameters' parts to ``acc``."""
    wrt, keys = acc.inputs()
    pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    if not pairs:
        return [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad([o for o, _ in pairs], [*leaves, *wrt], [c for _, c in pairs], allow_unused=True)
    acc.add(grads[len(leaves) :], keys)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


Cotangents = tuple[torch.Tensor | None, torch.Tensor | None]  # of a step's end state, and of its last slope


def checkpoint_step(func, tab, steps, n, lam: Cotangents, outs_in, grad_ys, t, acc: Grads) -> Cotangents:
    """The cotangents of step ``n``'s start (its state, and the slope it carried in, if any) from those of its
    end state and of its last slope (which the step after carried), its graph rebuilt from ``y_n``."""
    lam_y, lam_k = lam
    with torch.enable_grad():
        y = steps.y0[n].detach().requires_grad_()
        carried = steps.carried_at(n)
        first = None if carried is None else carried.detach().requires_grad_()
        acc.fresh()
        _, ks, y1 = _stages(func, tab, steps, n, y, dense=bool(outs_in), first=first)
        outs, cots = ([y1], [lam_y]) if lam_y is not None else ([], [])
        if lam_k is not None:
            outs.append(ks[tab.stages - 1])
            cots.append(lam_k)
        for j in outs_in:
            outs.append(_interpolate(tab, steps, n, y, y1, ks, float(t[j])))
            cots.append(grad_ys[j])
        got = _vjp(outs, cots, [y] if first is None else [y, first], acc)
    return got[0], (got[1] if first is not None else None)


def symplectic_step(func, tab, steps, n, lam: Cotangents, outs_in, grad_ys, t, acc: Grads) -> Cotangents:
    """As :func:`checkpoint_step`, one stage's field evaluation at a time (the symplectic adjoint: module)."""
    lam_y, lam_k = lam
    h = _h(steps, n)
    y0 = steps.y0[n]
    carried = steps.carried_at(n)
    with torch.no_grad():
        Ys, ks, y1 = _stages(func, tab, steps, n, y0, dense=bool(outs_in), first=carried)
    s = len(ks)
    kappa: list[torch.Tensor | None] = [None] * s
    lam0 = torch.zeros_like(y0) if lam_y is None else lam_y.clone()
    if lam_y is not None:
        for i in range(min(s, tab.stages)):
            if tab.tableau.b[i] != 0.0:
                kappa[i] = (tab.tableau.b[i] * h) * lam_y
    if lam_k is not None:  # the last slope, which the next step took as its first
        last = kappa[tab.stages - 1]
        kappa[tab.stages - 1] = lam_k if last is None else last + lam_k
    if outs_in:  # the interpolant is linear in (y_n, k_1..k_s): its cotangents come without the field
        with torch.enable_grad():
            yl = y0.detach().requires_grad_()
            kl = [k.detach().requires_grad_() for k in ks]
            y1l = combine(yl, tab.tableau.b, kl, h)
            ps = [_interpolate(tab, steps, n, yl, y1l, kl, float(t[j])) for j in outs_in]
            gs = torch.autograd.grad(ps, [yl, *kl], [grad_ys[j] for j in outs_in], allow_unused=True)
        if gs[0] is not None:
            lam0 = lam0 + gs[0]
        for i, g in enumerate(gs[1:]):
            if g is not None:
                prev = kappa[i]
                kappa[i] = g if prev is None else prev + g
    all_a = tab.all_a
    times = _stage_times(tab, steps, n, y0, s)
    for i in range(s - 1, 0 if carried is not None else -1, -1):
        kap = kappa[i]
        if kap is None:
            continue
        with torch.enable_grad():
            Y = Ys[i].detach().requires_grad_()
            acc.fresh()
            f = func(times[i], Y)
            (mu,) = _vjp([f], [kap], [Y], acc)
        lam0 = lam0 + mu
        for j, a in enumerate(all_a[i]):
            if a != 0.0:
                kappa[j] = (a * h) * mu if kappa[j] is None else kappa[j] + (a * h) * mu
    if carried is None:
        return lam0, None
    return lam0, torch.zeros_like(y0) if kappa[0] is None else kappa[0]


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: dict, y0: torch.Tensor, t: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        remember_inputs(ctx, y0, *params)
        budget = cfg["budget"]
        schedule = None if budget is None else OnlineSchedule(budget)
        ys, steps = record_steps(
            cfg["func"],
            y0,
            t,
            method=cfg["method"],
            rtol=cfg["rtol"],
            atol=cfg["atol"],
            options=cfg["options"],
            adaptive=cfg["tableau"].adaptive,
            schedule=schedule,
        )
        ctx.cfg = cfg
        ctx.steps_meta = (steps.t0, steps.t1, steps.dt, steps.first, steps.adaptive, steps.carries)
        carried = steps.carried or []
        ctx.carried_at = [i for i, k in enumerate(carried) if k is not None]
        ctx.carrying = steps.carried is not None
        ctx.n_steps = len(steps)
        if schedule is not None:
            # held on the context, not saved through autograd, so that the backward pass can free each one
            # when the schedule drops it (saved tensors live until the backward pass ends)
            ctx.kept = {i: (y, steps.carried_at(i)) for i, y in enumerate(steps.y0) if y is not None}
            ctx.held = schedule.peak
            ctx.save_for_backward(t, *params)
            return ys
        ctx.held = len(steps)
        # saved through autograd so that memory accounting (saved-tensor hooks) sees the checkpoints
        ctx.save_for_backward(t, *steps.y0, *(carried[i] for i in ctx.carried_at), *params)
        return ys

    @staticmethod
    @first_order(lambda ctx: ctx.cfg["gradient"])
    def backward(ctx, grad_ys: torch.Tensor):
        cfg = ctx.cfg
        # reported here: a call that never runs its backward pass keeps no state for it
        cfg["stats"].stored_states = max(cfg["stats"].stored_states, ctx.held)
        stats, func, tab = cfg["stats"], cfg["func"], cfg["tableau"]
        saved = ctx.saved_tensors
        n_steps, n_carried = ctx.n_steps, len(ctx.carried_at)
        budgeted = cfg["budget"] is not None
        if budgeted:
            n_steps = n_carried = 0  # the states are in ctx.kept
        t, ys0 = saved[0], list(saved[1 : 1 + n_steps])
        kept, params = saved[1 + n_steps : 1 + n_steps + n_carried], saved[1 + n_steps + n_carried :]
        carried: list[torch.Tensor | None] | None = None
        if ctx.carrying:
            carried = [None] * ctx.n_steps
            for i, k in zip(ctx.carried_at, kept):
                carried[i] = k
        t0, t1, dt, first, adaptive, carries = ctx.steps_meta
        if budgeted:
            ys0 = [None] * ctx.n_steps
        steps = Steps(t0, t1, dt, ys0, first, adaptive, carried, carries)
        pieces: list[PiecewiseParam] = cfg["pieces"]
        slot = cfg["slot"]
        others = [p for p, j in zip(params, slot) if j is None]
        lazies = [LazyPieces(p) for p in pieces]
        acc = Grads(others, lazies)
        inside, at_end = _outputs(steps, t)
        step_back = cfg["step_back"]
        lam: torch.Tensor | None = None
        owed: torch.Tensor | None = None  # the cotangent of the last slope of the step before, which step n took
        try:
            for p, v in zip(pieces, lazies):
                p.set_views(v)
            order: Iterator[int] = iter(range(len(steps) - 1, -1, -1))
            if budgeted:
                order = _recomputed(steps, func, tab, ctx, stats)
            for n in order:
                for j in at_end.get(n, ()):
                    lam = grad_ys[j] if lam is None else lam + grad_ys[j]
                lam, owed = step_back(func, tab, steps, n, (lam, owed), inside.get(n, []), grad_ys, t, acc)
                stats.steps_backward += 1
        finally:
            for p in pieces:
                p.set_views(None)
        assert lam is not None
        lam = lam + grad_ys[0]
        return acc.result(lam, slot, cfg["gradient"], stats.nfe_backward)


def _recomputed(steps: Steps, func, tab: MethodTableau, ctx, stats) -> Iterator[int]:
    """The steps ``n − 1, …, 0``, each yielded with its start state (and carried slope) in ``steps``, rebuilt from
    the kept states ``ctx.kept`` by the binomial schedule (:func:`~solvers.gradients.binomial.walk_back`)."""
    kept: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = taken(ctx)

    def carries(n: int) -> bool:
        return steps.carries is not None and steps.carries[n]

    def advance(n: int, state):
        y, k = state
        with torch.no_grad():
            _, ks, y1 = _stages(func, tab, steps, n, y, dense=False, first=k if carries(n) else None)
        return y1, (ks[tab.stages - 1] if carries(n + 1) else None)

    counts: dict[str, int] = {}
    try:
        for n, (y, k) in walk_back(kept, len(steps), ctx.cfg["budget"], advance, counts):
            steps.y0[n] = y
            if steps.carried is not None:
                steps.carried[n] = k
            yield n
            steps.y0[n] = None  # type: ignore[call-overload]  # freed: the schedule holds what it keeps
            if steps.carried is not None:
                steps.carried[n] = None
    finally:
        stats.recomputed_steps += counts.get("advances", 0)
        stats.stored_states = max(stats.stored_states, counts.get("peak", 0))


def replay_gradient(
    func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor,
    params: Sequence[torch.Tensor],
    pieces: Sequence[PiecewiseParam],
    *,
    gradient: str,
    step_back: StepBack,
    tableau: MethodTableau,
    method: str,
    rtol: float,
    atol: float,
    options: dict,
    stats: Any,
    steps: str = "differentiated",
    budget: int | None = None,
) -> torch.Tensor:
    """``odeint(func, y0, t)`` whose backward pass replays its accepted steps, one ``step_back`` per step
    (:func:`checkpoint_step` or :func:`symplectic_step`, see the module; ``gradient`` names it in messages).
    ``params``: the tensors to differentiate; those that are the ``data`` of an entry of ``pieces`` are
    differentiated piece by piece. ``steps`` (:mod:`solvers.gradients.step_sizes`): an adaptive method's step sizes held
    fixed (``"fixed"``), or differentiated (every attempt replayed: :mod:`solvers.gradients.replay_controlled`).
    ``budget``: keep at most that many states, recomputing the others by the online binomial schedule
    (:mod:`solvers.gradients.binomial`); ``None``: every step's."""
    if t.requires_grad:
        raise ValueError(f"gradient={gradient!r} does not differentiate the output times `t`; detach them.")
    if len(t) > 1 and float(t[0]) > float(t[-1]):
        # the recorded steps are read as t0 + dt: a solve backwards in time comes negated
        # (gradients.checkpoint.backwards_in_time)
        raise ValueError(f"gradient={gradient!r} replays a forwards solve; negate decreasing times `t` first.")
    if tableau.adaptive and steps != "fixed":
        return _controlled(
            func, y0, t, params, pieces, gradient, tableau, method, rtol, atol, options, stats, steps, budget
        )
    params, used, slot = piece_slots(params, pieces)
    cfg = dict(
        func=func,
        method=method,
        rtol=rtol,
        atol=atol,
        options=options,
        stats=stats,
        tableau=tableau,
        gradient=gradient,
        step_back=step_back,
        pieces=[pieces[j] for j in used],
        slot=slot,
        budget=budget,
    )
    return _Replay.apply(cfg, y0, t, *params)


def _controlled(func, y0, t, params, pieces, gradient, tableau, method, rtol, atol, options, stats, steps, budget):
    """:func:`replay_gradient` with the step sizes differentiated: every attempt replayed."""

    def record(y0: torch.Tensor, t: torch.Tensor, schedule: OnlineSchedule | None = None):
        return record_attempts(func, y0, t, method=method, rtol=rtol, atol=atol, options=options, schedule=schedule)

    spec = dict(
        tab=tableau,
        rtol=rtol if isinstance(rtol, torch.Tensor) else float(rtol),
        atol=atol if isinstance(atol, torch.Tensor) else float(atol),
        rule=options.get("controller") or Integral.from_options(options),
        min_step=float(options.get("min_step", 0.0)),
        max_step=float(options.get("max_step", math.inf)),
        differentiated=steps == "differentiated",
        norm=options.get("norm") if callable(options.get("norm")) else None,
    )
    step_back = symplectic_attempt if gradient == "symplectic" else checkpoint_attempt
    first = options.get("first_step")
    return controlled_replay(
        func,
        y0,
        t,
        params,
        pieces,
        record=record,
        spec_kw=spec,
        gradient=gradient,
        step_back=step_back,
        first_step=None if first is None else float(first),
        stats=stats,
        budget=budget,
    )
