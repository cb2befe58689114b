r"""The interpolating adjoint: the continuous adjoint solved backwards along the forward solve's dense output.

For ``y' = F(t, y, θ)`` and a loss ``ℒ(y(t_0), …, y(t_N))``, Pontryagin's adjoint (Chen et al. 2018, "Neural
ordinary differential equations", eqs. 4-5) runs backwards from ``t_N``,

    ``a' = −aᵀ ∂F/∂y(t, y(t))``,   ``g' = −aᵀ ∂F/∂θ(t, y(t))``,   ``a(t_N) = ∂ℒ/∂y(t_N)``,   ``g(t_N) = 0``,

``a`` jumping by ``∂ℒ/∂y(t_i)`` as it passes each output time; then ``∂ℒ/∂y_0 = a(t_0)``, ``∂ℒ/∂θ = g(t_0)``.
The backsolve adjoint (:class:`~solvers.gradients.Adjoint`) also integrates ``y`` backwards beside ``a``; where the
forward solution attracts (a stiff field: Van der Pol at large ``μ``) the reversed flow repels, and that solve
blows up or its step size underflows. Here ``y(t)`` is never solved backwards: it is read off the forward solve's
dense output, as SciMLSensitivity's ``InterpolatingAdjoint`` does (Rackauckas et al. 2020, "Universal
differential equations for scientific machine learning"; Kim et al. 2021, "Stiff neural ordinary differential
equations", on why the backsolve fails on stiff problems). The backward solve is of ``(a, g)`` alone, linear and
as stable backwards as the forward solve is forwards.

The dense output of each accepted step is a polynomial in ``x = (t − t_n) / (t_{n+1} − t_n)``,
``y(t) = Σ_p C_p x^p``: the method's continuous extension (``C_0 = y_n``, ``C_{p+1} = h Σ_i W_{pi} k_i``, the
weights of :mod:`solvers.steppers.tableaux`: dopri5's and the Hermite methods' quartic, tsit5's and dopri8's own
extensions), or for the fixed-step methods the cubic Hermite interpolant of ``y_n, y_{n+1}`` and the slopes
``F(t_n, y_n)``, ``F(t_{n+1}, y_{n+1})`` (Hairer, Nørsett & Wanner, "Solving ODEs I", §II.6).

- ``checkpoints=False``: the coefficients of every step are kept from the forward solve (its stages are caught
  as it evaluates them; no extra evaluation but dopri8's dense stages and, for fixed steps, one at the end):
  memory ``(d + 1) N`` states for ``N`` steps and degree ``d``.
- ``checkpoints=True`` (or ``k``): only the start state of every (``k``-th) accepted step is kept, and the step
  times. The backward solve is the plain variant's; when it first reads a time in a saved interval, that
  interval's recorded steps are replayed forwards from its saved start with the tableau
  (:mod:`solvers.gradients.replay`) to rebuild its dense output (the plain variant's, to rounding); a few
  rebuilt intervals are kept (:class:`_Rebuilt`). Memory ``N / k`` states plus ``(d + 1) max(16, 2k)`` while
  rebuilt; time, one more forward solve.

The dense output covers ``[t_0, t_N]`` only, so the backward solve's last step lands on ``t_0`` instead of
stepping past it and interpolating back (as an adaptive solve ends elsewhere): past ``t_0`` it would read the
first step's polynomial extrapolated, whose error grows as ``|x|^d`` in ``x = (t − t_0)/h_0`` from that of its
top coefficients (the stages' rounding: under float16 autocast, 10 at ``x = −12`` on a state of norm 3, the
gradient then 1e-2 from backprop's).

The gradient is that of the ODE up to the forward solve's error (through the interpolant) and the backward
solve's; unlike the replays it is not the exact derivative of the solver's steps.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import check_positive, check_positive_int
from ..options import ADAPTIVE_METHODS, OWN_FIXED_METHODS, REVERSIBLE_METHODS, check_method
from ..steppers.fast_rk import _dense_weights
from ..steppers.rk_odeint import odeint_rk
from ..steppers.tableaux import TABLEAUX, MethodTableau
from .base import GradientMethod, Run
from .checkpoint import backwards_in_time
from .replay import Recorder, Steps, _solve_recorded, _stages, _times_of
from .second_order import first_order, remember_inputs

__all__ = ["Interpolating"]


def _served() -> list[str]:
    return sorted(m for m, tab in TABLEAUX.items() if tab.continuous)


@dataclass(frozen=True, repr=False)
class Interpolating(GradientMethod):
    """The continuous adjoint ``a' = −aᵀ ∂F/∂y``, ``g' = −aᵀ ∂F/∂θ`` solved backwards with ``y(t)`` read off the
    forward solve's dense output, not re-solved backwards (SciMLSensitivity's ``InterpolatingAdjoint``; module
    docstring). ``checkpoints``: ``False`` keeps every step's dense-output coefficients (memory ``O(steps)``);
    ``True`` keeps each accepted step's start state and rebuilds the dense output step by step on the way back;
    an integer ``k`` keeps every ``k``-th (memory ``O(steps / k)``). ``rtol``, ``atol``, ``method``: the backward
    solve's (default: the forward's); its error norm measures ``a`` only (the seminorm of Kidger, Chen & Lyons
    2021, "Hey, that's not an ODE"). Serves the explicit Runge-Kutta methods of
    :data:`~solvers.steppers.tableaux.TABLEAUX`, adaptive and fixed-step."""

    checkpoints: bool | int = False
    rtol: float | None = None
    atol: float | None = None
    method: str | None = None

    name = "interpolating"

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoints, bool):
            check_positive_int("checkpoints", self.checkpoints, "keep every k-th step's start; or True/False")
        if self.rtol is not None:
            object.__setattr__(self, "rtol", check_positive("rtol", self.rtol))
        if self.atol is not None:
            object.__setattr__(self, "atol", check_positive("atol", self.atol))
        if self.method is not None:
            check_method(self.method, "method")
            if not self.supports(self.method):
                raise ValueError(
                    f"Interpolating(method={self.method!r}): the backward solve runs on the library's explicit "
                    f"Runge-Kutta stepper; use one of {_served()}."
                )

    @property
    def every(self) -> int:
        """Keep every ``every``-th step's start (0: keep the dense output of every step instead)."""
        return 0 if self.checkpoints is False else 1 if self.checkpoints is True else int(self.checkpoints)

    def describe(self) -> str:
        if self.every == 0:
            return self.name
        return f"{self.name} (checkpoints{'' if self.every == 1 else f' every {self.every}'})"

    def supports(self, method: str) -> bool:
        return method in TABLEAUX and TABLEAUX[method].continuous

    def refusal(self, method: str) -> str:
        if method in REVERSIBLE_METHODS or method in OWN_FIXED_METHODS:
            kind = "an implicit or composition method" if method in OWN_FIXED_METHODS else "asynchronous leapfrog"
        else:
            kind = "not one of the library's explicit Runge-Kutta methods"
        return (
            f"gradient='interpolating' reads y(t) off the dense output of the library's explicit Runge-Kutta steps; "
            f"method={method!r} is {kind}. Use one of {_served()}, or gradient='backprop'/'checkpoint' with "
            f"{method!r}."
        )

    def solve(self, run: Run) -> torch.Tensor:
        if run.t.requires_grad:
            raise ValueError("gradient='interpolating' does not differentiate the output times `t`; detach them.")
        if self.every and run.y0.is_complex():
            raise ValueError(
                f"Interpolating(checkpoints={self.checkpoints!r}) replays the steps of a real state; this state is "
                "complex. Use Interpolating() (checkpoints=False), or integrate torch.view_as_real(y0)."
            )
        if len(run.t) > 1 and float(run.t[0]) > float(run.t[-1]):
            run = backwards_in_time(run)
        s = run.solver
        back = s.method if self.method is None else self.method
        cfg = dict(
            run=run,
            tab=TABLEAUX[s.method],
            every=self.every,
            back_method=back,
            back_rtol=s.rtol if self.rtol is None else self.rtol,
            back_atol=s.atol if self.atol is None else self.atol,
        )
        return _Interpolating.apply(cfg, run.y0, run.t, *run.params)


# -- the forward solve: each accepted step's stages caught as the stepper evaluates them ---------------------------


class _StageRecorder(Recorder):
    """A :class:`~solvers.gradients.replay.Recorder` that also catches every accepted step's stages (``keep``:
    the plain variant) and keeps the start state of every ``every``-th step only (the checkpointed one).

    The stepper evaluates an adaptive step's stages ``2 … s`` between ``step`` and ``accept``; its first is the
    last stage of the accepted step before (or the field re-read after a jump, or ``F(t_0, y_0)``). A fixed step
    is accepted first and its ``s`` stages evaluated after; it is converted once the next step's first stage (its
    end slope) is known."""

    def __init__(self, tab: MethodTableau, jumps: Sequence[float], keep: bool, every: int, convert: Callable):
        carry = tab.adaptive and not tab.fsal and not keep
        super().__init__(jumps, carry=carry)
        self.tab, self.keep, self.every, self.convert = tab, keep, every, convert
        self.first: torch.Tensor | None = None
        self.attempt: list[torch.Tensor] = []
        self.caught: list[list[torch.Tensor]] = []  # the stages of accepted steps not yet converted
        self.coeffs: list[torch.Tensor] = []
        self.carried_flags: list[bool] = []
        self.started = False

    def step(self, t0=None, y0=None, dt=None) -> None:
        super().step(t0, y0, dt)
        self.started = True
        self.attempt = []

    def accept(self, t0, y0, dt) -> None:
        super().accept(t0, y0, dt)
        n = len(self.rows) - 1
        self.carried_flags.append(self.rows[n][4] is not None)
        if self.keep:
            if self.tab.adaptive:
                ks = [self.first, *self.attempt]
                self.first = self.attempt[-1] if self.attempt else None
                if self.tab.dense_stages:  # dopri8's extension needs evaluations of its own: after the solve
                    self.caught.append(ks)  # type: ignore[arg-type]
                else:
                    self.coeffs.append(self.convert(n, ks))
                    self.rows[n][2] = None  # C_0 holds it
            else:  # (cde_nets.odeint's wrapper calls `accept` alone for a fixed step, no `step`)
                self._flush(final=False)
                self.attempt = []
                self.caught.append(self.attempt)  # filled by the stage evaluations that follow
        elif n % self.every:
            self.rows[n][2] = self.rows[n][4] = None  # not a saved point: the state is rebuilt on the way back

    def evaluated(self, out: torch.Tensor | None = None) -> None:
        if self.keep and not self.reading and out is not None:
            if self.tab.adaptive and (self.after_accept or not self.started):
                if self.after_accept or self.first is None:  # a jump's re-read, or F(t_0, y_0)
                    self.first = out
            else:
                self.attempt.append(out)
        super().evaluated(out)

    def _flush(self, final: bool) -> None:
        """Convert the caught fixed steps whose end slope (the next step's first stage) is known; with ``final``,
        the last one too (its end slope evaluated)."""
        done = len(self.coeffs)
        while done < len(self.caught) - (0 if final else 1):
            nxt = self.caught[done + 1][0] if done + 1 < len(self.caught) else None
            self.coeffs.append(self.convert(done, self.caught[done][: self.tab.stages], nxt))
            self.caught[done] = []
            self.rows[done][2] = None  # C_0 holds it
            done += 1


def _polynomial(tab: MethodTableau, weights: list[list[float]], y0: torch.Tensor, h: float, ks) -> torch.Tensor:
    """``(C_0, …, C_d)`` of the dense output ``y_0 + h Σ_i β_i(x) k_i``, ``β_i(x) = Σ_p W[p][i] x^(p+1)``."""
    out = [y0]
    for row in weights:
        c = None
        for w, k in zip(row, ks):
            if w != 0.0:
                c = (w * h) * k if c is None else c + (w * h) * k
        out.append(torch.zeros_like(y0) if c is None else c)
    return torch.stack(out)


def _hermite(tab: MethodTableau, y0: torch.Tensor, h: float, ks, f1: torch.Tensor) -> torch.Tensor:
    """The cubic Hermite ``(C_0, …, C_3)`` of a fixed step: ``y_0, y_1 = y_0 + h Σ b_i k_i``, slopes ``k_1, f_1``."""
    d = None
    for b, k in zip(tab.tableau.b, ks):
        if b != 0.0:
            d = (b * h) * k if d is None else d + (b * h) * k
    assert d is not None
    d0, d1 = h * ks[0], h * f1
    return torch.stack([y0, d0, 3 * d - 2 * d0 - d1, d0 + d1 - 2 * d])


class _Dense:
    """The forward solve's dense output over the steps ``lo … hi − 1``: ``y(t)`` by Horner's rule in ``x``."""

    def __init__(self, t0: Sequence[float], t1: Sequence[float], coeffs: Sequence[torch.Tensor], lo: int = 0):
        self.t0, self.t1, self.coeffs, self.lo = list(t0), list(t1), list(coeffs), lo

    def __call__(self, t: float) -> torch.Tensor:
        n = min(max(bisect.bisect_right(self.t0, t) - 1, 0), len(self.coeffs) - 1)
        x = (t - self.t0[n]) / (self.t1[n] - self.t0[n])
        c = self.coeffs[n]
        y = c[-1]
        for p in range(len(c) - 2, -1, -1):
            y = y * x + c[p]
        return y


class _Rebuilt:
    """The dense output of the checkpointed variant: each saved interval's rebuilt when the backward solve first
    reads a time in it, a few kept (the backward solve moves down in time; a rejected step reads again up to where
    it stands), the highest dropped first."""

    KEEP_STEPS = 16  # the rebuilt steps kept, at least two intervals

    def __init__(self, build: Callable[[int], _Dense], starts: list[float], every: int):
        self.build, self.starts = build, starts
        self.cache: dict[int, _Dense] = {}
        self.keep = max(2, self.KEEP_STEPS // every)

    def __call__(self, t: float) -> torch.Tensor:
        j = min(max(bisect.bisect_right(self.starts, t) - 1, 0), len(self.starts) - 1)
        dense = self.cache.get(j)
        if dense is None:
            dense = self.cache[j] = self.build(j)
            while len(self.cache) > self.keep:
                del self.cache[max(k for k in self.cache if k != j)]
        return dense(t)


class _AdjointField:
    """``(a, g)' = (−aᵀ ∂F/∂y, −aᵀ ∂F/∂θ)`` at ``y = dense(t)``; the field's adjoint callbacks as its own (steps
    counted as the backward solve's, ``max_steps`` enforced)."""

    def __init__(self, func, params: tuple[torch.Tensor, ...], dense: Callable[[float], torch.Tensor]):
        self.func, self.params, self.dense = func, params, dense
        for name in ("callback_step", "callback_accept_step", "callback_reject_step"):
            callback = getattr(func, f"{name}_adjoint", None)
            if callback is not None:
                setattr(self, name, callback)

    def __call__(self, t: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        a = state[0]
        with torch.enable_grad():
            y = self.dense(float(t)).detach().requires_grad_(True)
            f = self.func(t, y)
            wrt = (y, *self.params)
            grads: Sequence[torch.Tensor | None] = (None,) * len(wrt)
            if f.requires_grad:
                grads = torch.autograd.grad(f, wrt, -a, allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads))


def _rms_first(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0].pow(2).mean().sqrt()


class _Interpolating(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: dict, y0: torch.Tensor, t: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        remember_inputs(ctx, y0, *params)
        run: Run = cfg["run"]
        tab: MethodTableau = cfg["tab"]
        every = cfg["every"]
        func, s = run.func, run.solver
        weights = _dense_weights(tab) if tab.adaptive else []
        rec: _StageRecorder

        def convert(n: int, ks, f1: torch.Tensor | None = None) -> torch.Tensor:
            row = rec.rows[n]
            if tab.adaptive:
                return _polynomial(tab, weights, row[2], row[1], ks)
            h = (rec.rows[n + 1][0] if n + 1 < len(rec.rows) else float(t[-1])) - row[0]
            if f1 is None:  # the last step: its end slope is no later step's first stage
                y1 = _polynomial_end(tab, row[2], h, ks)
                f1 = func(torch.tensor(row[0] + h, dtype=y0.dtype, device=y0.device), y1)
            return _hermite(tab, row[2], h, ks, f1)

        rec = _StageRecorder(tab, _times_of(run.options, "jump_t"), every == 0, max(every, 1), convert)
        ys = _solve_recorded(func, y0, t, rec, s.method, s.rtol, s.atol, run.options)
        steps = rec.steps(t, tab.adaptive, bool(run.options.get("perturb", False)))
        if every == 0:
            with torch.no_grad():
                if tab.adaptive and tab.dense_stages:
                    for n, ks in enumerate(rec.caught):
                        rec.coeffs.append(convert(n, _dense_extra(func, tab, steps, n, ks)))
                        rec.caught[n] = []
                elif not tab.adaptive:
                    rec._flush(final=True)
            saved = rec.coeffs
        else:
            saved = [steps.y0[n] for n in range(0, len(steps), every)]
            if steps.carried is not None:
                saved += [steps.carried[n] for n in range(0, len(steps), every)]  # type: ignore[misc]
        ctx.cfg = cfg
        ctx.meta = (steps.t0, steps.t1, steps.dt, steps.first, steps.adaptive, rec.carried_flags, len(steps))
        ctx.n_saved = len(saved)
        # through autograd, so that memory accounting (saved-tensor hooks) sees what is kept
        ctx.save_for_backward(t, *saved, *params)
        return ys

    @staticmethod
    @first_order("interpolating")
    def backward(ctx, grad_ys: torch.Tensor):
        cfg = ctx.cfg
        run: Run = cfg["run"]
        tab: MethodTableau = cfg["tab"]
        every = cfg["every"]
        t0s, t1s, dts, first, adaptive, flags, n_steps = ctx.meta
        saved = ctx.saved_tensors
        t, kept, params = saved[0], saved[1 : 1 + ctx.n_saved], saved[1 + ctx.n_saved :]
        wanted = tuple(p for p, need in zip(params, ctx.needs_input_grad[3:]) if need)
        tl = t.tolist()
        grid = [*t0s, t1s[-1]]
        dense: Callable[[float], torch.Tensor]
        if every == 0:
            dense = _Dense(t0s, t1s, kept)
        else:
            segments = [(a, min(a + every, n_steps)) for a in range(0, n_steps, every)]
            starts = [t0s[a] for a, _ in segments]
            dense = _Rebuilt(lambda j: _rebuild(run, tab, ctx.meta, kept, segments, j), starts, every)
        state = [grad_ys[-1].clone(), *(torch.zeros_like(p) for p in wanted)]
        for i in range(len(tl) - 1, 0, -1):
            state = _solve_back(run, cfg, wanted, dense, state, tl[i], tl[i - 1], grid)
            state[0] = state[0] + grad_ys[i - 1]
        grads = iter(state[1:])
        return (None, state[0], None, *(next(grads) if need else None for need in ctx.needs_input_grad[3:]))


def _polynomial_end(tab: MethodTableau, y0: torch.Tensor, h: float, ks) -> torch.Tensor:
    y1 = y0
    for b, k in zip(tab.tableau.b, ks):
        if b != 0.0:
            y1 = y1 + (b * h) * k
    return y1


def _dense_extra(func, tab: MethodTableau, steps: Steps, n: int, ks: list[torch.Tensor]) -> list[torch.Tensor]:
    """dopri8's dense stages of step ``n`` (``t_n + c h``, ``y_n + h Σ_j a_j k_j``) after its own."""
    ks = list(ks)
    y0, h, t0 = steps.y0[n], steps.dt[n], steps.t0[n]
    for c, row in tab.dense_stages:
        Y = y0
        for a, k in zip(row, ks):
            if a != 0.0:
                Y = Y + (a * h) * k
        ks.append(func(torch.tensor(t0 + c * h, dtype=y0.dtype, device=y0.device), Y))
    return ks


def _rebuild(run: Run, tab: MethodTableau, meta, kept, segments, seg: int) -> _Dense:
    """The dense output of saved interval ``seg``: its recorded steps replayed (no graph) from its saved start."""
    t0s, t1s, dts, first, adaptive, flags, n_steps = meta
    lo, hi = segments[seg]
    n_saved = len(segments)
    y = kept[seg]
    carried = kept[n_saved + seg] if len(kept) > n_saved else None
    steps = Steps(t0s, t1s, dts, [y] * n_steps, first, adaptive)
    weights = _dense_weights(tab) if tab.adaptive else []
    coeffs: list[torch.Tensor] = []
    ends: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    last: torch.Tensor | None = carried
    with torch.no_grad():
        for n in range(lo, hi):
            steps.y0[n] = y
            k_first = last if (flags[n] and last is not None) else None
            _, ks, y1 = _stages(run.func, tab, steps, n, y, dense=adaptive, first=k_first)
            if adaptive:
                coeffs.append(_polynomial(tab, weights, y, dts[n], ks))
            else:
                ends.append((y, ks))
            last = ks[tab.stages - 1] if len(ks) >= tab.stages else None
            y = y1
        if not adaptive:
            for i, (y0, ks) in enumerate(ends):
                n = lo + i
                h = t1s[n] - t0s[n]
                if i + 1 < len(ends):
                    f1 = ends[i + 1][1][0]
                else:
                    f1 = run.func(torch.tensor(t1s[n], dtype=y0.dtype, device=y0.device), y)
                coeffs.append(_hermite(tab, y0, h, ks, f1))
    return _Dense(t0s[lo:hi], t1s[lo:hi], coeffs, lo)


def _solve_back(
    run: Run, cfg: dict, wanted, dense: Callable[[float], torch.Tensor], state, hi: float, lo: float, grid: list[float]
):
    """``(a, g)`` carried from ``hi`` down to ``lo``."""
    method = cfg["back_method"]
    field = _AdjointField(run.func, wanted, dense)
    y = state[0]
    times = torch.tensor([hi, lo], dtype=torch.float64, device=y.device)
    options: dict[str, Any] = {}
    if method in ADAPTIVE_METHODS:
        options["norm"] = _rms_first
        if lo <= grid[0]:
            # land on t_0: before it y(t) is the first step's polynomial extrapolated (module docstring)
            options["step_t"] = torch.tensor([lo], dtype=torch.float64)
        if run.jump_t is not None:
            jumps = [j for j in run.jump_t.tolist() if lo < j < hi]
            if jumps:
                options["jump_t"] = torch.tensor(jumps, dtype=torch.float64)
    else:  # a fixed-step backward solve steps on the forward's grid
        inner = [g for g in reversed(grid) if lo < g < hi]
        pts = torch.tensor([hi, *inner, lo], dtype=torch.float64, device=y.device)
        options["grid_constructor"] = lambda f, y0, s: pts
        # a field that jumps on the grid (piecewise parameters) is read inside each step, as the forward read it
        options["perturb"] = bool(run.options.get("perturb", False))
    out = odeint_rk(
        field,
        tuple(state),
        times,
        rtol=cfg["back_rtol"],
        atol=cfg["back_atol"],
        method=method,
        options=options,
        graph=False,
    )
    return [o[-1] for o in out]
