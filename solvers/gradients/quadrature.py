r"""The quadrature adjoint with Gauss-Legendre quadrature: a backward solve of the adjoint state alone, the
parameter gradient as an integral along it.

For ``y' = F(t, y, θ)`` and a loss ``ℒ(y(t_0), …, y(t_N))``, the adjoint ``a(t) = ∂ℒ/∂y(t)`` solves, backwards
from ``a(t_N) = ∂ℒ/∂y(t_N)`` and jumping by ``∂ℒ/∂y(t_i)`` at each output time,

    ``a' = −aᵀ ∂F/∂y(t, y(t))``,   then   ``∂ℒ/∂y_0 = a(t_0)``,   ``∂ℒ/∂θ = ∫_{t_0}^{t_N} a(t)ᵀ ∂F/∂θ(t, y(t)) dt``

(Pontryagin's adjoint as in Chen et al. 2018, "Neural ordinary differential equations", eqs. 4-5). The augmented
adjoint (:class:`~solvers.gradients.Adjoint`) integrates that last integral as ``P`` more states of the backward solve
and recomputes ``y`` backwards beside ``a``. Here, as in CVODES' adjoint (Serban & Hindmarsh 2005, "CVODES: the
sensitivity-enabled ODE solver in SUNDIALS", §3, the quadrature variables) and SciMLSensitivity's
``QuadratureAdjoint``/``GaussAdjoint`` (Kim et al. 2021, "Stiff neural ordinary differential equations", Chaos 31,
§II), the backward solve carries ``a`` only:

- ``y(t)`` comes from the forward solve's dense output: each accepted forward step keeps its start state and its
  stages (``O(N s |y|)`` memory for ``N`` steps of ``s`` stages) and is read back with the method's own
  interpolant (torchdiffeq's quartic, or the method's continuous extension), the fixed-step methods with the cubic
  Hermite interpolant through both ends and their slopes (Hairer, Nørsett & Wanner, "Solving ODEs I", §II.6);
- after each accepted backward step ``[t_lo, t_hi]`` the integral over that step is taken by the ``m``-point
  Gauss-Legendre rule,

      ``∫_{t_lo}^{t_hi} a(t)ᵀ ∂F/∂θ dt ≈ h Σ_q w_q a(τ_q)ᵀ ∂F/∂θ(τ_q, y(τ_q))``,  ``τ_q = t_hi − x_q h``,

  exact for polynomials of degree ``2m − 1`` (order ``2m``), ``a(τ_q)`` from the backward step's own dense output:
  ``m`` field evaluations and one vector-Jacobian product in ``θ`` per step.

The backward solve's state and error norm are ``a``'s alone, its products ``aᵀ ∂F/∂y`` take no parameter
derivative, so its cost does not grow with the number of parameters ``P`` as the augmented solve's vector field
and (without the seminorm) its error control do; the quadrature's ``m`` products in ``θ`` per step replace the
``s`` of the augmented solve's stages. Its gradient is the continuous one, to the tolerance's reach, not the
discrete map's (use ``"checkpoint"`` for that).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import Reason, SolverError, check_positive, check_positive_int
from ..grids import stepper_options
from ..norms import StateNorm
from ..options import REVERSIBLE_METHODS
from ..steppers.fast_rk import FAST_METHODS, fast_applies, odeint_fast
from ..steppers.tableaux import TABLEAUX, MethodTableau, dense_at
from .base import GradientMethod, Run
from .checkpoint import backwards_in_time
from .replay import combine
from .second_order import first_order, remember_inputs

__all__ = ["Gauss", "gauss_legendre"]


def gauss_legendre(m: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The ``m``-point Gauss-Legendre rule on ``[0, 1]``: nodes ``x_q`` and weights ``w_q`` (``Σ w_q = 1``), exact
    for polynomials of degree ``2m − 1``."""
    xi, w = np.polynomial.legendre.leggauss(m)
    return tuple(float(v) for v in (xi + 1) / 2), tuple(float(v) for v in w / 2)


@dataclass(frozen=True, repr=False)
class Gauss(GradientMethod):
    """The quadrature adjoint (module docstring): the backward solve carries the adjoint state alone, ``y(t)`` is
    read off the forward solve's stored dense output, and ``∂ℒ/∂θ`` is accumulated per backward step by
    Gauss-Legendre quadrature.

    ``nodes``: the points ``m`` of the rule (order ``2m``); default ``⌈p/2⌉`` for a method of order ``p``, so
    that the quadrature is as accurate as the steps. ``rtol``, ``atol``: the backward solve's tolerances (default:
    the forward's); a fixed-step method steps back over the forward's grid. Memory: the forward's steps and their
    stages, ``N s |y|``; time: per backward step ``s`` products ``aᵀ ∂F/∂y`` and ``m`` products ``aᵀ ∂F/∂θ``.

    Serves the explicit Runge-Kutta methods of the library's stepper (:data:`~solvers.steppers.fast_rk.FAST_METHODS`)
    on real float32/float64 states; the implicit, composition and ``alf`` methods, the Adams methods and
    ``scipy_solver`` are refused by name. It does not differentiate the output times ``t``.
    """

    nodes: int | None = None
    rtol: float | None = None
    atol: float | None = None

    name = "gauss"

    def __post_init__(self) -> None:
        if self.nodes is not None:
            check_positive_int("nodes", self.nodes, "the points of the Gauss-Legendre rule")
        if self.rtol is not None:
            object.__setattr__(self, "rtol", check_positive("rtol", self.rtol))
        if self.atol is not None:
            object.__setattr__(self, "atol", check_positive("atol", self.atol))

    def supports(self, method: str) -> bool:
        return method in FAST_METHODS

    def refusal(self, method: str) -> str:
        if method in REVERSIBLE_METHODS:
            return super().refusal(method)
        return (
            f"gradient='gauss' reads the forward solve's dense output from the stages of the library's explicit "
            f"Runge-Kutta stepper; method={method!r} does not run on it. Use one of {sorted(FAST_METHODS)}, or "
            f"gradient='adjoint'/'checkpoint'/'backprop' with {method!r}."
        )

    def rule(self, method: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The quadrature used with ``method``: ``nodes`` points, or ``⌈p/2⌉`` for its order ``p``."""
        m = self.nodes if self.nodes is not None else max(1, math.ceil(TABLEAUX[method].order / 2))
        return gauss_legendre(m)

    def solve(self, run: Run) -> torch.Tensor:
        # where the field may jump (declared jumps, piece boundaries), in the solve's own time
        breaks = {float(j) for j in ([] if run.jump_t is None else run.jump_t.reshape(-1).tolist())}
        breaks |= {float(b) for p in run.pieces for b in p.boundaries}
        if len(run.t) > 1 and float(run.t[0]) > float(run.t[-1]):
            run = backwards_in_time(run)
            breaks = {-b for b in breaks}
        s = run.solver
        options = stepper_options(run.options)
        if run.y0.is_complex() or not fast_applies(s.method, True, run.y0, run.t.detach(), (), options):
            raise ValueError(
                f"gradient='gauss' records the steps of the library's own stepper, which does not take this call "
                f"(method={s.method!r}, a {run.y0.dtype} state, options {sorted(options)}): use a real "
                "float32/float64 state and torchdiffeq's step options, or gradient='adjoint'."
            )
        params = tuple({id(p): p for p in run.params if p.requires_grad}.values())
        cfg = dict(
            run=run,
            options=options,
            gradient=self,
            rtol=s.rtol if self.rtol is None else self.rtol,
            atol=s.atol if self.atol is None else self.atol,
            rule=self.rule(s.method),
            breaks=None if options.get("perturb") else tuple(sorted(breaks)),
        )
        return _GaussAdjoint.apply(cfg, run.y0, *params)


class _Log:
    """The accepted steps of one solve and their stages, from the stepper's callbacks and evaluations (the
    protocol of :class:`solvers.gradients.replay.Recorder`: ``step``, ``accept``, ``reject``, ``evaluated``,
    ``reading``). An adaptive step's first stage is the slope carried from the step before (the solve's first
    evaluation, else the last stage of the accepted step before, or the field re-read after a jump); its other
    stages are the attempt's evaluations. A fixed step's stages are the ``s`` evaluations after its callback."""

    def __init__(self, tab: MethodTableau) -> None:
        self.s, self.adaptive = tab.stages, tab.adaptive
        self.t0: list[float] = []
        self.dt: list[float] = []
        self.y0: list[torch.Tensor] = []
        self.ks: list[list[torch.Tensor]] = []
        self.reading = False  # set while the stepper evaluates a dense output's own stages: no step's
        self._first: torch.Tensor | None = None
        self._attempt: list[torch.Tensor] = []
        self._started = self._after_accept = False

    def step(self, t0: Any = None, y0: Any = None, dt: Any = None) -> None:
        if self.adaptive:
            self._attempt, self._started, self._after_accept = [], True, False

    def accept(self, t0: Any, y0: torch.Tensor, dt: Any) -> None:
        self.t0.append(_f(t0))
        self.dt.append(_f(dt))
        self.y0.append(y0)
        if self.adaptive:
            assert self._first is not None and len(self._attempt) == self.s - 1
            self.ks.append([self._first, *self._attempt])
            self._first, self._after_accept = self._attempt[-1], True
        else:
            self.ks.append([])

    def reject(self, t0: Any = None, y0: Any = None, dt: Any = None) -> None:
        pass

    def evaluated(self, out: torch.Tensor | None = None) -> None:
        if self.reading or out is None:
            return
        if not self.adaptive:
            if self.ks and len(self.ks[-1]) < self.s:
                self.ks[-1].append(out)
        elif not self._started:
            if self._first is None:  # the solve's first evaluation; the initial step size's probe comes next
                self._first = out
        elif self._after_accept:  # the field re-read on a jump's far side: the next step's first stage
            self._first = out
        else:
            self._attempt.append(out)


def _f(x: Any) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def _quartic_coefficients(tab: MethodTableau, y0, y1, ks, h: float) -> tuple[torch.Tensor, ...]:
    """``(a_4, b_3, c_2, d)`` of torchdiffeq's quartic ``y_0 + x(d + x(c_2 + x(b_3 + x a_4)))``
    (:func:`~solvers.steppers.butcher.quartic`, whose fit this is): through ``y_0``, ``y_{1/2}``, ``y_1`` with the end
    slopes ``h k_1``, ``h k_s``."""
    ymid = combine(y0, tab.mid or (), ks, h)
    d, end = h * ks[0], h * ks[-1]
    r1, r2, r3 = y1 - y0 - d, end - d, ymid - y0 - 0.5 * d
    a4 = 2 * r2 - 8 * r1 + 16 * r3
    b3 = r2 - 2 * r1 - 2 * a4
    return a4, b3, r1 - b3 - a4, d


class _Dense:
    """The dense output of a logged solve: each step's interpolant from its start state and stages.

    ``slope(τ, z)``: the solve's vector field, for the stages a continuous extension adds (dopri8's) and for the
    end slope of a fixed-step method's Hermite interpolant where no later step holds it: after the last step, and
    at ``breaks``, the times where the field may jump (the next step's first slope is read on the far side; ``None``:
    at every step's end, as with ``options["perturb"]``). ``t_end``: where the last step ends (a fixed grid's last
    point), else ``t_0 + dt``."""

    def __init__(
        self, tab: MethodTableau, log: _Log, slope: Callable, t_end: float | None = None, breaks: Any = ()
    ) -> None:
        self.tab, self.log, self.slope = tab, log, slope
        self.breaks = breaks
        n = len(log.t0)
        last = log.t0[-1] + log.dt[-1] if t_end is None else t_end
        self.t1 = [*log.t0[1:], last]
        self._cache: dict[tuple[int, str], Any] = {}
        self._n = n

    def __len__(self) -> int:
        return self._n

    def index(self, t: float) -> int:
        return min(max(bisect.bisect_right(self.log.t0, t) - 1, 0), self._n - 1)

    def end(self, n: int) -> torch.Tensor:
        """Step ``n``'s end state (the next step's start where there is one)."""
        if n + 1 < self._n:
            return self.log.y0[n + 1]
        log = self.log
        return self._memo(n, "end", lambda: combine(log.y0[n], self.tab.tableau.b, log.ks[n], log.dt[n]))

    def at(self, t: float) -> torch.Tensor:
        n = self.index(t)
        return self.within(n, (t - self.log.t0[n]) / self.log.dt[n])

    def within(self, n: int, x: float) -> torch.Tensor:
        """The interpolant of step ``n`` at ``t_0 + x h``."""
        tab, y0, ks, h = self.tab, self.log.y0[n], self.log.ks[n], self.log.dt[n]
        if tab.dense is not None:  # the method's own continuous extension (tsit5; dopri8 with its extra stages)
            return combine(y0, dense_at(tab, x), [*ks, *self._extra(n)], h)
        y1 = self.end(n)
        if tab.mid is not None:  # torchdiffeq's quartic through the midpoint, its coefficients fitted once a step
            a4, b3, c2, d = self._memo(n, "quartic", lambda: _quartic_coefficients(tab, y0, y1, ks, h))
            return y0 + x * (d + x * (c2 + x * (b3 + x * a4)))
        # a fixed-step method: the cubic Hermite interpolant of both ends and their slopes
        if n + 1 < self._n and not self._jumps_at(self.t1[n]):
            f1 = self.log.ks[n + 1][0]
        else:  # read just inside the step
            f1 = self._memo(n, "f1", lambda: self.slope(math.nextafter(self.t1[n], -math.inf), y1))
        x1 = 1 - x
        return (1 + 2 * x) * x1 * x1 * y0 + x * x1 * x1 * h * ks[0] + x * x * (3 - 2 * x) * y1 - x * x * x1 * h * f1

    def _jumps_at(self, t: float) -> bool:
        return self.breaks is None or any(abs(t - b) <= 1e-12 * (1 + abs(b)) for b in self.breaks)

    def _extra(self, n: int) -> list[torch.Tensor]:
        if not self.tab.dense_stages:
            return []

        def evaluate() -> list[torch.Tensor]:
            t0, h, y0, ks = self.log.t0[n], self.log.dt[n], self.log.y0[n], list(self.log.ks[n])
            for c, row in self.tab.dense_stages:
                ks.append(self.slope(t0 + c * h, combine(y0, row, ks, h)))
            return ks[self.tab.stages :]

        return self._memo(n, "extra", evaluate)

    def _memo(self, n: int, what: str, make: Callable[[], Any]) -> Any:
        # the backward pass reads the steps from the last to the first, a backward step's stages (not in order of
        # time for dopri8) a few forward steps at a time: keep the latest few dozen
        key = (n, what)
        if key not in self._cache:
            if len(self._cache) >= 32:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = make()
        return self._cache[key]


class _Logged:
    """``field`` as the stepper calls it, its evaluations and step callbacks logged (``recorder``: also what makes
    the stepper keep every state fresh, and where it flags a dense output's own stages). The callbacks are passed
    on to ``owner``'s ``callback_*`` + ``suffix`` (the statistics' steps and the step budget)."""

    def __init__(self, field: Callable, log: _Log, owner: Any, suffix: str = "") -> None:
        self.field, self.recorder = field, log
        mine = (
            ("callback_step", log.step if log.adaptive else log.accept),  # a fixed step's stages follow its callback
            ("callback_accept_step", log.accept),
            ("callback_reject_step", log.reject),
        )
        for name, own in mine:
            setattr(self, name, _both(getattr(owner, name + suffix, None), own))

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.field(t, y)
        self.recorder.evaluated(out)
        return out


def _both(theirs: Callable | None, own: Callable) -> Callable[..., None]:
    def callback(t0: Any, y0: torch.Tensor, dt: Any) -> None:
        if theirs is not None:
            theirs(t0, y0, dt)
        own(t0, y0, dt)

    return callback


class _AdjointField:
    """The adjoint ODE in the time ``s = −t`` (the backward solve runs forwards in ``s``):
    ``da/ds = (∂F/∂y(−s, y(−s)))ᵀ a``, ``y`` from the forward's dense output."""

    def __init__(self, func: Any, forward: _Dense) -> None:
        self.func, self.forward = func, forward

    def __call__(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.vjp(-_f(s), a, -s)

    def vjp(self, t: float, a: torch.Tensor, t_tensor: torch.Tensor | None = None) -> torch.Tensor:
        """``(∂F/∂y(t, y(t)))ᵀ a``, no parameter derivative taken."""
        y = self.forward.at(t)
        tt = torch.tensor(t, dtype=a.dtype, device=a.device) if t_tensor is None else t_tensor.to(a.dtype)
        with torch.enable_grad():
            y = y.detach().requires_grad_()
            f = self.func(tt, y)
            if not f.requires_grad:
                return torch.zeros_like(a)
            (g,) = torch.autograd.grad(f, y, a, allow_unused=True)
        return torch.zeros_like(a) if g is None else g


def _record(run: Run, options: dict, tab: MethodTableau) -> tuple[torch.Tensor, _Log]:
    """The forward solve without a graph, its accepted steps and stages logged."""
    s, log = run.solver, _Log(tab)
    func = _Logged(run.func, log, run.func)
    with torch.no_grad():
        ys = odeint_fast(func, run.y0, run.t, method=s.method, rtol=s.rtol, atol=s.atol, options=options)
    return ys, log


def _backward_options(options: dict, tab: MethodTableau, grid: list[float], lo: float, hi: float) -> dict:
    """The backward solve's options on ``[lo, hi]`` in ``s = −t``: an adaptive method lands on the negated jumps
    (and measures ``a`` with the forward's tuple norm); a fixed-step one steps over the forward's grid."""
    if tab.adaptive:
        out: dict[str, Any] = {}
        jumps = options.get("jump_t")
        if jumps is not None:
            out["jump_t"] = -torch.as_tensor(jumps, dtype=torch.float64).reshape(-1).flip(0)
        if isinstance(options.get("norm"), StateNorm):
            out["norm"] = options["norm"]
        return out
    inner = [g for g in grid if lo < g < hi]
    points = torch.tensor([-hi, *(-g for g in reversed(inner)), -lo], dtype=torch.float64)
    return {"grid_constructor": lambda f, y0, t: points, "perturb": bool(options.get("perturb", False))}


class _GaussAdjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cfg: dict, y0: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        remember_inputs(ctx, y0, *params)
        run: Run = cfg["run"]
        tab = TABLEAUX[run.method]
        ys, log = _record(run, cfg["options"], tab)
        ctx.cfg, ctx.meta = cfg, (log.t0, log.dt, [len(k) for k in log.ks])
        # saved through autograd, so that memory accounting (saved-tensor hooks) sees the dense output
        ctx.save_for_backward(*log.y0, *(k for ks in log.ks for k in ks), *params)
        ctx.n_params = len(params)
        return ys

    @staticmethod
    @first_order("gauss")
    def backward(ctx: Any, grad_ys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cfg = ctx.cfg
        run: Run = cfg["run"]
        tab = TABLEAUX[run.method]
        t0s, dts, counts = ctx.meta
        saved = list(ctx.saved_tensors)
        params = tuple(saved[len(saved) - ctx.n_params :]) if ctx.n_params else ()
        log = _Log(tab)
        log.t0, log.dt, log.y0 = t0s, dts, saved[: len(t0s)]
        it = iter(saved[len(t0s) :])
        log.ks = [[next(it) for _ in range(c)] for c in counts]
        func, t = run.func, run.t.detach().tolist()

        def field(tau: float, y: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return func(torch.tensor(tau, dtype=y.dtype, device=y.device), y)

        breaks = cfg["breaks"]
        forward = _Dense(tab, log, field, None if tab.adaptive else t[-1], breaks)
        grid = [*t0s, forward.t1[-1]]
        xs, ws = cfg["rule"]
        grads = [torch.zeros_like(p) for p in params]
        a = grad_ys[-1]
        for i in range(len(t) - 1, 0, -1):
            if t[i] > t[i - 1]:
                a = _interval(cfg, tab, forward, grid, a, t[i - 1], t[i], params, grads, xs, ws)
            a = a + grad_ys[i - 1]
        if not bool(torch.isfinite(a).all()):
            nfe = run.stats.nfe_backward
            raise SolverError(
                f"the gradient became non-finite (NaN/inf) in gradient='gauss''s backward solve after {nfe} field "
                "evaluations; lower the learning rate, check the loss, or tighten the backward tolerances.",
                nfe=nfe,
                reason=Reason.NONFINITE_GRADIENT,
            )
        return (None, a, *grads)


def _interval(cfg, tab, forward: _Dense, grid, a, lo: float, hi: float, params, grads, xs, ws) -> torch.Tensor:
    """``a`` carried from ``hi`` back to ``lo``, the quadrature of each backward step added to ``grads``."""
    run: Run = cfg["run"]
    log = _Log(tab)
    adj = _AdjointField(run.func, forward)
    span = torch.tensor([-hi, -lo], dtype=torch.float64)
    opts = _backward_options(cfg["options"], tab, grid, lo, hi)
    logged = _Logged(adj, log, run.func, "_adjoint")
    out = odeint_fast(logged, a, span, method=run.method, rtol=cfg["rtol"], atol=cfg["atol"], options=opts, graph=False)
    if not params:
        return out[-1]
    breaks = None if cfg["breaks"] is None else tuple(-b for b in cfg["breaks"])
    back = _Dense(tab, log, lambda s, z: adj.vjp(-s, z), None if tab.adaptive else -lo, breaks)
    for n in range(len(back) - 1, -1, -1):
        # an adaptive solve's last step may pass the interval's end (the output is read off its dense output):
        # only the part up to the end is integrated
        s0, h = log.t0[n], log.dt[n]
        span_n = min(h, -lo - s0)
        if not span_n > 0:
            continue
        outs, cots = [], []
        with torch.enable_grad():
            for x, w in zip(xs, ws):
                tau = -(s0 + x * span_n)
                y = forward.at(tau).detach()
                outs.append(run.func(torch.tensor(tau, dtype=y.dtype, device=y.device), y))
                cots.append((w * span_n) * back.within(n, x * span_n / h))
            pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
            if pairs:
                got = torch.autograd.grad([o for o, _ in pairs], params, [c for _, c in pairs], allow_unused=True)
                for g, d in zip(grads, got):
                    if d is not None:
                        g += d
    return out[-1]
