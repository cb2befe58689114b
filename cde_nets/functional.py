r"""torchdiffeq's functions on this library's engine: ``from cde_nets import odeint`` in place of
``from torchdiffeq import odeint``.

:func:`odeint`, :func:`odeint_adjoint` and :func:`odeint_event` take torchdiffeq's arguments, defaults
(``rtol=1e-7``, ``atol=1e-9``, ``method="dopri5"``) and return types, and solve ``dy/dt = func(t, y)``,
``y(t[0]) = y0`` (Chen et al. 2018, "Neural ordinary differential equations") for a state ``y0`` that is a tensor
of any shape or a tuple of them, at times ``t`` increasing or decreasing from any start. Beneath them:

- the state is flattened to one tensor and decreasing times are negated (``s = −t``, ``dy/ds = −func(−s, y)``), so
  the engine always integrates one tensor forwards: the fast Runge-Kutta path (:mod:`solvers.fast_rk`) serves
  every such call it implements, the piecewise seminorm adjoint (:mod:`solvers.piecewise_adjoint`) the adjoint,
  and the replayed gradients (:mod:`solvers.replay`) ``gradient="checkpoint"``/``"symplectic"``; the implicit
  Runge-Kutta methods run on the library's Newton solver with torchdiffeq's fixed-grid semantics
  (:mod:`solvers.implicit_grid`);
- gradients with respect to ``t`` come from :mod:`solvers.output_times` in every gradient mode;
- events are located by torchdiffeq's root finder and differentiated by the implicit function theorem here.

Where the engine lacks a method or an option (the Adams methods, ``scipy_solver``; ``dtype``, ``interp="cubic"``,
a complex state) the flattened, forwards problem goes to torchdiffeq's own solver. Deliberate differences from
torchdiffeq (unknown options raise, the adjoint's default norm, ...) are listed in
``docs/guides/from_torchdiffeq.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from cde_nets.solvers.dropin import (
    ADAPTIVE,
    CALLBACKS,
    FIXED,
    IMPLICIT,
    Problem,
    flip_options,
    kind,
    solve_flat,
    tolerance,
    unflatten,
)
from cde_nets.solvers.errors import SolverError
from cde_nets.solvers.gradients import Adjoint, GradientMethod, as_gradient
from cde_nets.solvers.implicit_grid import IMPLICIT_GRID_OPTIONS, ImplicitGrid, implicit_until_event
from cde_nets.solvers.output_times import with_output_times, with_start_time
from cde_nets.solvers.per_sample import odeint_per_sample
from cde_nets.solvers.torchdiffeq_methods import torchdiffeq_method

__all__ = ["odeint", "odeint_adjoint", "odeint_event", "METHODS"]

State = torch.Tensor | tuple[torch.Tensor, ...]
METHODS = (*ADAPTIVE, *FIXED, *IMPLICIT, "scipy_solver")

_ADAPTIVE_OPTIONS = {
    "first_step",
    "min_step",
    "max_step",
    "safety",
    "ifactor",
    "dfactor",
    "step_t",
    "jump_t",
    "max_num_steps",
    "norm",
    "dtype",
}
_FIXED_OPTIONS = {"step_size", "grid_constructor", "perturb", "interp", "max_num_steps", "norm"}
_ADAMS_OPTIONS = _FIXED_OPTIONS | {"max_iters", "max_order"}
_SCIPY_OPTIONS = {"solver", "min_step", "max_step", "norm"}
_GRADIENTS = ("backprop", "adjoint", "checkpoint", "symplectic")
# the options the fast path reads (after step_size became a grid constructor)


def _valid_options(method: str) -> set[str]:
    if method in ADAPTIVE:
        return _ADAPTIVE_OPTIONS
    if method in ("implicit_adams", "fixed_adams"):
        return _ADAMS_OPTIONS
    if method in IMPLICIT:
        return set(IMPLICIT_GRID_OPTIONS)
    return _SCIPY_OPTIONS if method == "scipy_solver" else _FIXED_OPTIONS


def _check_method(method: str | None, name: str = "method") -> str:
    method = "dopri5" if method is None else method
    if method not in METHODS:
        raise ValueError(f"`{name}`={method!r} is unknown; choose one of {sorted(METHODS)}.")
    return method


def _check_options(method: str, options: dict | None, name: str = "options") -> dict:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"`{name}` must be a dict, got {type(options).__name__}.")
    unknown = set(options) - _valid_options(method)
    if unknown:
        raise ValueError(
            f"unknown key(s) {sorted(unknown)} in `{name}` for method {method!r} (torchdiffeq would only warn and "
            f"ignore them); valid: {sorted(_valid_options(method))}."
        )
    return dict(options)


def _check_state(y0: Any) -> tuple[torch.Tensor, list[torch.Size] | None]:
    """The state as one flat tensor (a tuple's parts concatenated) and the parts' shapes (``None``: a tensor)."""
    if isinstance(y0, torch.Tensor):
        return y0, None
    if not isinstance(y0, tuple) or not y0 or not all(isinstance(y, torch.Tensor) for y in y0):
        raise TypeError(f"`y0` must be a tensor or a tuple of tensors, got {type(y0).__name__}.")
    if len({y.dtype for y in y0}) > 1 or len({y.device for y in y0}) > 1:
        raise ValueError("the tensors of a tuple `y0` must share one dtype and device; cast them first.")
    return torch.cat([y.reshape(-1) for y in y0]), [y.shape for y in y0]


def _check_times(t: Any, y0: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or len(t) == 0 or not t.is_floating_point():
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"`t` must be a 1-D floating-point tensor of at least one time, got {got}.")
    d = t.detach()
    if len(d) > 1 and not (bool((d[1:] > d[:-1]).all()) or bool((d[1:] < d[:-1]).all())):
        raise ValueError("`t` must be strictly increasing or strictly decreasing.")
    return t.to(y0.device)


def _params(func: Callable, adjoint_params: Sequence[torch.Tensor] | None, gradient: str) -> tuple[torch.Tensor, ...]:
    if adjoint_params is None:
        if not isinstance(func, nn.Module):
            raise ValueError(
                f"gradient={gradient!r} differentiates the parameters it is given: `func` is not an nn.Module, so "
                "pass them as `adjoint_params=(...)` (`adjoint_params=()` if there are none)."
            )
        adjoint_params = tuple(func.parameters())
    return tuple(p for p in adjoint_params if p.requires_grad)


def _solve(
    func: Callable,
    y0: State,
    t: torch.Tensor,
    *,
    rtol: Any,
    atol: Any,
    method: str | None,
    options: dict | None,
    gradient: str | GradientMethod,
    adjoint_params: Sequence[torch.Tensor] | None,
    adjoint: dict | None,
) -> State:
    """The solution at ``t`` of the normalised problem, in the user's shapes, with the times' gradients."""
    if not callable(func):
        raise TypeError(f"`func` must be callable as func(t, y), got {type(func).__name__}.")
    method_object = gradient if isinstance(gradient, GradientMethod) else None
    gradient = gradient.name if isinstance(gradient, GradientMethod) else gradient
    if gradient not in _GRADIENTS:
        raise ValueError(f"`gradient` must be one of {_GRADIENTS}, got {gradient!r}.")
    method = _check_method(method)
    options = _check_options(method, options)
    flat, shapes = _check_state(y0)
    t = _check_times(t, flat)
    _warn_callbacks(func, method)
    params = _params(func, adjoint_params, gradient) if gradient != "backprop" else ()
    rtol, atol = tolerance(rtol, shapes, "rtol"), tolerance(atol, shapes, "atol")
    sign = -1.0 if len(t) > 1 and bool(t[0] > t[1]) else 1.0
    max_num_steps = options.pop("max_num_steps", None)
    problem = Problem(func, shapes, sign, max_num_steps, kind(method))
    t_grad = t.requires_grad and torch.is_grad_enabled()
    forward_func = Problem(func, shapes) if t_grad else None  # for the times' gradients, in the user's time
    if forward_func is not None:
        flat = with_start_time(forward_func, flat, t[0])
    if len(t) == 1:
        ys = flat.unsqueeze(0).clone()
    else:
        opts = flip_options(options, sign, shapes)
        adj = dict(adjoint or {})
        if gradient == "adjoint":
            adj["options"] = flip_options(adj["options"], sign, shapes, adjoint=True)
        try:
            ys = solve_flat(
                problem,
                flat,
                t.detach() * sign,
                rtol=rtol,
                atol=atol,
                method=method,
                options=opts,
                gradient=method_object or as_gradient(gradient),
                params=params,
                adjoint=adj,
            )
        except AssertionError as exc:
            raise SolverError(f"the solver stopped: {str(exc)[:300]}. Loosen `rtol`/`atol` or use float64.") from exc
    if forward_func is not None:
        ys = with_output_times(forward_func, ys, t)
    return unflatten(ys, shapes, (len(t),))


def _warn_callbacks(func: Callable, method: str) -> None:
    """torchdiffeq warns when ``func`` has callbacks the method never calls; so does this."""
    names = {n for n in CALLBACKS if getattr(func, n, None) is not None}
    fixed = method in FIXED or method in IMPLICIT
    unused = names if method == "scipy_solver" else names - ({"callback_step"} if fixed else set(CALLBACKS))
    if unused:
        warnings.warn(f"method {method!r} never calls {sorted(unused)} of `func`.", stacklevel=3)


def odeint(
    func: Callable,
    y0: State,
    t: torch.Tensor,
    *,
    rtol: Any = 1e-7,
    atol: Any = 1e-9,
    method: str | None = None,
    options: dict | None = None,
    event_fn: Callable | None = None,
    gradient: str | GradientMethod = "backprop",
    adjoint_params: Sequence[torch.Tensor] | None = None,
    controller: str = "batch",
) -> Any:
    """Solve ``dy/dt = func(t, y)``, ``y(t[0]) = y0`` at the times ``t``: torchdiffeq's ``odeint``.

    Args:
        func: ``func(t, y)``, ``t`` a 0-d tensor, ``y`` shaped like ``y0`` (a tuple for a tuple ``y0``).
        y0: the initial state at ``t[0]``: a tensor of any shape, or a tuple of tensors.
        t: 1-D tensor of times, strictly increasing or decreasing; ``t[0]`` is the start. May require grad.
        rtol, atol: tolerances of adaptive methods (per part of a tuple state as tuples).
        method: ``"dopri5"`` (default), ``"tsit5"``, ``"dopri8"``, ``"bosh3"``, ``"fehlberg2"``,
            ``"adaptive_heun"``, ``"euler"``, ``"midpoint"``, ``"heun2"``, ``"heun3"``, ``"rk4"``,
            ``"explicit_adams"``, ``"implicit_adams"``, ``"fixed_adams"``, ``"scipy_solver"``, or an implicit
            Runge-Kutta method on a fixed grid (torchdiffeq master's): ``"implicit_euler"``,
            ``"implicit_midpoint"``, ``"trapezoid"``, ``"gl4"``, ``"gl6"``, ``"radauIIA3"``, ``"radauIIA5"``,
            ``"sdirk2"``, ``"trbdf2"`` (:mod:`~cde_nets.solvers.implicit_grid`).
        options: torchdiffeq's method options; unknown keys raise ``ValueError``. The implicit methods take
            ``step_size``/``grid_constructor``, ``perturb``, ``interp`` and their Newton solve's ``max_iters``
            (default 50), ``newton`` (``"simplified"``, ``"full"``, ``"fixed_point"``) and ``newton_tol``
            (default: to rounding).
        event_fn: ``g(t, y)``: integrate from ``t[0]`` until ``g = 0`` instead (``t[1:]`` ignored); returns
            ``(event_t, solution)``, ``solution`` holding ``y0`` and the state at the event. Both differentiable.
        gradient: this library's addition: ``"backprop"`` (default, torchdiffeq's), ``"adjoint"``,
            ``"checkpoint"`` or ``"symplectic"`` (exact gradients of the steps at low memory; the implicit methods
            take ``"backprop"``, ``"checkpoint"`` and ``"adjoint"``, each step by the implicit function theorem), or
            the gradient
            method object (``Adjoint(rtol=1e-9)`` sets the backward solve as ``odeint_adjoint``'s ``adjoint_*``).
        adjoint_params: the tensors differentiated by the gradients other than ``"backprop"`` (default: ``func``'s
            parameters).
        controller: this library's addition: ``"batch"`` (default: one step size for the whole batch,
            torchdiffeq's steps) or ``"per_sample"``: every sample of the batch (``y0``'s first axis) on its own
            step size, ``func`` called with ``t`` of shape ``(batch,)``, ``t`` of shape ``(n,)`` or ``(batch, n)``
            (:func:`~cde_nets.solvers.per_sample.odeint_per_sample`; ``dopri5``/``bosh3``).

    Returns:
        ``(len(t), *y0.shape)`` (a tuple of them for a tuple ``y0``); with ``event_fn``, ``(event_t, solution)``.
    """
    if controller != "batch":
        return _per_sample(func, y0, t, rtol, atol, method, options, event_fn, gradient, controller, adjoint_params)
    if isinstance(gradient, GradientMethod):
        if isinstance(gradient, Adjoint):
            if not gradient.seminorm:
                raise ValueError(
                    "Adjoint(seminorm=False) in `odeint`: pass a full norm as odeint_adjoint's "
                    "`adjoint_options={'norm': ...}` instead."
                )
            return odeint_adjoint(
                func,
                y0,
                t,
                rtol=rtol,
                atol=atol,
                method=method,
                options=options,
                event_fn=event_fn,
                adjoint_rtol=gradient.rtol,
                adjoint_atol=gradient.atol,
                adjoint_method=gradient.method,
                adjoint_params=adjoint_params,
            )
    if gradient == "adjoint":
        kw = dict(rtol=rtol, atol=atol, method=method, options=options, event_fn=event_fn)
        return odeint_adjoint(func, y0, t, adjoint_params=adjoint_params, **kw)
    if event_fn is not None:
        return _until_event(func, y0, t, event_fn, rtol, atol, method, options, gradient, adjoint_params, None)
    return _solve(
        func,
        y0,
        t,
        rtol=rtol,
        atol=atol,
        method=method,
        options=options,
        gradient=gradient,
        adjoint_params=adjoint_params,
        adjoint=None,
    )


def _per_sample(func, y0, t, rtol, atol, method, options, event_fn, gradient, controller, params) -> torch.Tensor:
    if controller != "per_sample":
        raise ValueError(f"`controller` must be 'batch' (one step for the batch) or 'per_sample'; got {controller!r}.")
    if event_fn is not None:
        raise ValueError("`event_fn` runs on the shared step; use controller='batch' with it.")
    if not isinstance(y0, torch.Tensor):
        raise ValueError("controller='per_sample' needs a tensor `y0` of shape (batch, *state), not a tuple.")
    kw = dict(rtol=rtol, atol=atol, method=method or "dopri5", options=options, gradient=gradient, params=params)
    return odeint_per_sample(func, y0, t, **kw)


def odeint_adjoint(
    func: Callable,
    y0: State,
    t: torch.Tensor,
    *,
    rtol: Any = 1e-7,
    atol: Any = 1e-9,
    method: str | None = None,
    options: dict | None = None,
    event_fn: Callable | None = None,
    adjoint_rtol: Any = None,
    adjoint_atol: Any = None,
    adjoint_method: str | None = None,
    adjoint_options: dict | None = None,
    adjoint_params: Sequence[torch.Tensor] | None = None,
) -> Any:
    """:func:`odeint` whose gradient is the continuous adjoint (Chen et al. 2018, eqs. 4-5): torchdiffeq's
    ``odeint_adjoint``, memory constant in the number of steps.

    ``adjoint_rtol``/``adjoint_atol``/``adjoint_method`` default to the forward ones; ``adjoint_options`` to the
    forward ``options`` less ``norm`` (as torchdiffeq: a different ``adjoint_method`` with ``options`` needs
    ``adjoint_options``). Only ``adjoint_params`` (default: ``func``'s parameters; required when ``func`` is not
    an ``nn.Module``) receive gradients. The backward solve's error norm is the seminorm (Kidger et al. 2021)
    unless ``adjoint_options["norm"]`` is a callable.
    """
    method = _check_method(method)
    adj_method = method if adjoint_method is None else _check_method(adjoint_method, "adjoint_method")
    if adj_method != method and options is not None and adjoint_options is None:
        raise ValueError(
            f"`adjoint_method`={adj_method!r} differs from `method`={method!r}, so `options` cannot serve the "
            "backward solve: pass `adjoint_options` too."
        )
    own = adjoint_rtol is None and adjoint_atol is None and adjoint_options in (None, options)
    if method in IMPLICIT and (adj_method != method or not own):
        raise ValueError(
            f"method={method!r} takes the discrete adjoint of its own steps (rebuilt backwards on the forward grid, "
            "differentiated by the implicit function theorem): leave `adjoint_method`, `adjoint_options`, "
            "`adjoint_rtol` and `adjoint_atol` unset."
        )
    if adjoint_options is None:
        adj_options = {k: v for k, v in (options or {}).items() if k not in ("norm", "max_num_steps")}
    else:
        adj_options = _check_options(adj_method, adjoint_options, "adjoint_options")
        if adj_options.get("norm") not in (None, "seminorm") and not callable(adj_options.get("norm")):
            raise ValueError("`adjoint_options['norm']` must be 'seminorm' or a callable.")
    adjoint = dict(
        rtol=rtol if adjoint_rtol is None else adjoint_rtol,
        atol=atol if adjoint_atol is None else adjoint_atol,
        method=adj_method,
        options=adj_options,
    )
    if event_fn is not None:
        return _until_event(func, y0, t, event_fn, rtol, atol, method, options, "adjoint", adjoint_params, adjoint)
    return _solve(
        func,
        y0,
        t,
        rtol=rtol,
        atol=atol,
        method=method,
        options=options,
        gradient="adjoint",
        adjoint_params=adjoint_params,
        adjoint=adjoint,
    )


def _until_event(func, y0, t, event_fn, rtol, atol, method, options, gradient, adjoint_params, adjoint):
    """``(event_t, solution)`` from ``t[0]`` until ``event_fn(t, y) = 0``.

    The event is located by torchdiffeq's root finder on the flattened, forwards problem, without a graph (for the
    implicit methods by :func:`~cde_nets.solvers.implicit_grid.implicit_until_event`, the same search); the
    state there is then solved for at that fixed time in the chosen gradient mode, and the implicit function
    theorem on ``g(t*, y(t*)) = 0`` gives the time's gradient,
    ``dt*/dθ = −(∂g/∂θ + ∂g/∂y ∂y/∂θ) / (∂g/∂t + ∂g/∂y F)``, and the state's, ``dy(t*)/dθ = ∂y/∂θ + F dt*/dθ``.
    """
    if not callable(event_fn):
        raise TypeError(f"`event_fn` must be callable as event_fn(t, y), got {type(event_fn).__name__}.")
    method = _check_method(method)
    opts = _check_options(method, options)
    flat, shapes = _check_state(y0)
    t = _check_times(t, flat)
    if len(t) < 2:
        raise ValueError("with `event_fn`, `t` needs two times: the start and any later (or earlier) time.")
    sign = -1.0 if bool(t[0] > t[1]) else 1.0
    problem = Problem(func, shapes, sign, opts.pop("max_num_steps", None), kind(method))

    def event(s, y):
        return event_fn(-s if sign < 0 else s, unflatten(y, shapes))

    if method in IMPLICIT:
        grid = ImplicitGrid(problem, method, flip_options(opts, sign, shapes))
        tol = float(atol) if isinstance(atol, float | int) else float(torch.as_tensor(atol).min())
        s_event, found = implicit_until_event(grid, flat.detach(), float(t[0].detach()) * sign, event, tol)
    else:
        s_event, found = _event_search(problem, flat, t, sign, shapes, rtol, atol, method, opts, event)
    t_star = (s_event.to(t.dtype) * sign).reshape(())
    if not torch.is_grad_enabled():
        return t_star, unflatten(found, shapes, (2,))
    return _event_state(
        func, y0, t, t_star, found, shapes, event_fn, rtol, atol, method, options, gradient, adjoint_params, adjoint
    )


def _event_search(problem, flat, t, sign, shapes, rtol, atol, method, opts, event):
    """torchdiffeq's event search on the flat, forwards problem, without a graph."""
    with torch.no_grad():
        try:
            from torchdiffeq import odeint as torchdiffeq_odeint  # here: torchdiffeq loads scipy

            s_event, found = torchdiffeq_odeint(
                problem,
                flat.detach(),
                t.detach()[:2] * sign,
                rtol=tolerance(rtol, shapes, "rtol"),
                atol=tolerance(atol, shapes, "atol"),
                method=torchdiffeq_method(method),
                options=flip_options(opts, sign, shapes),
                event_fn=event,
            )
        except AssertionError as exc:
            raise SolverError(f"the event search stopped: {str(exc)[:300]}.") from exc
    return s_event, found


def _event_state(
    func, y0, t, t_star, found, shapes, event_fn, rtol, atol, method, options, gradient, adjoint_params, adjoint
):
    """``(event_t, solution)`` differentiable by the implicit function theorem on ``g(t*, y(t*)) = 0``."""
    # the state at the fixed time t*, differentiable in the chosen mode; its value is the search's own
    times = torch.stack([t[0], t_star])
    kwargs: dict[str, Any] = dict(rtol=rtol, atol=atol, method=method, options=options)
    if gradient == "adjoint":
        sol = odeint_adjoint(func, y0, times, adjoint_params=adjoint_params, **_adjoint_kwargs(adjoint), **kwargs)
    else:
        sol = odeint(func, y0, times, gradient=gradient, adjoint_params=adjoint_params, **kwargs)
    y_sol = sol if shapes is None else torch.cat([s.reshape(2, -1) for s in sol], dim=1)
    y_sol = found + (y_sol - y_sol.detach())
    y_star = y_sol[-1]
    with torch.enable_grad():
        tt = t_star.detach().requires_grad_(True)
        g = event_fn(tt, unflatten(y_star, shapes))
        f = Problem(func, shapes)(tt.detach(), y_star.detach())
        yd = y_star.detach().requires_grad_(True)
        g_t, g_y = torch.autograd.grad(event_fn(tt, unflatten(yd, shapes)), (tt, yd), allow_unused=True)
    dg = torch.zeros((), dtype=t.dtype, device=t.device)
    dg = dg + (0.0 if g_t is None else g_t.to(t.dtype)) + (0.0 if g_y is None else (g_y * f).sum().to(t.dtype))
    event_t = t_star.detach() - (g - g.detach()).to(t.dtype) / dg.detach().to(t.dtype)
    y_event = y_star + f * (event_t - event_t.detach()).to(y_star.dtype)
    out = torch.cat([y_sol[:-1], y_event.unsqueeze(0)])
    return event_t, unflatten(out, shapes, (2,))


def _adjoint_kwargs(adjoint: dict) -> dict:
    return dict(
        adjoint_rtol=adjoint["rtol"],
        adjoint_atol=adjoint["atol"],
        adjoint_method=adjoint["method"],
        adjoint_options=adjoint["options"],
    )


def odeint_event(
    func: Callable,
    y0: State,
    t0: torch.Tensor,
    *,
    event_fn: Callable,
    reverse_time: bool = False,
    odeint_interface: Callable = odeint,
    **kwargs: Any,
) -> tuple[torch.Tensor, State]:
    """Integrate from ``t0`` (forwards, or backwards with ``reverse_time``) until ``event_fn(t, y) = 0``, with no
    end time: torchdiffeq's ``odeint_event``. Returns ``(event_t, solution)``, ``solution`` holding ``y0`` and the
    state at the event; gradients reach both through ``t0``, ``y0``, the parameters and ``event_fn``'s own.
    ``odeint_interface``: :func:`odeint` or :func:`odeint_adjoint`; ``kwargs`` go to it."""
    t0 = torch.as_tensor(t0)
    step = -1.0 if reverse_time else 1.0
    t = torch.cat([t0.reshape(-1), t0.detach().reshape(-1) + step])
    if odeint_interface not in (odeint, odeint_adjoint):
        raise ValueError("`odeint_interface` must be cde_nets.odeint or cde_nets.odeint_adjoint.")
    return odeint_interface(func, y0, t, event_fn=event_fn, **kwargs)
