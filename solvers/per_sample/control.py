r"""The per-sample step-size controller: accept/reject, the next step and the rows' clocks, in few batched ops.

For every running row ``b``, the error ratio (Hairer, Nørsett & Wanner, "Solving Ordinary Differential
Equations I", §II.4, eq. 4.11)

    ``r_b = ‖err_b / (atol_b + rtol_b max(|y_b|, |Y_b|))‖_2 / √N``,   accepted where ``r_b ≤ 1``,

and the next step by the PI controller (Gustafsson 1991, "Control theoretic techniques for stepsize selection
in explicit Runge-Kutta methods"; Hairer & Wanner, "Solving Ordinary Differential Equations II", §IV.2,
eq. 2.43c), with the constants of Hairer's DOPRI5 code (``β = 0.04``, ``α = 1/p − 0.75 β``, ``p`` the order):

    ``h_b ← h_b · clip(safety · r_b^(−α) · w_b, dfactor, cap_b)``,

``w_b = max(r_b', 10⁻⁴)^β`` with ``r_b'`` the ratio of the row's previous accepted step (1 before its first)
where the step is accepted, ``w_b = 1`` where it is rejected; ``cap_b = 1`` right after a rejection (a step that
just failed is not enlarged) and ``ifactor`` otherwise. On the mixed-stiffness Van der Pol
batch of ``benchmarks/per_sample.py`` this takes 1178 batched calls where the integral controller
``clip(safety · r^(−1/p), dfactor, ifactor)`` (torchode's) takes 1244, and torchdiffeq's rule (an accepted step
never shrinks the next) 1424. The shared step (:mod:`solvers.steppers.fast_rk`) keeps torchdiffeq's rule.

The roots run on a buffer padded to whole SIMD vectors (a vectorised ``pow`` and the scalar one of a short tail
differ in the last bit, which would make a sample's steps depend on its place in the batch). Everything stays on
the device; the sweep's one host read is the counts (rows running, rows owing an output, rows whose clock moved).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = ["Controller", "Decision", "in_dtype"]

LANES = 16  # a multiple of every CPU vector width in float64
BETA = 0.04  # the PI controller's weight on the previous ratio (Hairer's DOPRI5 code)
FLOOR = 1e-4  # the least previous ratio the PI controller takes (Hairer's DOPRI5 code)


class Decision(NamedTuple):
    """One sweep's decisions for ``m`` rows: ``ok`` accepted, ``t_new`` the rows' time after it, ``dt``/``t1``
    the next step and its end, ``alive`` still short of the end, ``due`` owing an output within the accepted step
    (``None`` without outputs between start and end), ``prev``/``cap`` the rows' controller memory after it
    (``max(√N r', 10⁻⁴ √N)^β`` and the bound on the next factor), ``moved`` whose next step advances its clock (false
    for a NaN or underflowed step, and for finished rows, frozen at zero steps), ``norm`` ``√N r`` (in a buffer
    the next sweep reuses), the counts of ``alive``, ``due``, and of the running rows whose step failed,
    the accepted steps that ended on a jump of the field (``None`` without jumps), if asked, the span of the
    next sweep's times on the host: the least ``t_new`` and the greatest ``t1``, in the state's dtype, and ``ok``
    on every component for a state of a few components."""

    ok: torch.Tensor
    t_new: torch.Tensor
    dt: torch.Tensor
    t1: torch.Tensor
    alive: torch.Tensor
    due: torch.Tensor | None
    prev: torch.Tensor
    cap: torch.Tensor
    moved: torch.Tensor
    norm: torch.Tensor
    n_alive: int
    n_due: int
    n_bad: int
    jumped: torch.Tensor | None
    span: tuple[float, float] | None
    ok_n: torch.Tensor | None  # ``ok`` on every component ``(m, N)`` (``None``: broadcast ``ok[:, None]``)
    # with ``keep``: the factor on the step (after its clip) and where it is a function of the ratio (not clipped
    # to ``dfactor``/``cap``, nor the step to ``min_step``/``max_step``): what a differentiated step reads
    factor: torch.Tensor | None = None
    free: torch.Tensor | None = None


def _read_counts(
    flags: list[torch.Tensor], span: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype
) -> tuple[list[int], tuple[float, float] | None]:
    """The sweep's one host read: how many rows each flag holds and, with ``span = (t_new, t1)``, the least and
    greatest time of the next sweep in ``dtype`` (the counts travel exactly in float64 beside them)."""
    if span is None:
        return torch.stack(flags).sum(1).tolist(), None
    ends = torch.stack((span[0].min(), span[1].max()))
    *sums, lo, hi = torch.cat((torch.stack(flags).sum(1, dtype=torch.float64), ends)).tolist()
    return [int(c) for c in sums], (in_dtype(lo, dtype), in_dtype(hi, dtype))


class Controller:
    """The controller's constants (made once) and its padded root buffer (made once per row count)."""

    def __init__(self, order: int, opts: dict, device: torch.device):
        self.order = order
        self.min_step = float(opts.get("min_step", 0.0))
        self.max_step = float(opts.get("max_step", math.inf))
        self.safety = float(opts.get("safety", 0.9))
        self.ifactor = float(opts.get("ifactor", 10.0))
        self.dfactor = float(opts.get("dfactor", 0.2))
        self.bounded = self.min_step > 0 or self.max_step < math.inf
        self.alpha = 1.0 / order - 0.75 * BETA
        self.one, self.dfactor_t, self.ifactor_t = _scalars(device, 1.0, self.dfactor, self.ifactor)
        # a (2, 1) column: the exponents of the two rows of the ratios' buffer (the same bits as two scalar powers)
        self.exponents = torch.tensor([[-self.alpha], [BETA]], dtype=torch.float64, device=device)
        self.device = device
        self._space: tuple | None = None
        self._per_n: dict[int, tuple] = {}

    def _buffers(self, m: int, N: int, dtype: torch.dtype) -> tuple:
        """For ``m`` rows of ``N``: the ratios and their floored copy as the two rows of a float64 buffer padded
        with ones to whole SIMD vectors (the ratios' first ``m`` too), one more of that shape for their powers
        (the first ``m`` of each row), and the error estimate ``(m N,)`` with its ``(m, N)`` view; made once per
        row count."""
        if self._space is None or self._space[0] != (m, N, dtype):
            ratios = torch.ones((2, m + (-m % LANES)), dtype=torch.float64, device=self.device)
            powers = torch.empty_like(ratios)
            err = torch.empty(m * N, dtype=dtype, device=self.device)
            norm = ratios[0, :m]
            views = (ratios, ratios[0], ratios[1], norm, norm.view(m, 1).expand(m, N), powers, powers[0, :m])
            self._space = ((m, N, dtype), *views, powers[1, :m], err, err.view(m, N))
        return self._space[1:]

    def constants(self, N: int) -> tuple:
        """The ``√N`` of the RMS norm folded into the constants (the controller works on ``ρ = √N r``), each a
        0-d tensor (an operation takes one faster than a Python number): ``√N``, ``safety · N^((α−β)/2)``, the
        weight of a rejected step ``N^(β/2)``, and the floor ``10⁻⁴ √N`` of the previous ``ρ``; the rows' first
        memory ``N^(β/2)`` (``r' = 1``) is the same weight."""
        c = self._per_n.get(N)
        if c is None:
            sqrt_n = math.sqrt(N)
            values = (sqrt_n, self.safety * N ** ((self.alpha - BETA) / 2), N ** (BETA / 2), FLOOR * sqrt_n)
            c = self._per_n[N] = tuple(_scalars(self.device, *values))
        return c

    def decide(
        self,
        rows: Any,
        errT: torch.Tensor,
        e: torch.Tensor,
        y: torch.Tensor,
        Y: torch.Tensor,
        jumps: bool,
        span: bool = False,
        keep: bool = False,
    ) -> Decision:
        """The decisions after an attempted step: ``errT`` the stages times the step, stage-minor (``(m N, s)``),
        ``e`` the error weights, ``y`` the step's start and ``Y`` its attempted end ``(m, N)`` (no graph; the
        error's scale is ``max(|y|, |Y|)``), ``jumps`` whether the field has jumps (``rows.on_jump`` marks the
        steps that end on one), ``span`` whether to read the span of the next sweep's times with the counts,
        ``keep`` whether to keep the factor and where it is free (:attr:`Decision.factor`, :attr:`Decision.free`)."""
        m, N = Y.shape
        ratios, full, floored, norm, norm_n, powers, grow, memory, err, err2 = self._buffers(m, N, Y.dtype)
        sqrt_n, scale, reject, floor = self.constants(N)
        tol = torch.addcmul(rows.atol, torch.maximum(y.abs(), Y.abs()), rows.rtol)
        torch.mv(errT, e, out=err)
        torch.linalg.vector_norm(err2.div_(tol), dim=1, dtype=torch.float64, out=norm)
        ok = torch.le(norm, sqrt_n)
        ok_n: torch.Tensor | None = None
        if self.min_step > 0:
            ok |= rows.dt <= self.min_step
        elif N < LANES:  # the test on every component: the state's updates select without broadcasting a
            ok_n = torch.le(norm_n, sqrt_n)  # column over a few components (0.7 µs less each at N = 2)
        t_new = torch.where(ok, rows.t1, rows.t0)
        weight = torch.where(ok, rows.prev, reject)
        # both powers in one call: ρ^(−α) and max(ρ, floor)^β, the rows of the padded buffer
        torch.clamp(full, min=floor, out=floored)
        torch.pow(ratios, self.exponents, out=powers)
        raw = grow.mul_(weight).mul_(scale)
        factor = free = None
        if keep:
            free = (raw > self.dfactor_t) & (raw < rows.cap)
            factor = torch.clamp(raw, self.dfactor_t, rows.cap)
            dt = factor * rows.dt
        else:
            dt = torch.clamp(raw, self.dfactor_t, rows.cap).mul_(rows.dt)
        prev = torch.where(ok, memory, rows.prev)
        cap = torch.where(ok, self.ifactor_t, self.one)
        if self.bounded:
            dt.clamp_(self.min_step, self.max_step)
        # the last step ends on the row's end; a finished row rides along frozen there (zero steps)
        t1 = torch.minimum(t_new + dt, rows.tl)
        dt = t1 - t_new
        alive = t_new < rows.tl
        moved = t1 > t_new
        flags = [alive, moved]
        # an output is due once the row's time reaches it (the next always lies after the step's start); the
        # last output is the finished row's state, so without outputs in between none ever falls due
        due = rows.t_next <= t_new if rows.tt.shape[1] > 3 else None
        if due is not None:
            flags.append(due)
        if jumps:
            flags.append(ok & rows.on_jump)
        counts, times = _read_counts(flags, (t_new, t1) if span else None, Y.dtype)
        n_alive, n_frozen = counts[0], counts[0] - counts[1]
        n_due = counts[2] if due is not None else 0
        jumped = flags[-1] if jumps and counts[-1] else None
        kept = (alive, due, prev, cap, moved, norm, n_alive, n_due, n_frozen, jumped, times, ok_n, factor, free)
        return Decision(ok, t_new, dt, t1, *kept)

    def differentiated(
        self, rows: Any, d: Decision, K: torch.Tensor, e: torch.Tensor, y: torch.Tensor, Y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' new clocks ``(t_0, h, t_1, memory)`` after the attempt as functions of the attempt (its stages
        times the step ``K`` ``(s, m, N)``, start ``y``, end ``Y``) and of the clocks before it (``rows``, which
        may carry their own graphs), on the branches ``d`` took (:mod:`solvers.gradients.step_sizes`): ``ρ = ‖err /
        tol‖``, ``h ← h · clip(scale · ρ^(−α) · w, dfactor, cap)`` where ``d.free``, the memory ``max(ρ, floor)^β`` of
        an accepted step. Values agree with ``d``'s to rounding (the caller keeps ``d``'s bits)."""
        assert d.factor is not None and d.free is not None
        N = Y.shape[1]
        _, scale, reject, floor = self.constants(N)
        err = torch.tensordot(e, K, 1)
        tol = rows.atol + rows.rtol * torch.maximum(y.abs(), Y.abs())
        rho = torch.linalg.vector_norm(err / tol, dim=1, dtype=torch.float64)
        rho = torch.where(rho > 0, rho, self.one)  # a zero ratio's factor is clipped: keep its gradient finite
        weight = torch.where(d.ok, rows.prev, reject)
        factor = torch.where(d.free, rho ** (-self.alpha) * weight * scale, d.factor)
        step = factor * rows.dt
        if self.bounded:  # a step clipped to min_step/max_step is that constant
            pre = d.factor * rows.dt.detach()
            inside = (pre > self.min_step) & (pre < self.max_step)
            step = torch.where(inside, step, pre.clamp(self.min_step, self.max_step))
        t_new = torch.where(d.ok, rows.t1, rows.t0)
        t1 = torch.minimum(t_new + step, rows.tl)
        memory = torch.clamp(rho, min=floor) ** BETA
        prev = torch.where(d.ok, memory, rows.prev)
        return t_new, t1 - t_new, t1, prev


_SCALARS: dict[tuple, torch.Tensor] = {}


def _scalars(device: torch.device, *values: float) -> list[torch.Tensor]:
    """0-d float64 tensors of ``values`` on ``device``, made once each (read only)."""
    out = []
    for v in values:
        t = _SCALARS.get((device, v))
        if t is None:
            t = _SCALARS[(device, v)] = torch.tensor(v, dtype=torch.float64, device=device)
        out.append(t)
    return out


def in_dtype(x: float, dtype: torch.dtype) -> float:
    """A float64 time as the state's dtype rounds it (the field sees its times in that dtype; rounding is
    monotone, so the span of the rounded times is the rounded span)."""
    return x if dtype == torch.float64 else float(torch.tensor(x, dtype=torch.float64).to(dtype))
