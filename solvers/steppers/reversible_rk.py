r"""Reversible solvers built on any explicit Runge-Kutta method (McCallum & Foster 2024, "Efficient, accurate and
stable gradients for neural ODEs", arXiv:2410.11648).

With ``Ψ_h(t, x) = h Σ_i b_i k_i`` the increment of one step of an explicit Runge-Kutta method of size ``h`` from
``(t, x)`` (:data:`~solvers.steppers.tableaux.TABLEAUX`), the reversible method carries a pair ``(y_n, z_n)``,
``z_0 = y_0``, and steps from ``t_n`` to ``t_{n+1} = t_n + h`` by

    ``y_{n+1} = λ y_n + (1 − λ) z_n + Ψ_h(t_n, z_n)``,
    ``z_{n+1} = z_n − Ψ_{−h}(t_{n+1}, y_{n+1})``,

``λ ∈ (0, 1]`` the coupling (``options={"coupling": λ}``, default 0.999). The step is algebraically invertible,
two increments either way:

    ``z_n = z_{n+1} + Ψ_{−h}(t_{n+1}, y_{n+1})``,
    ``y_n = (y_{n+1} − (1 − λ) z_n − Ψ_h(t_n, z_n)) / λ``.

``y_n`` is the solution. The method converges with the base method's order (their convergence theorem). Linearised
on ``y' = μ y`` a step multiplies the pair by a matrix of determinant ``λ`` whose eigenvalues are ``R(hμ)`` (the
solution) and about ``λ R(−hμ) ≈ λ e^{−hμ}`` (a parasitic mode), ``R`` the base's stability function: the
parasitic mode decays forwards only where ``h Re μ > ln λ``, so ``λ < 1`` gives a stability region with a
neighbourhood of the origin (``λ = 1`` only part of the imaginary axis), and the inverse steps grow it by
``1/λ`` each: the rebuild amplifies rounding by about ``λ^{−n}`` over ``n`` steps (0.999: ``e^{10}`` at 10 000
steps). ``benchmarks/reversible_rk.py`` measures both.

Step sizes: both increments carry the base method's embedded error estimate ``h Σ_i e_i k_i`` (an adaptive base:
``dopri5``, ``tsit5``, ``bosh3``); the larger of their mixed RMS norms ``‖e / (atol + rtol max(|y_n|, |y_{n+1}|))‖``
decides acceptance (``≤ 1``) and the next size ``h · clip(safety · ratio^{−1/p}, dfactor, ifactor)``, ``p`` the base
order. A rejected step leaves nothing behind, so the rebuild walks the accepted steps only. Steps end exactly on
every output time and every parameter jump; a stage time at the step's end is read one ulp before it (as the
library's Runge-Kutta steps do), so every stage of a step lies in one piece. With a ``grid`` (``step_size``) the
steps are the grid's intervals: the only choice for a base without an error estimate (``rk4``).

``gradient="reversible"`` keeps the end pair and the accepted ``(t_n, t_{n+1})`` only; the backward pass rebuilds
``(y_n, z_n)`` from ``(y_{n+1}, z_{n+1})`` with the inverse and backpropagates through that one step: the exact
gradient of the discretisation (step sizes held fixed, up to the rounding of the rebuild) in memory constant in
the number of steps, ``2s`` evaluations and ``2s`` products per step of an ``s``-stage base (the inverse's two
increments are the forward step's own, so their graphs give the product). ``"backprop"``
differentiates the same loop directly (the same step sizes, held fixed).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..counting import Counted
from ..errors import Reason, SolverError, check_positive, nonfinite_forward
from ..gradients.second_order import first_order, remember_inputs
from .butcher import MethodTableau
from .tableaux import TABLEAUX

if TYPE_CHECKING:  # solvers.options names these methods from BASES, and solvers.run imports the gradients
    from ..run import Settings

__all__ = ["BASES", "OPTIONS", "base_of", "integrate_reversible_rk", "reconstruction_error", "rev_inverse", "rev_step"]

# the explicit Runge-Kutta bases served by name, method="reversible_<base>": any tableau of TABLEAUX would do
BASES = ("dopri5", "tsit5", "bosh3", "rk4")
OPTIONS = {"coupling", "first_step", "max_step", "safety", "ifactor", "dfactor"}
_PREFIX = "reversible_"


def base_of(method: str) -> MethodTableau:
    """The base tableau of ``method`` (``"reversible_<base>"``)."""
    return TABLEAUX[method.removeprefix(_PREFIX)]


def _time(t: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(t, dtype=torch.float64).to(like.dtype).to(like.device)


def _increment(
    func, tab: MethodTableau, x: torch.Tensor, start: float, h: float, end: float, error: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(Ψ_h(start, x), error estimate)`` (the estimate ``None`` without ``error`` or embedded weights): one step
    of the base from ``start``; stage times are clamped below ``end = max(start, start + h)``, the step's end, so
    no stage reads the next piece of a piecewise field."""
    a, b, c = tab.tableau.a, tab.tableau.b, tab.tableau.c
    below = math.nextafter(end, -math.inf)
    ks: list[torch.Tensor] = []
    for row, ci in zip(a, c):
        xi = x
        for aij, kj in zip(row, ks):
            if aij != 0.0:
                xi = xi + (h * aij) * kj
        ks.append(func(_time(min(start + ci * h, below), x), xi))
    incr = sum((h * bi) * k for bi, k in zip(b, ks) if bi != 0.0)
    err = None if tab.error is None or not error else sum((h * ei) * k for ei, k in zip(tab.error, ks) if ei != 0.0)
    return incr, err  # type: ignore[return-value]


def _step(func, tab, lam: float, y, z, t0: float, t1: float, error: bool = False):
    """One reversible step: ``(y_1, z_1, error of Ψ_h, error of Ψ_{−h})`` (the errors with ``error``)."""
    h = t1 - t0
    dz, ez = _increment(func, tab, z, t0, h, t1, error)
    y1 = lam * y + (1.0 - lam) * z + dz if lam != 1.0 else y + dz
    dy, ey = _increment(func, tab, y1, t1, -h, t1, error)
    return y1, z - dy, ez, ey


def rev_step(func, tab: MethodTableau, lam: float, y, z, t0: float, t1: float):
    """One reversible step of ``func`` from ``t0`` to ``t1``: ``(y_1, z_1)``."""
    y1, z1, _, _ = _step(func, tab, lam, y, z, t0, t1)
    return y1, z1


def rev_inverse(func, tab: MethodTableau, lam: float, y1, z1, t0: float, t1: float):
    """The step's exact inverse: ``(y_0, z_0)`` from ``(y_1, z_1)``."""
    h = t1 - t0
    dy, _ = _increment(func, tab, y1, t1, -h, t1, error=False)
    z = z1 + dy
    dz, _ = _increment(func, tab, z, t0, h, t1, error=False)
    y = (y1 - (1.0 - lam) * z - dz) / lam if lam != 1.0 else y1 - dz
    return y, z


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def _options(options: dict, rtol: float, atol: float) -> dict[str, float]:
    lam = options.get("coupling", 0.999)
    if isinstance(lam, bool) or not isinstance(lam, int | float) or not 0.0 < lam <= 1.0:
        raise ValueError(
            f"`options['coupling']` (the reversible method's λ) must be a number in (0, 1], got {lam!r}; the "
            "default is 0.999 (a smaller λ damps faster forwards, but the rebuild amplifies rounding by λ^-n)."
        )
    out = {"coupling": float(lam), "safety": 0.9, "ifactor": 10.0, "dfactor": 0.2, "max_step": math.inf}
    out.update(rtol=rtol, atol=atol)
    for k in ("safety", "ifactor", "dfactor", "max_step", "first_step"):
        if k in options:
            out[k] = check_positive(f"options['{k}']", options[k])
    return out


def _first_step(z: torch.Tensor, f: torch.Tensor, opts: dict, span: float, order: int) -> float:
    """The first size of an adaptive solve: ``first_step``, else ``0.01 ‖y_0‖ / ‖F(t_0, y_0)‖`` in the
    tolerances' norm (Hairer, Nørsett & Wanner 1993, §II.4, the first guess), at most the span."""
    if "first_step" in opts:
        return min(opts["first_step"], span)
    scale = opts["atol"] + opts["rtol"] * z.abs()
    d0, d1 = _rms(z / scale), _rms(f / scale)
    h = 1e-6 if d0 < 1e-5 or d1 < 1e-5 else 0.01 * d0 / d1
    return min(h, span)


def _run(func, tab, y, t: Sequence[float], stops: Sequence[float], opts: dict, adaptive: bool, stats: Any, steps):
    """The forward loop (with a graph when grad is on): the states at ``t`` and the end pair; ``steps``
    receives the accepted ``(t_n, t_{n+1})``."""
    lam, order = opts["coupling"], tab.order
    z = y
    outs = [y]
    tc = t[0]
    h = 0.0
    if adaptive:
        with torch.no_grad():
            h = _first_step(y, func(_time(tc, y), y), opts, t[-1] - t[0], order)
    k = bisect.bisect_right(stops, tc)
    while k < len(stops):
        target = stops[k]
        h_try = min(h, opts["max_step"], target - tc) if adaptive else target - tc
        lands = h_try >= target - tc or tc + h_try >= target
        t1 = target if lands else tc + h_try
        func.callback_step(tc, y, h_try)
        y1, z1, ez, ey = _step(func, tab, lam, y, z, tc, t1, adaptive)
        if adaptive:
            with torch.no_grad():
                scale = opts["atol"] + opts["rtol"] * torch.maximum(y.abs(), y1.abs())
                ratio = max(_rms(ez / scale), _rms(ey / scale))
            if not math.isfinite(ratio):
                ratio = math.inf
            accept = ratio <= 1.0
            lo = 1.0 if accept else opts["dfactor"]
            grow = opts["safety"] * ratio ** (-1 / order) if ratio > 0 else math.inf
            factor = min(opts["ifactor"], max(grow, lo))
            h = h_try * factor
            if not accept:
                func.callback_reject_step(tc, y, h_try)
                continue
        stats.steps_forward += 1
        steps.append((tc, t1))
        y, z, tc = y1, z1, t1
        if lands:
            k += 1
            if target in t:
                outs.append(y)
    if not all(bool(torch.isfinite(o).all()) for o in (y, z)):
        raise nonfinite_forward(f"reversible {tab.name}", stats.nfe_forward)
    return outs, y, z


def _vjp(out: torch.Tensor, x: torch.Tensor, wrt: list[torch.Tensor], cot: torch.Tensor, acc: list[torch.Tensor]):
    """``cotᵀ ∂out/∂x``, adding ``cotᵀ ∂out/∂θ`` to ``acc`` (zeros where ``out`` does not depend on them)."""
    if not out.requires_grad:
        return torch.zeros_like(x)
    g = torch.autograd.grad(out, [x, *wrt], cot, allow_unused=True)
    for a, gp in zip(acc, g[1:]):
        if gp is not None:
            a += gp
    return torch.zeros_like(x) if g[0] is None else g[0]


def _step_back(func, tab, lam: float, y1, z1, t0: float, t1: float, ly1, lz1, wrt, acc):
    """The inverse step and the forward step's vector-Jacobian product in one pass: ``(y_n, z_n)`` and their
    cotangents from those of ``(y_{n+1}, z_{n+1})``. The inverse evaluates the forward step's own two increments,
    ``Ψ_{−h}`` at ``y_{n+1}`` and ``Ψ_h`` at ``z_n``, so their graphs give the product: with
    ``ȳ = ȳ_{n+1} − J_{Ψ_{−h}}ᵀ z̄_{n+1}``, ``ȳ_n = λ ȳ`` and ``z̄_n = z̄_{n+1} + (1 − λ) ȳ + J_{Ψ_h}ᵀ ȳ``
    (``2s`` evaluations per step, not the ``4s`` of an inverse followed by a recomputed step)."""
    h = t1 - t0
    with torch.enable_grad():
        yl = y1.detach().requires_grad_()
        dy, _ = _increment(func, tab, yl, t1, -h, t1, error=False)
        ly = ly1 + _vjp(dy, yl, wrt, -lz1, acc)
    z = (z1 + dy).detach()
    with torch.enable_grad():
        zl = z.requires_grad_()
        dz, _ = _increment(func, tab, zl, t0, h, t1, error=False)
        gz = _vjp(dz, zl, wrt, ly, acc)
    dz = dz.detach()
    y = (y1 - (1.0 - lam) * z - dz) / lam if lam != 1.0 else y1 - dz
    return y, z.detach(), lam * ly, lz1 + (1.0 - lam) * ly + gz


class _Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: dict, y0: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        remember_inputs(ctx, y0, *params)
        steps: list[tuple[float, float]] = []
        with torch.no_grad():
            outs, y, z = _run(cfg["func"], cfg["tab"], y0, cfg["t"], cfg["stops"], cfg["opts"], cfg["adaptive"],
                              cfg["stats"], steps)  # fmt: skip
        ctx.cfg, ctx.steps = cfg, steps
        ctx.save_for_backward(y, z, *params)  # the end pair only: memory constant in the steps
        return torch.stack(outs)

    @staticmethod
    @first_order("reversible")
    def backward(ctx, grad_ys: torch.Tensor):
        cfg, steps = ctx.cfg, ctx.steps
        func, tab, stats, lam = cfg["func"], cfg["tab"], cfg["stats"], cfg["opts"]["coupling"]
        y, z, *params = ctx.saved_tensors
        wrt = [p for p in params if p.requires_grad]
        g_params = [torch.zeros_like(p) for p in wrt]
        out_at = {tj: j for j, tj in enumerate(cfg["t"])}
        ly, lz = torch.zeros_like(y), torch.zeros_like(z)
        for t0, t1 in reversed(steps):
            if t1 in out_at:
                ly = ly + grad_ys[out_at[t1]]
            y, z, ly, lz = _step_back(func, tab, lam, y, z, t0, t1, ly, lz, wrt, g_params)
            stats.steps_backward += 1
        g_y0 = ly + lz + grad_ys[0]  # z_0 = y_0
        if not bool(torch.isfinite(g_y0).all()):
            raise SolverError(
                f"the gradient became non-finite (NaN/inf) in the reversible backward pass after "
                f"{stats.nfe_backward} field evaluations; tighten `rtol`/`atol`, lower options['coupling'] "
                "away from 1, or use gradient='backprop'.",
                reason=Reason.NONFINITE_GRADIENT,
                nfe=stats.nfe_backward,
            )
        it = iter(g_params)
        return (None, g_y0, *(next(it) if p.requires_grad else None for p in params))


def integrate_reversible_rk(
    func: Counted,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    solver: Settings,
    reversible: bool,
    params: Sequence[torch.Tensor] | None,
    jump_t: torch.Tensor | None,
    grid: torch.Tensor | None,
) -> torch.Tensor:
    """Solve ``y' = func(t, y)`` at the increasing times ``t`` with the reversible method on ``solver.method``'s
    base: adaptive, or on ``grid`` (fixed steps, which then contains ``t``). ``reversible``: the gradient of the
    module docstring; else backpropagation through the steps. Returns ``(len(t), *y0.shape)``."""
    if t.requires_grad:
        raise ValueError(f"method={solver.method!r} does not differentiate the output times `t`; detach them.")
    tab = base_of(solver.method)
    adaptive = grid is None
    if adaptive and tab.error is None:
        raise ValueError(
            f"method={solver.method!r}: its base {tab.name!r} has no error estimate to choose steps with; give "
            "a `step_size` (fixed steps), or use an adaptive base such as 'reversible_dopri5'."
        )
    stats = func.stats
    opts = _options(dict(solver.options), solver.rtol, solver.atol)
    ts = [float(s) for s in t.tolist()]
    extra = [] if grid is None else grid.tolist()
    if adaptive and jump_t is not None:
        extra = jump_t.tolist()
    stops = sorted({s for s in [*ts[1:], *extra] if ts[0] < s <= ts[-1]})
    if not reversible:
        outs, _, _ = _run(func, tab, y0, ts, stops, opts, adaptive, stats, [])
        return torch.stack(outs)
    ps = tuple(p for p in (params or ()) if p.requires_grad)
    cfg = dict(func=func, tab=tab, t=ts, stops=stops, opts=opts, adaptive=adaptive, stats=stats)
    return _Reversible.apply(cfg, y0, *ps)


def reconstruction_error(field, method: str, y0: torch.Tensor, T: float, steps: int, coupling: float = 0.999) -> float:
    """Relative error of ``y0`` rebuilt by ``steps`` inverse steps from the pair after ``steps`` forward steps of
    size ``T / steps`` (no gradients): the rounding the reversible gradient carries."""
    tab, h = base_of(method), T / steps
    with torch.no_grad():
        y, z = y0, y0
        for n in range(steps):
            y, z = rev_step(field, tab, coupling, y, z, n * h, (n + 1) * h)
        for n in range(steps - 1, -1, -1):
            y, z = rev_inverse(field, tab, coupling, y, z, n * h, (n + 1) * h)
    return float((y - y0).abs().max() / y0.abs().max())
