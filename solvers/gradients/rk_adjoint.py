r"""The continuous adjoint over whole parameter tensors, both solves on the library's stepper.

Pontryagin's adjoint (Chen et al. 2018, "Neural ordinary differential equations", eqs. 4-5; §B for the times):
for ``y' = F(t, y, θ)`` and a loss ``ℒ(y(t_0), …, y(t_N))``, backwards from ``t_N``,

    ``a' = −aᵀ ∂F/∂y``,   ``g' = −aᵀ ∂F/∂θ``,   ``τ' = −aᵀ ∂F/∂t``,

with ``a`` jumping by ``∂ℒ/∂y(t_i)`` at each output time and ``y`` recomputed backwards alongside; then
``∂ℒ/∂y_0 = a(t_0)``, ``∂ℒ/∂θ = g(t_0)``, and when ``t`` requires grad ``∂ℒ/∂t_i = aᵀ F(t_i, y_i)`` for ``i ≥ 1``
(``τ`` starting each interval lowered by it) and ``∂ℒ/∂t_0 = τ(t_0)``.

This is the generic form the piecewise adjoint (:mod:`solvers.gradients.piecewise_adjoint`) falls back to: it serves a
backward error norm over every part of ``(τ, y, a, g)`` (``seminorm=False``), a norm of the user's, times that
require grad, and piece boundaries the backward solve would not step on. Its backward state is torchdiffeq's,
``(τ, y, a, g_1, …, g_P)``, measured by torchdiffeq's norms (``max(|τ|, ‖y‖, ‖a‖, max_k ‖g_k‖_RMS)``, or without
the ``g_k`` for ``"seminorm"``; ``‖·‖`` the forward solve's norm), so the steps are those of torchdiffeq's
``odeint_adjoint``; the solves run through :func:`solvers.steppers.rk_odeint.odeint_rk` (torchdiffeq's public ``odeint``
for the methods only it has).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch.func import vjp

from ..counting import Counted
from ..grids import negated_time_options
from ..norms import StateNorm
from ..steppers.rk_odeint import _CALLBACKS, _Flat, _Parts, _Reversed, odeint_rk
from .second_order import first_order, remember_inputs, served
from .vmap_adjoint import _slots, _Swapped

__all__ = ["odeint_adjoint_rk"]


def odeint_adjoint_rk(
    func: Callable[[torch.Tensor, Any], Any],
    y0: torch.Tensor | tuple[torch.Tensor, ...],
    t: torch.Tensor,
    *,
    rtol: Any,
    atol: Any,
    method: str,
    options: Mapping | None,
    adjoint_rtol: Any,
    adjoint_atol: Any,
    adjoint_method: str,
    adjoint_options: Mapping | None,
    adjoint_params: Sequence[torch.Tensor],
) -> Any:
    """``torchdiffeq.odeint_adjoint`` with every argument given (library method names): the solution at ``t``,
    whose gradients with respect to ``y0``, ``adjoint_params`` and ``t`` come from the adjoint solve.
    ``adjoint_options["norm"]``: absent (every part), ``"seminorm"``, or a callable of the tuple
    ``(τ, *y parts, *a parts, *g)``. The callbacks ``callback_*_adjoint`` of ``func`` are the backward solve's."""
    original = func  # whose adjoint callbacks and backward jumps the backward solve takes
    options = dict(options or {})
    adj_options = dict(adjoint_options or {})
    params = tuple(p for p in adjoint_params if p.requires_grad)
    parts: _Parts | None = None
    state_norm: Callable = options.get("norm") or StateNorm()
    if not isinstance(y0, torch.Tensor):
        parts = _Parts(y0)
        norm = options.get("norm")
        state_norm = options["norm"] = StateNorm(parts.sizes) if norm is None else parts.norm(norm)
        func = _Flat(func, parts)
        y0 = parts.flat(y0)
    if len(t) > 1 and bool(t[0] > t[1]):
        t, func, options = -t, _Reversed(func), negated_time_options(options)
    adj_options["norm"] = _adjoint_norm(adj_options.get("norm"), state_norm, parts)
    cfg = dict(
        func=func,
        original=original,
        rtol=rtol,
        atol=atol,
        method=method,
        options=options,
        adjoint_rtol=adjoint_rtol,
        adjoint_atol=adjoint_atol,
        adjoint_method=adjoint_method,
        adjoint_options=adj_options,
    )
    ys = _Adjoint.apply(cfg, y0, t, *params)
    return ys if parts is None else parts.split(ys)


def _largest_rms(xs: Sequence[torch.Tensor]) -> Any:
    return max((x.abs().pow(2).mean().sqrt() for x in xs), default=0.0)


def _adjoint_norm(norm: Any, state_norm: Callable, parts: _Parts | None) -> Callable:
    """The backward solve's error norm of ``(τ, y, a, *g)``, as torchdiffeq's ``odeint_adjoint`` builds it."""
    if norm is None:
        return lambda s: max(s[0].abs(), state_norm(s[1]), state_norm(s[2]), _largest_rms(s[3:]))
    if norm == "seminorm":
        return lambda s: max(s[0].abs(), state_norm(s[1]), state_norm(s[2]))
    if parts is None:
        return norm
    return lambda s: norm((s[0], *parts.split(s[1], ()), *parts.split(s[2], ()), *s[3:]))


def _real(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(x) if x.is_complex() else x


class _Augmented:
    """``(τ, y, a, g)' = (−aᵀ∂F/∂t, F, −aᵀ∂F/∂y, −aᵀ∂F/∂θ)``; the field's ``callback_*_adjoint`` as its callbacks.
    With ``swap`` (:func:`param_swap`), every part is computed with a graph (a second derivative differentiates
    the backward solve)."""

    def __init__(self, func, params: tuple[torch.Tensor, ...], original, swap: Callable | None = None):
        self.func, self.params, self.swap, self.graph = func, params, swap, swap is not None
        for name in _CALLBACKS:
            callback = getattr(original, f"{name}_adjoint", None)
            if callback is not None:
                setattr(self, name, callback)

    def __call__(self, t: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        a = state[2]
        if self.graph:
            return self._with_graph(t, state)
        with torch.enable_grad():
            # τ integrates −aᵀ∂F/∂t whether or not `t` requires grad, as torchdiffeq's: its norm measures τ
            t = t.detach().requires_grad_(True)
            y = state[1].detach().requires_grad_(True)
            f = self.func(t, y)
            wrt = (t, y, *self.params)
            grads: Sequence[torch.Tensor | None] = (None,) * len(wrt)
            if f.requires_grad:
                grads = torch.autograd.grad(f, wrt, -a, allow_unused=True)
        vjps = tuple(torch.zeros_like(x) if v is None else v for x, v in zip(wrt, grads))
        return (vjps[0].to(state[0].dtype), f.detach(), *vjps[1:])

    def _with_graph(self, t: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # partial derivatives at this (t, y, θ): the state's history depends on θ too, so autograd's gradient with
        # respect to θ would be the total one; torch.func's vjp takes θ as arguments, swapped into the field
        swap = cast(Callable, self.swap)

        def call(s: torch.Tensor, y: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
            return swap(params)(s, y)

        with torch.enable_grad():
            f, pull = vjp(call, t.detach(), state[1], *self.params)[:2]
            vjps = pull(-state[2])
        return (vjps[0].to(state[0].dtype), f, *vjps[1:])


def param_swap(func: Any, params: Sequence[torch.Tensor]) -> Callable[[Sequence[torch.Tensor]], Callable] | None:
    """``func`` with ``params`` swapped for given tensors where the field holds them (a module's parameter, an
    attribute, a closure variable, a dict or list entry: :mod:`solvers.gradients.vmap_adjoint`), or ``None`` where
    one of them is held elsewhere."""
    inner = func
    while not isinstance(inner, Counted) and hasattr(inner, "func"):
        inner = inner.func
    slots = _slots(inner.field if isinstance(inner, Counted) else inner)
    groups = [[sl for sl in slots if sl.get() is p] for p in params]
    if not all(groups):
        return None
    swapped = _Swapped(func, groups, params)
    return swapped.with_tensors


def adjoint_with_graph(
    func: Callable,
    original: Any,
    t: torch.Tensor,
    ys: torch.Tensor,
    grad_ys: torch.Tensor,
    params: Sequence[torch.Tensor],
    swap: Callable[[Sequence[torch.Tensor]], Callable],
    *,
    rtol: Any,
    atol: Any,
    method: str,
    options: Mapping,
) -> tuple[torch.Tensor, ...]:
    """``(∂ℒ/∂y_0, *∂ℒ/∂θ)`` by the adjoint solve backwards from ``ys`` (the forward solution at the increasing or
    decreasing times ``t``, which need no gradient) and ``grad_ys`` (``∂ℒ/∂ys``), computed with a graph: every
    field evaluation and every step of the backward solve is recorded, so autograd differentiates the gradient
    with respect to ``ys``, ``grad_ys`` and ``params`` (a second derivative, right to the backward solve's
    tolerance). ``swap``: :func:`param_swap` of ``func`` and ``params``. ``options``: the backward solve's, its
    ``norm`` of the state ``(τ, y, a, *g)``."""
    real = ys.real.dtype if ys.is_complex() else ys.dtype
    dyn = _Augmented(func, tuple(params), original, swap)
    land = bool(getattr(original, "backward_jumps", None))
    state: list[torch.Tensor] = [torch.zeros((), dtype=real, device=ys.device), ys[-1], grad_ys[-1]]
    state += [torch.zeros_like(p) for p in params]
    for i in range(len(t) - 1, 0, -1):
        span = t[i - 1 : i + 1].flip(0)
        out = odeint_rk(dyn, tuple(state), span, rtol=rtol, atol=atol, method=method, options=options,
                        land_on_jumps=land)  # fmt: skip
        state = [s[1] for s in out]
        state[1] = ys[i - 1]
        state[2] = state[2] + grad_ys[i - 1]
    return tuple(state[2:])


#: why the adjoint refuses a second derivative it does not serve
NOT_SERVED = (
    "gradient='adjoint' serves a second derivative under torch.autograd (its backward solve recomputed with a "
    "graph) for gradients with respect to y0 and to tensors the field holds as a module parameter, an attribute, a "
    "closure variable or a dict or list entry, over whole tensors; not with respect to `t`, to piecewise "
    "parameters, or to a tensor held elsewhere. Use gradient='backprop' (autograd differentiates the solve itself, "
    "to any order) for this one."
)


def _second_order(ctx: Any, cotangents: tuple, outs: tuple) -> tuple | str:
    """The adjoint's second derivative: its backward solve recomputed with a graph (not for gradients in ``t``)."""
    if ctx.needs_input_grad[2]:
        return NOT_SERVED
    cfg = ctx.cfg
    t, ys, *params = ctx.saved_tensors
    t = t.detach()
    params = [p for p in params if p.requires_grad]
    swap = param_swap(cfg["func"], params)
    if swap is None:
        return NOT_SERVED

    def recompute(free: list[torch.Tensor], params: list[torch.Tensor]) -> tuple:
        ys, grad_ys = free
        kw = dict(rtol=cfg["adjoint_rtol"], atol=cfg["adjoint_atol"], method=cfg["adjoint_method"])
        a, *g = adjoint_with_graph(cfg["func"], cfg["original"], t, ys, grad_ys, params, swap,
                                   options=cfg["adjoint_options"], **kw)  # fmt: skip
        return (None, a, None, *g)

    return served("adjoint", outs, [ys, cotangents[0]], params, recompute)


class _Adjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: dict, y0: torch.Tensor, t: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            ys = odeint_rk(
                cfg["func"],
                y0,
                t.detach(),
                rtol=cfg["rtol"],
                atol=cfg["atol"],
                method=cfg["method"],
                options=cfg["options"],
                graph=False,
            )
        ctx.cfg = cfg
        ctx.save_for_backward(t, ys, *params)
        remember_inputs(ctx, y0, t, *params)
        return ys

    @staticmethod
    @first_order("adjoint", serve=_second_order)
    def backward(ctx, grad_ys: torch.Tensor):
        cfg = ctx.cfg
        t, ys, *params = ctx.saved_tensors
        t = t.detach()
        func, t_grad = cfg["func"], ctx.needs_input_grad[2]
        real = ys.real.dtype if ys.is_complex() else ys.dtype
        dyn = _Augmented(func, tuple(params), cfg["original"])
        land = bool(getattr(cfg["original"], "backward_jumps", None))
        state: list[torch.Tensor] = [torch.zeros((), dtype=real, device=ys.device), ys[-1], grad_ys[-1]]
        state += [torch.zeros_like(p) for p in params]
        time_vjps = torch.empty(len(t), dtype=t.dtype, device=t.device) if t_grad else None
        for i in range(len(t) - 1, 0, -1):
            if time_vjps is not None:
                with torch.no_grad():
                    d = _real(func(t[i].to(real), ys[i])).reshape(-1).dot(_real(grad_ys[i]).reshape(-1))
                state[0] = state[0] - d
                time_vjps[i] = d
            out = odeint_rk(
                dyn,
                tuple(state),
                t[i - 1 : i + 1].flip(0),
                rtol=cfg["adjoint_rtol"],
                atol=cfg["adjoint_atol"],
                method=cfg["adjoint_method"],
                options=cfg["adjoint_options"],
                graph=False,
                land_on_jumps=land,
            )
            state = [s[1] for s in out]
            state[1] = ys[i - 1]
            state[2] = state[2] + grad_ys[i - 1]
        if time_vjps is not None:
            time_vjps[0] = state[0]
        return (None, state[2], time_vjps, *state[3:])
