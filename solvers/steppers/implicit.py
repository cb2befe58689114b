r"""Implicit Runge-Kutta steps, batched per sample, with gradients by the implicit function theorem.

One step of the tableau ``(A, b, c)`` (:mod:`solvers.steppers.implicit_tableaux`) from ``y_0`` at ``t_0`` solves

    ``G(Z) = Z − h (A ⊗ I) F(Y) = 0``,   ``Y_i = y_0 + Z_i``,   ``F(Y)_i = F(t_0 + c_i h, Y_i)``,

and returns ``y_1 = y_0 + h Σ_i b_i F(Y_i)`` (Hairer & Wanner 1996, §IV.8).

Newton. The stage equations are solved for every sample of the batch at once, each sample with its own
``n × n`` Jacobian ``J = ∂F/∂y`` (rows of a batch are independent, as for every cde_nets field; a module that
mixes samples, e.g. batch norm, needs ``Newton("fixed_point")``, whose backward uses exact vector-Jacobian products
instead of per-sample Jacobians). ``Newton("simplified")`` factors
``M = I − h A ⊗ J(t_0, y_0)`` and iterates ``Z ← Z − M^{−1} G(Z)`` (HW 1996, eq. IV.8.10); along a chain of steps
the factored ``M`` is reused while the iteration contracts at ``θ ≤ 0.05`` and re-evaluated at the step that sees
it contract slower (:class:`~solvers.steppers.implicit_linear.Carry`, HW 1996, §IV.8);
``Newton("full")`` rebuilds ``M = I − h (A ⊗ I) diag(J(Y_j))`` every iteration (for stiff fields whose Jacobian
changes within a step); ``Newton("fixed_point")`` iterates ``Z ← h (A ⊗ I) F(y_0 + Z)`` without a Jacobian (on the
stage derivatives: one field call and one fused product per iteration), which contracts at the rate
``θ ≈ h ‖A‖ ‖∂F/∂y‖`` (HW 1996, §IV.8). ``Newton("auto")`` (default) runs the fixed point
while it contracts at the observed ``θ < 1/4`` in every sample (no Jacobian, no factorisation: the cheapest for a
non-stiff field) and otherwise restarts the step with simplified Newton; the gradient uses the linear solve of
the kind that converged. The first iterate is ``Z_i = h c_i F(t_0, y_0)``. Where the field is the same at every
stage time of a step (a piecewise-constant or autonomous field, see :func:`implicit_step`), the ``s`` stages are
evaluated in one call on ``s B`` rows.

Stopping rule: sample ``b`` has converged when its increment ``‖ΔZ_b‖_∞ ≤ tol_b``, with
``tol_b = 4 ε max(‖y_b‖_∞, ‖Z_b‖_∞)`` (``ε``: the dtype's machine epsilon, i.e. to rounding) unless
``Newton(tol=...)`` gives an absolute tolerance; or when the estimated remaining error ``θ/(1 − θ) ‖ΔZ_k‖``, with
the observed rate ``θ = ‖ΔZ_k‖ / ‖ΔZ_{k−1}‖ < 1/2``, is below ``tol_b`` (HW 1996, eq. IV.8.13); or when the
contraction has stopped (``θ ≥ 1/2``) within ``1000 tol_b``: the iteration sits on the rounding floor of ``G``. The
step is accepted once every sample has; after ``max_iters`` iterations, or on a non-finite iterate,
:class:`ImplicitSolveError` names the iteration count, the largest increment and the fix. The test costs a host
read, so it is made only where it may pass: after two checked iterations give ``θ``, the next check is the
iteration before the one at which ``θ/(1 − θ) θ^j ‖ΔZ‖`` reaches ``tol`` (with ``θ`` over the ``j`` unchecked
iterations in between, ``θ = (‖ΔZ_k‖ / ‖ΔZ_{k−j}‖)^{1/j}``); a fixed point that continues a chain of steps checks
first one iteration before the previous step converged, and judges that increment by the previous step's rate
(HW 1996, §IV.8).

Gradients. The converged stages are a function ``Z(y_0, θ)`` defined implicitly by ``G = 0``; differentiating
``G`` (implicit function theorem) gives, for the cotangent ``g`` of ``y_1``, the cotangent ``v`` of the stage
derivatives ``F(Y_j)`` as the solution of one linear system with the transposed stage Jacobian

    ``v_j − h Σ_i a_ij J(Y_i)ᵀ v_i = h b_j g``,

and then ``∂L/∂y_0 = g + Σ_j J(Y_j)ᵀ v_j``, ``∂L/∂θ = Σ_j (∂F(Y_j)/∂θ)ᵀ v_j``. In code, the stage derivatives are
evaluated once more at the converged stages with the stages held fixed (so their graph carries only the partial
derivatives in ``y_0`` and ``θ``), and :class:`_StageSensitivity` replaces their incoming cotangent by ``v``:
autograd never sees the Newton iterations, and what a step saves for backward (the converged stages and one graph
of ``s`` evaluations) does not depend on how many iterations it took. Any tensor the field closes over (its
parameters, a block input ``u``) receives its gradient the ordinary way.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import Reason, SolverError
from ..gradients.second_order import IMPLICIT_FIX, first_order, remember_inputs
from .implicit_linear import REUSE_MAX_RATE, Carry, Iteration, SingularMatrix, kron_matrix
from .implicit_tableaux import IMPLICIT_TABLEAUX, ImplicitTableau

__all__ = [
    "Newton",
    "ImplicitSolveError",
    "implicit_step",
    "stage_jacobian",
    "get_tableau",
    "in_backward",
    "solve_stages",
    "transposed_stage_solve",
    "FlatField",
    "KINDS",
]

_phase = threading.local()
KINDS = ("auto", "simplified", "full", "fixed_point")
_AUTO_MAX_RATE = 0.25  # "auto" leaves the fixed point when it contracts slower than this


def in_backward() -> bool:
    """Whether a step's backward (the stage Jacobians of :class:`_StageSensitivity`) is evaluating the field now:
    evaluation counters book those evaluations as backward ones."""
    return getattr(_phase, "backward", False)


@dataclass(frozen=True)
class Newton:
    """How the stage equations are solved: ``kind`` ``"auto"`` (the fixed point while it contracts fast, else
    simplified Newton), ``"simplified"`` (Newton, one Jacobian per step), ``"full"`` (Newton, one Jacobian per
    iteration and stage) or ``"fixed_point"`` (Jacobian-free: ``Z ← h (A ⊗ I) F(y + Z)`` forward and the same
    iteration on the transposed system backward; converges when ``h ‖A‖ ‖∂F/∂y‖ < 1``, so for non-stiff fields, at
    a cost that does not grow with ``n³``); at most ``max_iters`` iterations; ``tol`` an absolute tolerance on the
    increment (default ``None``: to rounding, see :mod:`solvers.steppers.implicit`)."""

    kind: str = "auto"
    max_iters: int = 50
    tol: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"`Newton(kind=...)` must be one of {KINDS}, got {self.kind!r}.")
        if isinstance(self.max_iters, bool) or not isinstance(self.max_iters, int) or self.max_iters < 1:
            raise ValueError(f"`Newton(max_iters=...)` must be a positive integer, got {self.max_iters!r}.")
        if self.tol is not None and not (isinstance(self.tol, (int, float)) and self.tol > 0):
            raise ValueError(f"`Newton(tol=...)` must be a number > 0 or None (to rounding), got {self.tol!r}.")


class ImplicitSolveError(SolverError):
    """The stage equations of an implicit step did not converge. ``reason`` is ``Reason.NEWTON_DIVERGED``,
    ``Reason.NEWTON_MAX_ITERS`` or ``Reason.NEWTON_SINGULAR`` (a Newton matrix without inverse); ``iterations`` and
    ``residual`` (the largest last increment) say how far it got."""

    def __init__(self, message: str, reason: Reason, iterations: int, residual: float, nfe: int | None = None):
        super().__init__(message, nfe=nfe, reason=reason)
        self.iterations = iterations
        self.residual = residual


def get_tableau(method: str | ImplicitTableau) -> ImplicitTableau:
    """The tableau of an implicit method name (or the tableau itself); a named error for an unknown name."""
    if isinstance(method, ImplicitTableau):
        return method
    if method not in IMPLICIT_TABLEAUX:
        raise ValueError(f"unknown implicit method {method!r}; valid: {', '.join(IMPLICIT_TABLEAUX)}.")
    return IMPLICIT_TABLEAUX[method]


def stage_jacobian(fun: Any, t: float, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F, J)``: ``F = fun(t, y)`` ``(B, n)`` and each sample's Jacobian ``J[b] = ∂F[b]/∂y[b]`` ``(B, n, n)``, from
    ``n`` batched vector-Jacobian products of one evaluation (rows of the batch are independent)."""
    B, n = y.shape
    with torch.enable_grad():
        x = y.detach().requires_grad_(True)
        F = fun(t, x)
        if not F.requires_grad:  # a field that does not depend on y
            return F.detach(), torch.zeros(B, n, n, dtype=y.dtype, device=y.device)
        eye = torch.eye(n, dtype=y.dtype, device=y.device).unsqueeze(1).expand(n, B, n)
        try:
            (jac,) = torch.autograd.grad(F, x, eye, is_grads_batched=True, allow_unused=True)
        except RuntimeError:
            # an operation without a batching rule (or a backward with data-dependent control flow, as the
            # fixed-point solve of an implicit step): one product per output coordinate, on a fresh graph since
            # the failed attempt may have freed part of the first
            F = fun(t, x)
            rows = [torch.autograd.grad(F, x, eye[k], retain_graph=True, allow_unused=True)[0] for k in range(n)]
            jac = None if rows[0] is None else torch.stack(rows)
    if jac is None:
        return F.detach(), torch.zeros(B, n, n, dtype=y.dtype, device=y.device)
    return F.detach(), jac.transpose(0, 1)


class _StageFun:
    """``F`` at the stages ``Y_i`` ``(s, B, n)``: ``s`` calls at the stage times, or, when ``batched`` (the
    field is the same at every stage time of the step and treats rows independently), one call on ``s B`` rows
    at ``times[0]``, booked as ``s`` evaluations (``fun.count(k)``, where ``fun`` counts)."""

    def __init__(self, fun: Any, times: list[float], batched: bool):
        self.fun, self.times, self.batched = fun, times, batched
        self.count = getattr(fun, "count", None) if batched and len(times) > 1 else None

    def __call__(self, Y: torch.Tensor) -> torch.Tensor:
        if not self.batched:
            return torch.stack([self.fun(ti, Yi) for ti, Yi in zip(self.times, Y)])
        s, B, n = Y.shape
        F = self.fun(self.times[0], Y.reshape(s * B, n)).reshape(s, B, n)
        if self.count is not None:
            self.count(s - 1)
        return F

    def jacobians(self, Y: torch.Tensor) -> torch.Tensor:
        """Each stage's per-sample Jacobians ``(s, B, n, n)`` at the stages ``Y`` ``(s, B, n)``."""
        if not self.batched:
            return torch.stack([stage_jacobian(self.fun, ti, Yi)[1] for ti, Yi in zip(self.times, Y)])
        s, B, n = Y.shape
        J = stage_jacobian(self.fun, self.times[0], Y.reshape(s * B, n))[1]
        _count(self.fun, s - 1)
        return J.reshape(s, B, n, n)


def _count(fun: Any, k: int) -> None:
    count = getattr(fun, "count", None)
    if count is not None and k:
        count(k)


_Coefficients = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
_COEFFS: dict[tuple, _Coefficients] = {}


def coefficients(tab: ImplicitTableau, like: torch.Tensor) -> _Coefficients:
    """``(A, b, c, d)`` of ``tab`` as tensors of ``like``'s dtype and device (``d``: :func:`_output_weights`,
    ``None`` where ``A`` is singular and not stiffly accurate), made once per tableau, dtype and device."""
    key = (tab, like.dtype, like.device)
    if key not in _COEFFS:
        d = _output_weights(tab)
        A, b, c = (torch.tensor(v, dtype=like.dtype, device=like.device) for v in (tab.a, tab.b, tab.c))
        _COEFFS[key] = (A, b, c, None if d is None else torch.tensor(d, dtype=like.dtype, device=like.device))
    return _COEFFS[key]


def solve_stages(
    fun: Any,
    t0: float,
    times: list[float],
    y: torch.Tensor,
    h: float,
    tab: ImplicitTableau,
    newton: Newton,
    batched: bool = False,
    guess: torch.Tensor | None = None,
    carry: Carry | None = None,
) -> tuple[torch.Tensor, int, str]:
    """The converged stage increments ``Z`` ``(s, B, n)`` of one step (no graph), the iteration count, and the
    kind of iteration that converged (``"auto"`` resolves to ``"fixed_point"`` or ``"simplified"``). ``guess``: the
    first iterate (:mod:`solvers.steppers.implicit_predictor`) instead of ``Z_i = h c_i F(t_0, y_0)`` (a restart with
    simplified Newton after a failed fixed point takes the latter). ``carry``: what the previous step of a chain
    hands on (:class:`~solvers.steppers.implicit_linear.Carry`: simplified Newton's matrix, where iterations converged),
    used and updated here."""
    try:
        return _solve_stages(fun, t0, times, y, h, tab, newton, batched, guess, carry)
    except SingularMatrix as exc:
        raise ImplicitSolveError(
            f"the Newton matrix I − h A ⊗ J of the implicit step at t={t0:.6g} (h={h:.3g}) is singular in "
            f"sample(s) {exc.samples[:8]}: Newton cannot iterate, and the stage equations may have no solution at "
            "this step size. Take smaller steps (`step_size`, or more layers in discrete mode), or use another "
            "method.",
            Reason.NEWTON_SINGULAR,
            0,
            math.inf,
        ) from None


def _solve_stages(
    fun: Any,
    t0: float,
    times: list[float],
    y: torch.Tensor,
    h: float,
    tab: ImplicitTableau,
    newton: Newton,
    batched: bool,
    guess: torch.Tensor | None,
    carry: Carry | None,
) -> tuple[torch.Tensor, int, str]:
    ev = _StageFun(fun, times, batched)
    A, _, c, _ = coefficients(tab, y)
    hA, iters, carry = h * A, 0, Carry() if carry is None else carry

    def run(kind: str, it: Iteration | None, judge: float | None, F0: torch.Tensor | None = None) -> _Run:
        Z = guess if guess is not None else (h * c).view(-1, 1, 1) * (fun(t0, y) if F0 is None else F0)
        out = _iterate(ev, y, Z, hA, it, newton, judge, kind == "full", *carry.first_check(kind))
        if out.status == "converged":
            carry.converged(kind, out.k, out.rate)
        return out

    if newton.kind in ("auto", "fixed_point"):
        out = run("fixed_point", None, _AUTO_MAX_RATE if newton.kind == "auto" else None)
        if out.status == "converged" or newton.kind == "fixed_point":
            return out.result(t0, h, 0, "fixed_point")
        iters, guess = out.k, None  # too slow or diverging for a fixed point: restart the step with Newton
    if newton.kind == "full":
        return run("full", Iteration(tab, A, h), None).result(t0, h, iters, "full")
    kept = carry.reusable(tab, y, h)
    if kept is not None:  # an earlier step's matrix, while it contracts fast; else re-evaluated at this step
        out = run("simplified", kept, REUSE_MAX_RATE)
        if out.status == "converged":
            carry.keep(tab, y, h, kept, out.rate)
            return out.result(t0, h, iters, "simplified")
        iters, guess = iters + out.k, out.Z if out.status == "slow" else guess  # continue from where it got
    F0, J0 = stage_jacobian(fun, t0, y)
    it = Iteration(tab, A, h).factor(J0)
    out = run("simplified", it, None, F0)
    if out.status == "converged":
        carry.keep(tab, y, h, it, out.rate)
    return out.result(t0, h, iters, "simplified")


_FLOOR = 1000.0  # increments within this many tolerances may be the rounding noise of G: no rate is judged there


@dataclass
class _Run:
    """One run of the stage iteration: the last iterate, its iteration count, ``status`` (``"converged"``,
    ``"slow"``: contracting slower than asked, ``"diverged"``: non-finite, ``"max_iters"``), the largest rate
    observed above the rounding floor, and the last increment and tolerance (for the error message)."""

    Z: torch.Tensor
    k: int
    status: str
    rate: float
    increment: float
    tol: float

    def result(self, t0: float, h: float, before: int, kind: str) -> tuple[torch.Tensor, int, str]:
        """``(Z, iterations, kind)``, or the named error of a run that did not converge."""
        if self.status == "converged":
            return self.Z, before + self.k, kind
        where = f"the Newton iteration of an implicit step at t={t0:.6g} (h={h:.3g})"
        if self.status == "diverged":
            raise ImplicitSolveError(
                f"{where} went non-finite after {self.k} iteration(s); take smaller steps (`step_size`), use "
                "Newton('full'), or float64.",
                Reason.NEWTON_DIVERGED,
                self.k,
                float("inf"),
            )
        raise ImplicitSolveError(
            f"{where} did not converge in {self.k} iterations (largest increment {self.increment:.3g}, tolerance "
            f"{self.tol:.3g}); take smaller steps (`step_size`), raise Newton(max_iters=...), or use "
            "Newton('full') for a stiff field (Newton('simplified') instead of 'fixed_point').",
            Reason.NEWTON_MAX_ITERS,
            self.k,
            self.increment,
        )


def _iterate(
    ev: _StageFun,
    y: torch.Tensor,
    Z: torch.Tensor,
    hA: torch.Tensor,
    it: Iteration | None,
    newton: Newton,
    judge: float | None,
    full: bool = False,
    check: int = 1,
    rate0: float = 0.0,
) -> _Run:
    """Iterate ``Z ← h (A ⊗ I) F(y + Z)`` (``it`` ``None``: the fixed point) or ``Z ← Z − M^{−1} G(Z)`` (Newton;
    ``full``: ``M`` re-factored at every iterate) to the stopping rule of :mod:`solvers.steppers.implicit`. ``judge``:
    stop with ``"slow"`` once the observed rate exceeds it above the rounding floor. ``check``: the first iteration
    whose increment is checked, ``rate0`` (if positive) the rate that judges it; after it, an iteration is checked (one
    host read) only where the rate observed so far does not already say that it cannot have converged."""
    s, B, n = Z.shape
    scale, last, k_last, rate, K_prev = None, None, 0, 0.0, None
    y_row, Y, check = y.reshape(1, -1), y + Z, min(check, newton.max_iters)
    for k in range(1, newton.max_iters + 1):
        if full:
            assert it is not None
            it.factor(ev.jacobians(Y))
        K = ev(Y).reshape(s, -1)
        if it is None:  # the fixed point, on the stage derivatives K: Y ← y + h (A ⊗ I) K, one fused product
            if k < check:
                Y, K_prev = torch.addmm(y_row, hA, K).view(s, B, n), K
                continue
            new = torch.mm(hA, K).view(s, B, n)
            dZ = new - Z if K_prev is None else torch.mm(hA, K - K_prev).view(s, B, n)
            K_prev = K
        else:
            dZ = -it.apply(Z - torch.mm(hA, K).view(s, B, n))
            new = Z + dZ
        Z, Y = new, y + new
        if k < check:
            continue
        if scale is None:  # tolerances from the first iterate: ‖Z_b‖ changes by O(h²) relative after it
            scale = _tolerance(y, Z, newton.tol).reciprocal()
        rb = dZ.abs().amax(2).amax(0).mul_(scale)  # per sample, in tolerances (faster than one amax over (0, 2))
        if last is None:  # no rate yet: the one given (the last step's), else the increment itself
            r, theta = float(rb.max()), 0.0
            worst = r * rate0 / (1.0 - rate0) if 0.0 < rate0 < 0.5 else r
        else:
            r, worst, theta = _judge(rb, last, k - k_last)
            rate = max(rate, theta)
        if not math.isfinite(worst):
            return _Run(Z, k, "diverged", rate, r, 0.0)
        if worst <= 1.0:
            return _Run(Z, k, "converged", rate, r, 0.0)
        if judge is not None and theta > judge:
            return _Run(Z, k, "slow", rate, r, 0.0)
        last, k_last = rb.clamp_min(torch.finfo(rb.dtype).tiny), k  # an exact zero increment: θ = 0, not 0/0
        check = min(k + 1 + _unchecked(r, theta), newton.max_iters)
    largest = float(dZ.abs().max())
    return _Run(Z, newton.max_iters, "max_iters", rate, largest, float(1.0 / scale.min()))  # type: ignore[union-attr]


def _judge(rb: torch.Tensor, last: torch.Tensor, span: int) -> tuple[float, float, float]:
    """From each sample's increment ``r_b`` and the one ``span`` iterations before (in tolerances): the largest
    increment, the largest estimated remaining error, and the slowest rate ``θ_b = (r_b / r_b^{last})^{1/span}``
    among the samples above the rounding floor. Linear convergence at rate ``θ`` leaves an error of about
    ``θ/(1 − θ)·r`` (Hairer & Wanner 1996, eq. IV.8.13); a sample whose contraction stalled (``θ ≥ 1/2``) within
    1000 tolerances sits on the rounding floor of ``G`` (its increments are noise: an exact zero then 1e-17 reads
    as ``θ ≈ 1e291``) and is accepted there."""
    theta = rb / last if span == 1 else (rb / last).pow(1.0 / span)
    left = rb * torch.where(theta < 0.5, theta / (1 - theta), 1 / _FLOOR)
    judged = torch.where(last > _FLOOR, theta, 0.0)
    r, worst, slow = torch.stack([rb, left, judged]).amax(1).tolist()
    return r, worst, slow


def _unchecked(r: float, theta: float) -> int:
    """Iterations that cannot reach the stopping rule at the rate ``θ`` from ``r`` tolerances: the first one that
    may, by ``θ/(1 − θ) θ^j r ≤ 1``, is checked, and the one before it (a rate observed early may flatter)."""
    if not 0.0 < theta < 0.5 or r <= 1.0:
        return 0
    j = math.ceil(math.log(theta / (1.0 - theta) * r) / -math.log(theta))
    return max(0, j - 2)


def _tolerance(y: torch.Tensor, Z: torch.Tensor, tol: float | None) -> torch.Tensor:
    """Each sample's tolerance on the increment ``(B,)``: ``4 ε max(‖y_b‖_∞, ‖Z_b‖_∞)`` (to rounding), or ``tol``."""
    if tol is not None:
        return torch.full_like(y[:, 0], tol)
    eps, tiny = torch.finfo(y.dtype).eps, torch.finfo(y.dtype).tiny
    return (4 * eps * torch.maximum(y.abs().amax(1), Z.abs().amax((0, 2)))).clamp_min(tiny)


class _StageSensitivity(torch.autograd.Function):
    """Identity on the stage derivatives ``F`` ``(s, B, n)`` in forward; in backward, the implicit function
    theorem: the incoming cotangent ``g`` is replaced by the solution ``v`` of ``v_j − h Σ_i a_ij J_iᵀ v_i = g_j``
    (one batched linear solve with the transposed stage Jacobian, see :mod:`solvers.steppers.implicit`)."""

    @staticmethod
    def forward(ctx: Any, F: torch.Tensor, Y: torch.Tensor, ev: _StageFun, A: torch.Tensor, h: float, kind, newton):
        ctx.ev, ctx.h, ctx.kind, ctx.newton = ev, h, kind, newton
        ctx.save_for_backward(Y, A)
        remember_inputs(ctx, F, Y)
        return F.view_as(F)

    @staticmethod
    @first_order("backprop", fix=IMPLICIT_FIX)
    def backward(ctx: Any, g: torch.Tensor):
        Y, A = ctx.saved_tensors
        _phase.backward = True
        try:
            v = _transposed_solve(ctx.ev, Y, A, ctx.h, g, ctx.kind, ctx.newton.max_iters, ctx.newton.tol)
        finally:
            _phase.backward = False
        return v, None, None, None, None, None, None


def transposed_stage_solve(
    fun: Any,
    times: list[float],
    Y: torch.Tensor,
    A: torch.Tensor,
    h: float,
    g: torch.Tensor,
    kind: str,
    batched: bool = False,
    max_iters: int = 50,
    tol: float | None = None,
) -> torch.Tensor:
    """``v`` ``(s, B, n)`` with ``v_j − h Σ_i a_ij J(Y_i)ᵀ v_i = g_j`` at the converged stages ``Y`` ``(s, B, n)``: a
    direct batched solve with the stage Jacobians, or, where the forward converged by the fixed point (``kind``, as
    :func:`solve_stages` returns it), the fixed-point iteration on vector-Jacobian products, which contracts at the
    same rate (no graph is returned)."""
    return _transposed_solve(_StageFun(fun, times, batched), Y, A, h, g, kind, max_iters, tol)


def _transposed_solve(
    ev: _StageFun, Y: torch.Tensor, A: torch.Tensor, h: float, g: torch.Tensor, kind: str, max_iters=50, tol=None
) -> torch.Tensor:
    if kind == "fixed_point":
        return _transposed_fixed_point(ev, Y, A, h, g, max_iters, tol)
    s, B, n = Y.shape
    Q = kron_matrix(A, ev.jacobians(Y), h, transpose=True)
    v, info = torch.linalg.solve_ex(Q, g.permute(1, 0, 2).reshape(B, s * n, 1))
    if bool(info.any()):
        raise ImplicitSolveError(
            f"the gradient of the implicit step from t={float(ev.times[0]):.6g} (h={h:.3g}) needs the stage system "
            f"I − h Aᵀ ⊗ Jᵀ at its converged stages, which is singular in sample(s) "
            f"{info.nonzero().reshape(-1).tolist()[:8]}. Take smaller steps (`step_size`), or use another method.",
            Reason.NEWTON_SINGULAR,
            0,
            math.inf,
        )
    return v.reshape(B, s, n).permute(1, 0, 2)


def _transposed_fixed_point(ev: _StageFun, Y, A, h, g, max_iters: int, tol: float | None) -> torch.Tensor:
    """``v = g + h (Aᵀ ⊗ I) diag(J_iᵀ) v`` by fixed-point iteration: one vector-Jacobian product of the stages per
    iteration, no Jacobian."""
    eps, s = torch.finfo(Y.dtype).eps, Y.shape[0]
    hAT, g_rows = h * A.T, g.reshape(s, -1)
    with torch.enable_grad():
        x = Y.detach().requires_grad_(True)
        F = ev(x)
        v, prev, k_prev, check = g, 0.0, 0, 1
        for k in range(1, max_iters + 1):
            (u,) = torch.autograd.grad(F, x, v, retain_graph=True)
            new = torch.addmm(g_rows, hAT, u.reshape(s, -1)).view_as(g)
            if k < check:  # as forward: checked only where the rate so far allows convergence
                v = new
                continue
            norm, size = torch.stack([(new - v).abs().max(), new.abs().max()]).tolist()  # one host read
            v = new
            bound = tol if tol is not None else 4 * eps * size
            theta = (norm / prev) ** (1.0 / (k - k_prev)) if prev else 0.0
            if norm <= bound or (prev and theta < 1 and theta / (1 - theta) * norm <= bound):
                return v
            if prev and theta >= 1 and norm <= 1000 * bound:
                return v
            prev, k_prev = norm, k
            check = min(k + 1 + (_unchecked(norm / bound, theta) if bound else 0), max_iters)
    raise ImplicitSolveError(
        f"the backward fixed-point iteration of an implicit step did not converge in {max_iters} iterations "
        f"(last increment {norm:.3g}); use Newton('simplified') (a direct solve), or smaller steps.",
        Reason.NEWTON_MAX_ITERS,
        max_iters,
        norm,
    )


class FlatField:
    """``fun`` on flattened states ``(rows, n)`` for a field on states of shape ``(B, ...)``: one sample's shape
    for every row, so that ``s B`` stacked stage rows pass through too. Forwards ``count`` to ``fun``."""

    def __init__(self, fun: Any, shape: torch.Size):
        self.fun, self.tail = fun, tuple(shape[1:])
        count = getattr(fun, "count", None)
        if count is not None:
            self.count = count

    def __call__(self, t: float, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return self.fun(t, x.reshape(rows, *self.tail)).reshape(rows, -1)


def implicit_step(
    fun: Any,
    t0: float,
    y: torch.Tensor,
    h: float,
    tab: ImplicitTableau,
    newton: Newton = Newton(),
    times: list[float] | None = None,
    batched: bool = False,
    info: dict | None = None,
    guess: torch.Tensor | None = None,
    carry: Carry | None = None,
) -> tuple[torch.Tensor, int]:
    """One step ``(y_1, iterations)`` of ``tab`` from ``y`` ``(B, ...)`` at ``t0`` with step ``h`` (negative steps
    backwards in time). ``fun(t, y)`` is the field on states of ``y``'s shape; ``times``: the
    stage times to evaluate at (default ``t0 + c_i h``). ``batched``: the field is the same at every stage time of
    this step (autonomous, or constant on a piece that holds the step) and treats rows independently, so the
    stages are evaluated in one call on ``s B`` rows (``fun.count(k)``, where it exists, books the other ``s − 1``).
    ``info``: a dict that receives ``"kind"``, the iteration that converged, and ``"stages"``, the converged
    increments ``Z`` ``(s, B, n)``; ``guess``: the first iterate of ``Z``; ``carry``: what the previous step of a
    chain hands on (see :func:`solve_stages`).
    Differentiable in ``y`` and in whatever ``fun`` closes over, by the implicit function theorem (see the
    module)."""
    shape, B = y.shape, y.shape[0]
    flat = y.reshape(B, -1)
    f = fun if y.dim() == 2 else FlatField(fun, shape)
    times = [t0 + ci * h for ci in tab.c] if times is None else times
    with torch.no_grad():
        Z, iters, kind = solve_stages(f, t0, times, flat.detach(), h, tab, newton, batched, guess, carry)
    if info is not None:
        info["kind"], info["stages"] = kind, Z
    A, b, _, d = coefficients(tab, flat)
    if d is not None and not torch.is_grad_enabled():  # the stages give the value: no evaluation at them
        return (flat + torch.mm(d.view(1, -1), Z.reshape(len(times), -1)).view_as(flat)).reshape(shape), iters
    # graph in y and θ only: the stages are held fixed, _StageSensitivity supplies their dependence
    ev = _StageFun(f, times, batched)
    F = ev(flat + Z)
    if F.requires_grad:
        F = _StageSensitivity.apply(F, flat.detach() + Z, ev, A, h, kind, newton)
    lin = h * torch.einsum("i,ibn->bn", b, F)
    # The value from the stages themselves, y_1 = y_0 + Σ d_i Z_i (dᵀ = bᵀA⁻¹; the last stage when stiffly
    # accurate): h Σ b_i F(Y_i) would multiply the stages' rounding-level residual by h‖∂F/∂y‖, 1e8 on a stiff
    # field (Hairer & Wanner 1996, §IV.8). The derivative is the same; it is taken from the graph of ``lin``.
    if d is None:
        return (flat + lin).reshape(shape), iters
    val = torch.einsum("i,ibn->bn", d, Z)
    out = flat + val + (lin - lin.detach()) if lin.requires_grad else flat + val
    return out.reshape(shape), iters


def _output_weights(tab: ImplicitTableau) -> list[float] | None:
    """``d`` with ``y_1 = y_0 + Σ d_i Z_i``: ``e_s`` for stiffly accurate tableaux, ``bᵀA⁻¹`` for invertible ``A``."""
    if "stiffly accurate" in tab.properties:
        return [0.0] * (tab.stages - 1) + [1.0]
    if abs(np.linalg.det(tab.A)) < 1e-12:
        return None
    return np.linalg.solve(tab.A.T, np.array(tab.b)).tolist()
