r"""Implicit Runge-Kutta steps, batched per sample, with gradients by the implicit function theorem.

One step of the tableau ``(A, b, c)`` (:mod:`solvers.implicit_tableaux`) from ``y_0`` at ``t_0`` solves

    ``G(Z) = Z − h (A ⊗ I) F(Y) = 0``,   ``Y_i = y_0 + Z_i``,   ``F(Y)_i = F(t_0 + c_i h, Y_i)``,

and returns ``y_1 = y_0 + h Σ_i b_i F(Y_i)`` (Hairer & Wanner 1996, §IV.8).

Newton. The stage equations are solved for every sample of the batch at once, each sample with its own
``n × n`` Jacobian ``J = ∂F/∂y`` (rows of a batch are independent, as for every cde_nets field; a module that
mixes samples, e.g. batch norm, needs ``Newton("fixed_point")``, whose backward uses exact vector-Jacobian products
instead of per-sample Jacobians). ``Newton("simplified")`` (default) factors
``M = I − h A ⊗ J(t_0, y_0)`` once per step and iterates ``Z ← Z − M^{−1} G(Z)`` (HW 1996, eq. IV.8.10);
``Newton("full")`` rebuilds ``M = I − h (A ⊗ I) diag(J(Y_j))`` every iteration (for stiff fields whose Jacobian
changes within a step). The first iterate is ``Z_i = h c_i F(t_0, y_0)``.

Stopping rule: sample ``b`` has converged when its increment ``‖ΔZ_b‖_∞ ≤ tol_b``, with
``tol_b = 4 ε max(‖y_b‖_∞, ‖Z_b‖_∞)`` (``ε``: the dtype's machine epsilon, i.e. to rounding) unless
``Newton(tol=...)`` gives an absolute tolerance; or when the estimated remaining error ``θ/(1 − θ) ‖ΔZ_k‖``, with
the observed rate ``θ = ‖ΔZ_k‖ / ‖ΔZ_{k−1}‖ < 1/2``, is below ``tol_b`` (HW 1996, eq. IV.8.13); or when the
contraction has stopped (``θ ≥ 1/2``) within ``1000 tol_b``: the iteration sits on the rounding floor of ``G``. The
step is accepted once every sample has; after ``max_iters`` iterations, or on a non-finite iterate,
:class:`ImplicitSolveError` names the iteration count, the largest increment and the fix.

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

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import Reason, SolverError
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
]

_phase = threading.local()


def in_backward() -> bool:
    """Whether a step's backward (the stage Jacobians of :class:`_StageSensitivity`) is evaluating the field now:
    evaluation counters book those evaluations as backward ones."""
    return getattr(_phase, "backward", False)


@dataclass(frozen=True)
class Newton:
    """How the stage equations are solved: ``kind`` ``"simplified"`` (Newton, one Jacobian per step), ``"full"``
    (Newton, one Jacobian per iteration and stage) or ``"fixed_point"`` (Jacobian-free: ``Z ← h (A ⊗ I) F(y + Z)``
    forward and the same iteration on the transposed system backward; converges when ``h ‖A‖ ‖∂F/∂y‖ < 1``, so for
    non-stiff fields, at a cost that does not grow with ``n³``); at most ``max_iters`` iterations; ``tol`` an
    absolute tolerance on the increment (default ``None``: to rounding, see :mod:`solvers.implicit`)."""

    kind: str = "simplified"
    max_iters: int = 50
    tol: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("simplified", "full", "fixed_point"):
            raise ValueError(f"`Newton(kind=...)` must be 'simplified', 'full' or 'fixed_point', got {self.kind!r}.")
        if isinstance(self.max_iters, bool) or not isinstance(self.max_iters, int) or self.max_iters < 1:
            raise ValueError(f"`Newton(max_iters=...)` must be a positive integer, got {self.max_iters!r}.")
        if self.tol is not None and not (isinstance(self.tol, (int, float)) and self.tol > 0):
            raise ValueError(f"`Newton(tol=...)` must be a number > 0 or None (to rounding), got {self.tol!r}.")


class ImplicitSolveError(SolverError):
    """The stage equations of an implicit step did not converge. ``reason`` is ``Reason.NEWTON_DIVERGED`` or
    ``Reason.NEWTON_MAX_ITERS``; ``iterations`` and ``residual`` (the largest last increment) say how far it got."""

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
        except RuntimeError:  # an operation without a batching rule: one product per output coordinate
            rows = [torch.autograd.grad(F, x, eye[k], retain_graph=True, allow_unused=True)[0] for k in range(n)]
            jac = None if rows[0] is None else torch.stack(rows)
    if jac is None:
        return F.detach(), torch.zeros(B, n, n, dtype=y.dtype, device=y.device)
    return F.detach(), jac.transpose(0, 1)


def _kron(A: torch.Tensor, J: torch.Tensor, h: float, transpose: bool = False) -> torch.Tensor:
    """``I − h (A ⊗ I) diag(J_j)`` per sample, ``(B, s n, s n)``: block ``(i, j)`` is ``δ_ij I − h a_ij J_j``. ``J``
    is ``(B, n, n)`` (one for all stages) or ``(s, B, n, n)``. ``transpose``: the transposed matrix,
    block ``(j, i)`` is ``δ_ij I − h a_ij J_iᵀ``. Assembled block by block (an einsum over the 5-d product is ~50×
    slower on CPU)."""
    s = A.shape[0]
    B, n = J.shape[-3], J.shape[-1]
    M = torch.zeros(B, s, n, s, n, dtype=J.dtype, device=J.device)
    a = A.tolist()
    for i in range(s):
        for j in range(s):
            if a[i][j]:
                if transpose:
                    Ji = J if J.dim() == 3 else J[i]
                    M[:, j, :, i, :] = (-h * a[i][j]) * Ji.transpose(1, 2)
                else:
                    M[:, i, :, j, :] = (-h * a[i][j]) * (J if J.dim() == 3 else J[j])
    M = M.reshape(B, s * n, s * n)
    M.diagonal(dim1=1, dim2=2).add_(1.0)
    return M


def _factor(M: torch.Tensor) -> tuple:
    """A batched factorisation to apply with :func:`_apply`: small matrices are inverted (one batched matmul per
    Newton iteration beats per-matrix triangular solves), larger ones LU-factored."""
    if M.shape[-1] <= 32:
        return ("inv", torch.linalg.inv(M))
    return ("lu", *torch.linalg.lu_factor(M))


def _apply(fac: tuple, rhs: torch.Tensor) -> torch.Tensor:
    return fac[1] @ rhs if fac[0] == "inv" else torch.linalg.lu_solve(fac[1], fac[2], rhs)


class _EigenSolver:
    """``(I − h A ⊗ J)^{−1}`` in the eigenbasis of ``A = T Λ T^{−1}``: ``I − h Λ ⊗ J`` is block diagonal, so one
    ``n × n`` factorisation per eigenvalue (one complex one per conjugate pair) replaces the ``s n × s n`` one
    (Hairer & Wanner 1996, §IV.8, "transformation to Jordan canonical form"). For tableaux with distinct
    eigenvalues and a well-conditioned ``T`` (Gauss, Radau IIA); :func:`eigen_solver` returns ``None`` otherwise."""

    def __init__(self, lam: np.ndarray, T: torch.Tensor, Tinv: torch.Tensor, J: torch.Tensor, h: float):
        cdtype = torch.complex128 if J.dtype == torch.float64 else torch.complex64
        self.T, self.Tinv = T.to(device=J.device, dtype=cdtype), Tinv.to(device=J.device, dtype=cdtype)
        n, self.lus, self.partner = J.shape[-1], {}, {}
        eye = torch.eye(n, dtype=J.dtype, device=J.device)
        for k, lk in enumerate(lam):
            if lk.imag < 0:
                self.partner[k] = int(np.argmin(np.abs(lam - lk.conjugate())))
                continue
            if lk.imag == 0:
                self.lus[k] = _factor(eye - (h * lk.real) * J)
            else:
                self.lus[k] = _factor(eye - (h * complex(lk)) * J.to(cdtype))
        self.real = J.dtype

    def solve(self, G: torch.Tensor) -> torch.Tensor:
        Gt = torch.einsum("ki,ibn->kbn", self.Tinv, G.to(self.T.dtype))
        out = torch.empty_like(Gt)
        for k, lu in self.lus.items():
            rhs = Gt[k].unsqueeze(-1)
            sol = _apply(lu, rhs.real if lu[1].dtype == self.real else rhs).squeeze(-1)
            out[k] = sol
        for k, j in self.partner.items():
            out[k] = out[j].conj()
        return torch.einsum("ik,kbn->ibn", self.T, out).real.to(self.real)


_EIGEN: dict[str, tuple[np.ndarray, torch.Tensor, torch.Tensor] | None] = {}
_EIGEN_MIN_SIZE = 32  # below s·n = 32 the dense factorisation is cheaper than the complex arithmetic


def eigen_solver(tab: ImplicitTableau, J: torch.Tensor, h: float) -> _EigenSolver | None:
    if tab.stages * J.shape[-1] < _EIGEN_MIN_SIZE:
        return None
    key = f"{tab.name}:{tab.a}"
    if key not in _EIGEN:
        lam, T = np.linalg.eig(tab.A)
        distinct = all(abs(a - b) > 1e-8 for i, a in enumerate(lam) for b in lam[i + 1 :])
        ok = distinct and np.linalg.cond(T) < 1e6 and tab.stages > 1
        Tt = torch.from_numpy(T.astype(np.complex128))
        _EIGEN[key] = (lam, Tt, torch.linalg.inv(Tt)) if ok else None
    entry = _EIGEN[key]
    return None if entry is None else _EigenSolver(*entry, J, h)


def _stages(fun: Any, times: list[float], y: torch.Tensor, Z: torch.Tensor) -> torch.Tensor:
    return torch.stack([fun(ti, y + Zi) for ti, Zi in zip(times, Z)])


def solve_stages(
    fun: Any, t0: float, times: list[float], y: torch.Tensor, h: float, tab: ImplicitTableau, newton: Newton
) -> tuple[torch.Tensor, int]:
    """The converged stage increments ``Z`` ``(s, B, n)`` of one step (no graph) and the iteration count."""
    s, (B, n) = tab.stages, y.shape
    A = torch.tensor(tab.a, dtype=y.dtype, device=y.device)
    c = torch.tensor(tab.c, dtype=y.dtype, device=y.device)
    eps = torch.finfo(y.dtype).eps
    lu: tuple | None = None
    eig: _EigenSolver | None = None
    if newton.kind == "simplified":
        F0, J0 = stage_jacobian(fun, t0, y)
        eig = eigen_solver(tab, J0, h)
        lu = _factor(_kron(A, J0, h)) if eig is None else None
    else:
        F0 = fun(t0, y)
    Z = (h * c).view(s, 1, 1) * F0
    ynorm = y.abs().amax(1)
    prev: torch.Tensor | None = None
    step_lu: tuple | None
    for k in range(1, newton.max_iters + 1):
        if newton.kind == "full":
            FJ = [stage_jacobian(fun, ti, y + Zi) for ti, Zi in zip(times, Z)]
            F = torch.stack([f for f, _ in FJ])
            step_lu = _factor(_kron(A, torch.stack([j for _, j in FJ]), h))
        else:
            F, step_lu = _stages(fun, times, y, Z), lu
        G = Z - h * torch.einsum("ij,jbn->ibn", A, F)
        if eig is not None:
            dZ = eig.solve(G)
        elif step_lu is None:  # fixed point: Z ← h (A ⊗ I) F(y + Z), no Jacobian
            dZ = G
        else:
            rhs = G.permute(1, 0, 2).reshape(B, s * n, 1)
            dZ = _apply(step_lu, rhs).reshape(B, s, n).permute(1, 0, 2)
        Z = Z - dZ
        norm = dZ.abs().amax((0, 2))
        if not bool(torch.isfinite(norm).all()):
            raise ImplicitSolveError(
                f"the Newton iteration of an implicit step at t={t0:.6g} (h={h:.3g}) went non-finite after {k} "
                "iteration(s); take smaller steps (`step_size`), use Newton('full'), or float64.",
                Reason.NEWTON_DIVERGED,
                k,
                float("inf"),
            )
        if newton.tol is not None:
            tol = torch.full_like(norm, newton.tol)
        else:
            tol = 4 * eps * torch.maximum(ynorm, Z.abs().amax((0, 2)))
        done = norm <= tol
        if prev is not None:
            theta = norm / prev
            # linear convergence at rate θ leaves an error of about θ/(1 − θ)·‖ΔZ‖ (Hairer & Wanner, eq. IV.8.13)
            done |= (theta < 0.5) & (theta / (1 - theta) * norm <= tol)
            done |= (theta >= 0.5) & (norm <= 1000 * tol)
        if bool(done.all()):
            return Z, k
        prev = norm
    worst = float(norm.max())
    raise ImplicitSolveError(
        f"the Newton iteration of an implicit step at t={t0:.6g} (h={h:.3g}) did not converge in "
        f"{newton.max_iters} iterations (largest increment {worst:.3g}, tolerance {float(tol.max()):.3g}); "
        "take smaller steps (`step_size`), raise Newton(max_iters=...), or use Newton('full') for a stiff field "
        "(Newton('simplified') instead of 'fixed_point').",
        Reason.NEWTON_MAX_ITERS,
        newton.max_iters,
        worst,
    )


class _StageSensitivity(torch.autograd.Function):
    """Identity on the stage derivatives ``F`` ``(s, B, n)`` in forward; in backward, the implicit function
    theorem: the incoming cotangent ``g`` is replaced by the solution ``v`` of ``v_j − h Σ_i a_ij J_iᵀ v_i = g_j``
    (one batched linear solve with the transposed stage Jacobian, see :mod:`solvers.implicit`)."""

    @staticmethod
    def forward(
        ctx: Any, F: torch.Tensor, Y: torch.Tensor, fun: Any, times: list[float], A: torch.Tensor, h: float, newton
    ):
        ctx.fun, ctx.times, ctx.h, ctx.newton = fun, times, h, newton
        ctx.save_for_backward(Y, A)
        return F.view_as(F)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        Y, A = ctx.saved_tensors
        _phase.backward = True
        try:
            v = transposed_stage_solve(ctx.fun, ctx.times, Y, A, ctx.h, g, ctx.newton)
        finally:
            _phase.backward = False
        return v, None, None, None, None, None, None


def transposed_stage_solve(
    fun: Any, times: list[float], Y: torch.Tensor, A: torch.Tensor, h: float, g: torch.Tensor, newton: Newton
) -> torch.Tensor:
    """``v`` ``(s, B, n)`` with ``v_j − h Σ_i a_ij J(Y_i)ᵀ v_i = g_j`` at the converged stages ``Y`` ``(s, B, n)``: a
    direct batched solve with the stage Jacobians, or, for ``Newton("fixed_point")``, the fixed-point iteration
    on vector-Jacobian products (no graph is returned)."""
    if newton.kind == "fixed_point":
        return _transposed_fixed_point(fun, times, Y, A, h, g, newton)
    s, B, n = Y.shape
    J = torch.stack([stage_jacobian(fun, ti, Yi)[1] for ti, Yi in zip(times, Y)])
    Q = _kron(A, J, h, transpose=True)
    return torch.linalg.solve(Q, g.permute(1, 0, 2).reshape(B, s * n, 1)).reshape(B, s, n).permute(1, 0, 2)


def _transposed_fixed_point(fun, times, Y, A, h, g, newton) -> torch.Tensor:
    """``v = g + h (Aᵀ ⊗ I) diag(J_iᵀ) v`` by fixed-point iteration: one vector-Jacobian product of the stages per
    iteration, no Jacobian."""
    eps = torch.finfo(Y.dtype).eps
    with torch.enable_grad():
        x = Y.detach().requires_grad_(True)
        F = torch.stack([fun(ti, xi) for ti, xi in zip(times, x)])
        v, prev = g, None
        for _ in range(newton.max_iters):
            (u,) = torch.autograd.grad(F, x, v, retain_graph=True)
            new = g + h * torch.einsum("ij,ibn->jbn", A, u)
            norm = float((new - v).abs().max())
            v = new
            tol = newton.tol if newton.tol is not None else 4 * eps * float(v.abs().max())
            if norm <= tol or (prev is not None and norm < prev and norm / prev / (1 - norm / prev) * norm <= tol):
                return v
            if prev is not None and norm >= prev and norm <= 1000 * tol:
                return v
            prev = norm
    raise ImplicitSolveError(
        f"the backward fixed-point iteration of an implicit step did not converge in {newton.max_iters} iterations "
        f"(last increment {norm:.3g}); use Newton('simplified') (a direct solve), or smaller steps.",
        Reason.NEWTON_MAX_ITERS,
        newton.max_iters,
        norm,
    )


def implicit_step(
    fun: Any,
    t0: float,
    y: torch.Tensor,
    h: float,
    tab: ImplicitTableau,
    newton: Newton = Newton(),
    times: list[float] | None = None,
) -> tuple[torch.Tensor, int]:
    """One step ``(y_1, iterations)`` of ``tab`` from ``y`` ``(B, ...)`` at ``t0`` with step ``h`` (negative steps
    backwards in time). ``fun(t, y)`` is the field on states of ``y``'s shape; ``times``: the
    stage times to evaluate at (default ``t0 + c_i h``). Differentiable in ``y`` and in whatever ``fun`` closes over,
    by the implicit function theorem (see the module)."""
    shape, B = y.shape, y.shape[0]
    flat = y.reshape(B, -1)

    def f(t: float, x: torch.Tensor) -> torch.Tensor:
        return fun(t, x.reshape(shape)).reshape(B, -1)

    times = [t0 + ci * h for ci in tab.c] if times is None else times
    with torch.no_grad():
        Z, iters = solve_stages(f, t0, times, flat.detach(), h, tab, newton)
    # graph in y and θ only: the stages are held fixed, _StageSensitivity supplies their dependence
    F = _stages(f, times, flat, Z)
    if F.requires_grad:
        A = torch.tensor(tab.a, dtype=y.dtype, device=y.device)
        F = _StageSensitivity.apply(F, flat.detach() + Z, f, times, A, h, newton)
    b = torch.tensor(tab.b, dtype=y.dtype, device=y.device)
    lin = h * torch.einsum("i,ibn->bn", b, F)
    # The value from the stages themselves, y_1 = y_0 + Σ d_i Z_i (dᵀ = bᵀA⁻¹; the last stage when stiffly
    # accurate): h Σ b_i F(Y_i) would multiply the stages' rounding-level residual by h‖∂F/∂y‖, 1e8 on a stiff
    # field (Hairer & Wanner 1996, §IV.8). The derivative is the same; it is taken from the graph of ``lin``.
    d = _output_weights(tab)
    if d is None:
        return (flat + lin).reshape(shape), iters
    val = torch.einsum("i,ibn->bn", torch.tensor(d, dtype=y.dtype, device=y.device), Z)
    out = flat + val + (lin - lin.detach()) if lin.requires_grad else flat + val
    return out.reshape(shape), iters


def _output_weights(tab: ImplicitTableau) -> list[float] | None:
    """``d`` with ``y_1 = y_0 + Σ d_i Z_i``: ``e_s`` for stiffly accurate tableaux, ``bᵀA⁻¹`` for invertible ``A``."""
    if "stiffly accurate" in tab.properties:
        return [0.0] * (tab.stages - 1) + [1.0]
    if abs(np.linalg.det(tab.A)) < 1e-12:
        return None
    return np.linalg.solve(tab.A.T, np.array(tab.b)).tolist()
