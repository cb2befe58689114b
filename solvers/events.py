r"""Per-sample events: every sample of a batch on its own clock.

torchdiffeq's ``odeint_event`` ends the solve of the *whole* batch at the first event anywhere; torchode has no
events. Here each sample stops at its own first root of an event function ``g(t, y) -> (batch,)`` and leaves the
batch (index compaction, never masking), so the cost follows ``Σ_i steps_i`` instead of ``batch × max steps``.

**The loop** (:func:`integrate_events`). The span is cut into segments of a few solver steps (the caller's
``plan``); each segment is one solve of the rows still running, asked for its state at ``m`` sub-points (for
adaptive methods the solver's own dense output, no extra field evaluations; for fixed steps, grid points). ``g``
is evaluated at every sub-point; a sample whose ``g`` changes sign between sub-points ``s_j`` and ``s_{j+1}`` has
its root located there, and leaves. A requested per-sample end time ``t_end[i]`` is added to the segment's output
times, so the sample lands on it exactly (no root finding).

**Root location.** On ``[s_j, s_{j+1}]`` the trajectory is the cubic Hermite interpolant of
``(y_j, F_j, y_{j+1}, F_{j+1})`` (Hairer, Nørsett & Wanner, *Solving ODEs I*, §II.6, eq. 6.7), whose error is
``O(Δ⁴ max‖y⁗‖)/384`` for a sub-interval ``Δ`` of about one solver step. The root of ``g(t, H(t))`` is bracketed
and refined by the Illinois variant of regula falsi (Dowell & Jarratt 1971) — superlinear, never leaving the
bracket — until the bracket is narrower than ``tol`` in ``t``.

**Differentiable event times** (implicit function theorem; Chen, Amos & Nickel 2021, "Learning neural event
functions for ordinary differential equations", eq. 6). At the root ``g(t*, y(t*; θ); θ) = 0``, so

    ``dt*/dθ = −(∂g/∂θ + ∂g/∂y · ∂y/∂θ) / (∂g/∂t + ∂g/∂y · F(t*, y*))``,

and the state at the event moves with it: ``dy*/dθ = ∂y/∂θ|_{t*} + F(t*, y*) dt*/dθ``. :func:`event_time`
builds both as zero-valued corrections of the located values, whose autograd graph is exactly these formulas:
``t* = t̂ − (g(t̂, ŷ) − ⌊g(t̂, ŷ)⌋) / ġ`` and ``y* = ŷ + F (t* − ⌊t*⌋)`` (``⌊·⌋``: detached, ``ġ`` detached),
where ``ŷ`` is the differentiable state at the fixed time ``t̂`` (through the solver in any gradient mode). So a
loss on event times or on states at events trains the field and the event's own parameters.

This module is numerical only (imports nothing from cde_nets): the caller passes ``solve``, ``field`` and ``g``
on the active rows, with ``idx`` their rows in the original batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from .validation import check_event_output

__all__ = [
    "EventResult",
    "HermiteDense",
    "SEGMENT_STEPS",
    "SUBPOINTS",
    "event_time",
    "hermite",
    "integrate_events",
    "locate_roots",
    "per_sample_events",
    "segment_plan",
]

Solve = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
RowFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: :func:`per_sample_events` solves segments of about this many solver steps, each asked for its state at
#: ``SUBPOINTS`` times: g's sign is checked about twice per step, and a finished sample waits at most one segment.
SEGMENT_STEPS = 4
SUBPOINTS = 8

#: Illinois iterations at most; with a bracket of one step and tol 1e-10 a handful suffice.
_MAX_ITER = 60


def _col(v: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A per-row ``(n,)`` tensor shaped to broadcast against ``y`` ``(n, ...)``."""
    return v.reshape(v.shape[0], *([1] * (y.dim() - 1))).to(y.dtype)


def hermite(
    t: torch.Tensor, a: float, b: float, ya: torch.Tensor, yb: torch.Tensor, fa: torch.Tensor, fb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cubic Hermite interpolant on ``[a, b]`` and its time derivative at per-row times ``t`` ``(n,)``.

    ``H(a) = ya, H(b) = yb, H'(a) = fa, H'(b) = fb`` (all ``(n, ...)``); works for ``b < a`` too.
    """
    h = b - a
    s = _col((t - a) / h, ya)
    s2, s3 = s * s, s * s * s
    h00, h10, h01, h11 = 2 * s3 - 3 * s2 + 1, s3 - 2 * s2 + s, -2 * s3 + 3 * s2, s3 - s2
    y = h00 * ya + h10 * h * fa + h01 * yb + h11 * h * fb
    d00, d10, d01, d11 = 6 * s2 - 6 * s, 3 * s2 - 4 * s + 1, -6 * s2 + 6 * s, 3 * s2 - 2 * s
    dy = (d00 * ya + d01 * yb) / h + d10 * fa + d11 * fb
    return y, dy


def locate_roots(
    fn: Callable[[torch.Tensor], torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    ga: torch.Tensor,
    gb: torch.Tensor,
    tol: float,
) -> torch.Tensor:
    """Per-row root of ``fn(t) -> (n,)`` in the brackets ``[a, b]`` (``ga``, ``gb``: ``fn`` there, of opposite
    signs or ``gb = 0``), by the Illinois method, to a bracket width ``≤ tol``. Returns ``t* (n,)`` float64."""
    a, b, ga, gb = a.clone(), b.clone(), ga.double().clone(), gb.double().clone()
    t = b.clone()
    side = torch.zeros_like(a, dtype=torch.int8)  # which end moved last: Illinois halves the stale one
    active = (gb != 0) & ((b - a).abs() > tol)
    for _ in range(_MAX_ITER):
        if not bool(active.any()):
            break
        denom = gb - ga
        c = torch.where(denom != 0, b - gb * (b - a) / torch.where(denom != 0, denom, 1.0), 0.5 * (a + b))
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
        inside = (c > lo) & (c < hi)
        c = torch.where(inside, c, 0.5 * (a + b))
        gc = fn(c).double()
        t = torch.where(active, c, t)
        same_a = torch.sign(gc) == torch.sign(ga)
        # the new point replaces the end whose g has its sign; the other end, if it stays twice, is halved
        new_a, new_b = torch.where(same_a, c, a), torch.where(same_a, b, c)
        new_ga = torch.where(same_a, gc, torch.where(side == -1, 0.5 * ga, ga))
        new_gb = torch.where(same_a, torch.where(side == 1, 0.5 * gb, gb), gc)
        side = torch.where(same_a, torch.ones_like(side), -torch.ones_like(side))
        a, b = torch.where(active, new_a, a), torch.where(active, new_b, b)
        ga, gb = torch.where(active, new_ga, ga), torch.where(active, new_gb, gb)
        active = active & (gc != 0) & ((b - a).abs() > tol)
    # the end of the final bracket where g has the sign of the far side: t is never before the crossing
    return torch.where(gb == 0, b, t)


def event_time(
    g: RowFn, f: torch.Tensor, t_hat: torch.Tensor, y_hat: torch.Tensor, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The event time and state with the implicit-function-theorem gradient (module docstring).

    ``t_hat`` ``(n,)`` float64: located roots (no graph); ``y_hat`` ``(n, ...)``: the state at those fixed
    times, differentiable; ``f``: ``dy/dt`` there (``F(t̂, ŷ)``, or the interpolant's slope).
    Returns ``(t*, y*)``: values ``t_hat`` and ``y_hat``; gradients ``dt*/dθ`` and
    ``∂y/∂θ + F dt*/dθ``. A tangential crossing (``ġ = 0``) has no finite gradient; it is left at zero there.
    """
    tt = t_hat.to(y_hat.dtype)
    with torch.enable_grad():
        t_req = tt.detach().requires_grad_()
        y_req = y_hat.detach().requires_grad_()
        gv = g(t_req, y_req, idx)
        dg_dt, dg_dy = torch.autograd.grad(gv.sum(), (t_req, y_req), allow_unused=True)
    gdot = (dg_dy * f.detach()).reshape(f.shape[0], -1).sum(1) if dg_dy is not None else torch.zeros_like(tt)
    if dg_dt is not None:
        gdot = gdot + dg_dt
    safe = torch.where(gdot != 0, gdot, torch.ones_like(gdot))
    gy = g(tt, y_hat, idx)
    corr = torch.where(gdot != 0, (gy - gy.detach()) / safe, torch.zeros_like(gy))
    t_star = tt - corr
    y_star = y_hat + f * _col(t_star - t_star.detach(), y_hat)
    return t_hat + (t_star - tt).double(), y_star


@dataclass
class EventResult:
    """``y``: each sample's state where it stopped, batch order; ``times``: its stopping time ``(batch,)``
    float64 (differentiable through :func:`event_time`); ``fired``: ``(batch,)`` bool, True where the event
    (or ``t_end``) stopped it rather than the end of the span; ``knots``: the dense-output knots when asked."""

    y: torch.Tensor
    times: torch.Tensor
    fired: torch.Tensor
    knots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _put_back(parts: list[tuple[torch.Tensor, torch.Tensor]], batch: int) -> torch.Tensor:
    idx = torch.cat([i for i, _ in parts])
    order = torch.empty_like(idx)
    order[idx] = torch.arange(batch, device=idx.device)
    return torch.cat([v for _, v in parts])[order]


def integrate_events(
    solve: Solve,
    field: RowFn,
    y0: torch.Tensor,
    *,
    t0: float,
    t1: float,
    plan: Callable[[float], Sequence[float]],
    event: RowFn | None = None,
    t_end: torch.Tensor | None = None,
    stop_below: bool = False,
    tol: float = 1e-10,
    dense: bool = False,
) -> EventResult:
    """Integrate each sample from ``t0`` until its first event, its ``t_end``, or ``t1`` (either direction).

    Args:
        solve: ``solve(y, times, idx) -> (len(times), n, ...)``: the active rows ``idx`` (in the original batch)
            from ``times[0]`` through ``times`` (monotone, float64), differentiable in any gradient mode.
        field: ``field(t, y, idx)``: ``F`` on rows ``idx``; ``t`` a 0-d tensor (one time) or ``(n,)`` per row.
        y0: ``(batch, ...)`` state at ``t0``.
        plan: ``plan(t) -> [s_1, ..., s_m]``: the next segment's sub-points after ``t``, its last the segment's
            end (toward ``t1``, which ends the last). The sign of ``g`` is checked at every sub-point.
        event: ``g(t, y, idx) -> (n,)`` with ``t`` ``(n,)``: a sample stops at its first sign change.
        t_end: ``(batch,)`` per-sample end times within the span: a sample stops there exactly.
        stop_below: a sample whose ``g ≤ 0`` at ``t0`` stops there (a threshold rule such as ``‖F‖ − ε``).
        tol: width in ``t`` to which roots are located on the interpolant (at least 8 ulps of ``y``'s dtype at
            ``t``: ``g`` sees ``t`` in that dtype).
        dense: keep every sub-point's state and field as Hermite knots (no event or ``t_end`` allowed: the
            whole batch runs to ``t1``).
    """
    loop = _EventLoop(solve, field, y0, t0, t1, event, t_end, tol)
    loop.start(stop_below)
    while loop.idx.numel() and loop.sign * (t1 - loop.t) > 0:
        loop.segment(plan, dense)
    return loop.result(dense)


SegmentSolve = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", "float | None"], tuple]


def segment_plan(
    grid: torch.Tensor | None, t0: float, t1: float, est: dict, per_segment: int
) -> Callable[[float], list[float]]:
    """Where the event loop's next solve from ``t`` ends, and the sub-points at which it checks the sign
    (forwards, ``t0 < t1``).

    Fixed steps: the next :data:`SEGMENT_STEPS` grid points, the sign checked at every step. Adaptive: a segment
    of ``per_segment`` times the last segment's mean step ``est["dt"]`` (``(t1 − t0) / 16`` before the first), in
    :data:`SUBPOINTS` equal parts."""
    if grid is not None:
        pts = grid.tolist()

        def plan(t: float) -> list[float]:
            nxt = [p for p in pts if p > t]
            return nxt[:SEGMENT_STEPS] or [t1]

        return plan

    def plan_adaptive(t: float) -> list[float]:
        seg = min(per_segment * est["dt"], t1 - t) if "dt" in est else (t1 - t0) / 16
        return [t + seg * k / SUBPOINTS for k in range(1, SUBPOINTS)] + [min(t + seg, t1)]

    return plan_adaptive


def per_sample_events(
    solve: SegmentSolve,
    field: RowFn,
    y0: torch.Tensor,
    *,
    t0: float,
    t1: float,
    grid: torch.Tensor | None,
    steps_to_points: bool = False,
    free_first_step: bool = True,
    event: RowFn | None = None,
    t_end: torch.Tensor | None = None,
    stop_below: bool = False,
    tol: float = 1e-10,
    dense: bool = False,
) -> EventResult:
    """The per-sample event loop (:func:`integrate_events`) over ``[t0, t1]`` with its segments planned: the one
    loop both doors run (``ODEBlock.solve(y0, event=g)`` and ``cde_nets.odeint(..., event_fn=g,
    event_mode="per_sample")``), and the dense output of both.

    ``solve(y, times, idx, grid, first_step) -> (ys, steps)``: the rows ``idx`` through ``times`` on the engine,
    with the fixed steps' ``grid`` cut to the segment (``None`` for adaptive methods) and, after the first segment,
    the last segment's mean step as ``first_step`` (``None`` where ``free_first_step`` is false: the caller set
    one), returning the states and the accepted steps. ``steps_to_points``: the method has no dense output and
    steps *to* every sub-point (``alf``): its sub-points are spaced about one step apart, and a segment in which no
    sub-interval needed a second step grows the next one twofold (a mean step of segment / steps would shrink the
    next segment every time until the sub-points coincide). The other arguments are :func:`integrate_events`'."""
    est: dict = {}
    plan = segment_plan(grid, t0, t1, est, SUBPOINTS if steps_to_points else SEGMENT_STEPS)

    def solve_segment(y: torch.Tensor, times: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        g = None if grid is None else grid[(grid >= times[0]) & (grid <= times[-1])]
        first = est["dt"] if grid is None and "dt" in est and free_first_step else None  # no fresh search per segment
        ys, steps = solve(y, times, idx, g, first)
        span, intervals = float(times[-1] - times[0]), len(times) - 1
        est["dt"] = 2 * span / intervals if steps_to_points and steps <= intervals else span / max(1, steps)
        return ys

    return integrate_events(
        solve_segment,
        field,
        y0,
        t0=t0,
        t1=t1,
        plan=plan,
        event=event,
        t_end=t_end,
        stop_below=stop_below,
        tol=tol,
        dense=dense,
    )


class _EventLoop:
    """The state of :func:`integrate_events`: the rows still running (``idx``, their state ``cur`` at time ``t``
    and last event value ``g_prev``), and each finished sample's state and time."""

    def __init__(self, solve: Solve, field: RowFn, y0: torch.Tensor, t0: float, t1: float, event, t_end, tol: float):
        batch, device = y0.shape[0], y0.device
        self.solve, self.field, self.event, self.tol = solve, field, event, tol
        self.y0, self.t0, self.t1, self.batch, self.device = y0, t0, t1, batch, device
        self.sign = 1.0 if t1 >= t0 else -1.0
        self.times = torch.full((batch,), t1, dtype=torch.float64, device=device)
        self.fired = torch.zeros(batch, dtype=torch.bool, device=device)
        self.t_end = None if t_end is None else t_end.to(device=device, dtype=torch.float64)
        self.idx = torch.arange(batch, device=device)
        self.parts_y: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.parts_t: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.knots_t: list[float] = [t0]
        self.knots_y: list[torch.Tensor] = [y0]
        self.cur, self.t = y0, t0
        self.g_prev: torch.Tensor | None = None

    def finish(self, rows: torch.Tensor, y: torch.Tensor, tt: torch.Tensor, by_event: bool = True) -> None:
        self.parts_y.append((self.idx[rows], y))
        self.parts_t.append((self.idx[rows], tt))
        self.times[self.idx[rows]] = tt.detach()
        self.fired[self.idx[rows]] = by_event

    def keep(self, keep: torch.Tensor, cur: torch.Tensor) -> None:
        self.idx, self.cur = self.idx[keep], cur[keep]
        if self.g_prev is not None:
            self.g_prev = self.g_prev[keep]

    def _landed(self, y_rows: torch.Tensor, te_rows: torch.Tensor, t: torch.Tensor, rows: torch.Tensor):
        """The state at a sample's ``t_end``, with ``dy(t_end)/dt_end = F(t_end, y(t_end))`` when it needs grad."""
        if te_rows.requires_grad:
            f = self.field(t, y_rows, self.idx[rows])
            y_rows = y_rows + f * _col(te_rows - te_rows.detach(), y_rows)
        return y_rows

    def start(self, stop_below: bool) -> None:
        """Samples that stop at ``t0``: ``g ≤ 0`` there under ``stop_below``, or an end time at the start."""
        y0, t0, device = self.y0, self.t0, self.device
        if self.event is not None:
            with torch.no_grad():
                self.g_prev = self.event(torch.full((self.batch,), t0, dtype=y0.dtype, device=device), y0, self.idx)
            check_event_output(self.g_prev, "`event`", (self.batch,))
            if stop_below:
                at_start = cast(torch.Tensor, self.g_prev) <= 0
                if bool(at_start.any()):
                    n = int(at_start.sum())
                    self.finish(at_start, y0[at_start], torch.full((n,), t0, dtype=torch.float64, device=device))
                    self.keep(~at_start, self.cur)
        t_end = self.t_end
        if t_end is not None and bool((t_end[self.idx] == t0).any()):
            at_start = t_end[self.idx] == t0
            y_rows, te_rows = self.cur[at_start], t_end[self.idx][at_start]
            y_rows = self._landed(y_rows, te_rows, torch.tensor(t0, dtype=y0.dtype, device=device), at_start)
            self.finish(at_start, y_rows, te_rows)
            self.keep(~at_start, self.cur)

    def segment(self, plan: Callable[[float], Sequence[float]], dense: bool) -> None:
        """Solve the running rows over the next segment of sub-points; finish those that stop inside it."""
        sign, t, t1, device = self.sign, self.t, self.t1, self.device
        sub = [s for s in plan(t) if sign * (s - t) > 0 and sign * (t1 - s) >= 0] or [t1]
        pts = torch.tensor([t, *sub], dtype=torch.float64, device=device)
        ends = None
        if self.t_end is not None:
            te = self.t_end[self.idx]
            here = (sign * (te - t) > 0) & (sign * (pts[-1] - te) >= 0)
            if bool(here.any()):
                ends = te
                pts = torch.unique(torch.cat([pts, te[here].detach()]))
                pts = pts if sign > 0 else pts.flip(0)
        ys = self.solve(self.cur, pts, self.idx)
        n_sub = len(pts) - 1
        done = torch.zeros(self.idx.numel(), dtype=torch.bool, device=device)
        first, gs = self._crossings(pts, ys)
        if ends is not None:  # a t_end before the sample's first crossing wins: it lands on it
            j_end = torch.searchsorted(pts * sign, (ends * sign).contiguous()).clamp(max=n_sub)
            hit = (pts[j_end] == ends) & (j_end <= first)
            for j in torch.unique(j_end[hit]).tolist():
                rows = hit & (j_end == j)
                self.finish(rows, self._landed(ys[j][rows], ends[rows], pts[j].to(self.y0.dtype), rows), ends[rows])
                done |= rows
        if gs is not None:
            for j in torch.unique(first[~done & (first < n_sub)]).tolist():
                rows = ~done & (first == j)
                self._locate(pts, ys, gs, j, rows)
                done |= rows
        if dense:
            self.knots_t.extend(float(p) for p in pts[1:])
            self.knots_y.extend(ys[1:])
        self.t = float(pts[-1])
        if bool(done.any()):
            self.keep(~done, ys[-1])
        else:
            self.cur = ys[-1]

    def _crossings(self, pts: torch.Tensor, ys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per running row, the first sub-interval where ``g`` changes sign (``n_sub`` where none), and ``g`` at
        every sub-point."""
        n, n_sub, dtype = self.idx.numel(), len(pts) - 1, self.y0.dtype
        if self.event is None:
            return torch.full((n,), n_sub, dtype=torch.long, device=self.device), None
        with torch.no_grad():
            gs = torch.stack(
                [cast(torch.Tensor, self.g_prev)]
                + [
                    self.event(torch.full((n,), float(pts[j]), dtype=dtype, device=self.device), ys[j], self.idx)
                    for j in range(1, n_sub + 1)
                ]
            )
        cross = (gs[:-1] * gs[1:] < 0) | ((gs[1:] == 0) & (gs[:-1] != 0))  # (n_sub, n)
        first = torch.where(cross.any(0), cross.int().argmax(0), n_sub)
        self.g_prev = gs[-1]
        return first, gs

    def _locate(self, pts: torch.Tensor, ys: torch.Tensor, gs: torch.Tensor, j: int, rows: torch.Tensor) -> None:
        """Finish ``rows``, whose first sign change lies in sub-interval ``j``, at the root on the interpolant."""
        event, dtype = self.event, self.y0.dtype
        a, b = float(pts[j]), float(pts[j + 1])
        ri = self.idx[rows]
        ya, yb = ys[j][rows], ys[j + 1][rows]
        # F at the sub-interval's ends, with its graph: the interpolant's slopes (differentiable)
        fa_g = self.field(pts[j].to(dtype), ya, ri)
        fb_g = self.field(pts[j + 1].to(dtype), yb, ri)
        fa, fb = fa_g.detach(), fb_g.detach()
        with torch.no_grad():

            def g_on_h(tc: torch.Tensor) -> torch.Tensor:
                return event(tc.to(dtype), hermite(tc, a, b, ya, yb, fa, fb)[0], ri)

            n_rows = int(rows.sum())
            # g sees t and y in y's dtype: no bracket narrower than a few of its ulps at t is meaningful
            tol_j = max(self.tol, 8 * torch.finfo(dtype).eps * max(1.0, abs(a), abs(b)))
            t_hat = locate_roots(
                g_on_h, pts.new_full((n_rows,), a), pts.new_full((n_rows,), b), gs[j][rows], gs[j + 1][rows], tol_j
            )
        # the state at the fixed time t̂ on the interpolant, differentiable through ya, yb and F at the ends;
        # its slope stands for F(t̂, ŷ) (no field call at per-row times, consistent with the located root)
        y_hat, v_hat = hermite(t_hat, a, b, ya, yb, fa_g, fb_g)
        t_star, y_star = event_time(event, v_hat, t_hat, y_hat, ri)
        self.finish(rows, y_star, t_star)

    def result(self, dense: bool) -> EventResult:
        """Every sample's state and time, batch order (those still running stop at ``t1``), and the knots."""
        batch, device = self.batch, self.device
        if self.idx.numel():
            rows = torch.ones(self.idx.numel(), dtype=torch.bool, device=device)
            ts = torch.full((self.idx.numel(),), self.t, dtype=torch.float64, device=device)
            self.finish(rows, self.cur, ts, by_event=False)
        y = _put_back(self.parts_y, batch)
        tt = _put_back(self.parts_t, batch)
        knots = None
        if dense:
            kt = torch.tensor(self.knots_t, dtype=torch.float64, device=device)
            ky = torch.stack(self.knots_y)
            every = torch.arange(batch, device=device)
            kf = torch.stack([self.field(kt[k].to(self.y0.dtype), ky[k], every) for k in range(len(kt))])
            knots = (kt, ky, kf)
        return EventResult(y=y, times=tt, fired=self.fired, knots=knots)


class HermiteDense:
    """Dense output of a solve: the piecewise cubic Hermite interpolant through the solver's states ``ys``
    ``(K, batch, ...)`` and fields ``fs`` at the knots ``ts`` ``(K,)`` (monotone, either direction). Between
    knots (about one solver step apart) its error is ``O(Δ⁴)``; at the knots it is the solver's own value."""

    def __init__(self, ts: torch.Tensor, ys: torch.Tensor, fs: torch.Tensor):
        self.ts, self.ys, self.fs = ts, ys, fs
        self.sign = 1.0 if float(ts[-1]) >= float(ts[0]) else -1.0

    def evaluate(self, t: float | Sequence[float] | torch.Tensor) -> torch.Tensor:
        """States at times ``t``: a scalar gives ``(batch, ...)``, a 1-D sequence ``(len(t), batch, ...)``."""
        tt = torch.as_tensor(t, dtype=torch.float64, device=self.ts.device)
        lo, hi = sorted((float(self.ts[0]), float(self.ts[-1])))
        if tt.dim() > 1 or bool(((tt < lo - 1e-12 * max(1.0, abs(lo))) | (tt > hi + 1e-12 * max(1.0, abs(hi)))).any()):
            raise ValueError(f"`t` must be a time or a 1-D sequence of times within the solved span [{lo}, {hi}].")
        scalar = tt.dim() == 0
        tt = tt.reshape(-1)
        key = (self.ts * self.sign).contiguous()
        k = (torch.searchsorted(key, (tt * self.sign).contiguous(), right=True) - 1).clamp(0, len(self.ts) - 2)
        out = []
        for ti, ki in zip(tt.tolist(), k.tolist()):
            a, b = float(self.ts[ki]), float(self.ts[ki + 1])
            n = self.ys.shape[1]
            tv = torch.full((n,), ti, dtype=torch.float64, device=self.ts.device)
            out.append(hermite(tv, a, b, self.ys[ki], self.ys[ki + 1], self.fs[ki], self.fs[ki + 1])[0])
        res = torch.stack(out)
        return res[0] if scalar else res
