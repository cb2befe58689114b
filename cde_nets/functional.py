r"""torchdiffeq's functions on this library's engine: ``from cde_nets import odeint`` in place of
``from torchdiffeq import odeint``.

:func:`odeint`, :func:`odeint_adjoint` and :func:`odeint_event` take torchdiffeq's arguments, defaults
(``rtol=1e-7``, ``atol=1e-9``, ``method="dopri5"``) and return types, and solve ``dy/dt = func(t, y)``,
``y(t[0]) = y0`` (Chen et al. 2018, "Neural ordinary differential equations") for a state ``y0`` that is a tensor
of any shape or a tuple of them, at times ``t`` increasing or decreasing from any start. Beneath them:

- the state is flattened to one tensor and decreasing times are negated (``s = −t``, ``dy/ds = −func(−s, y)``), so
  the engine always integrates one tensor forwards: the fast Runge-Kutta path (:mod:`solvers.steppers.fast_rk`) serves
  every such call it implements, the piecewise seminorm adjoint (:mod:`solvers.gradients.piecewise_adjoint`) the
  adjoint, and the replayed gradients (:mod:`solvers.gradients.replay`) ``gradient="checkpoint"``/``"symplectic"``; the
  implicit Runge-Kutta methods run on the library's Newton solver with torchdiffeq's fixed-grid semantics
  (:mod:`solvers.steppers.implicit_grid`);
- gradients with respect to ``t`` come from :mod:`solvers.output_times` in every gradient mode;
- events are located by torchdiffeq's search (bisection on the step's dense output) run on the library's stepper
  (:mod:`solvers.steppers.rk_events`) and differentiated by the implicit function theorem here, the whole state
  stopping at the first event; with ``event_mode="per_sample"`` each sample stops at its own, by the loop
  ``ODEBlock.solve(y0, event=g)`` runs (:func:`~solvers.events.per_sample_events`), which also gives
  :func:`odeint_dense`.

Every explicit Runge-Kutta method runs on the library's stepper, complex states included; only the methods the
engine lacks (the Adams methods, ``scipy_solver``) go to torchdiffeq's public ``odeint``. Deliberate differences from
torchdiffeq (unknown options raise, the adjoint's default norm, ...) are listed in
``docs/guides/from_torchdiffeq.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from cde_nets.blocks.nonfinite import Watch, check_result
from cde_nets.solvers.adapter import integrate
from cde_nets.solvers.controllers import Controller, Integral, as_controller
from cde_nets.solvers.dropin import (
    ADAPTIVE,
    CALLBACKS,
    FIXED,
    IMPLICIT,
    Problem,
    flip_options,
    kind,
    solve_flat,
    state_norm,
    tolerances,
    unflatten,
)
from cde_nets.solvers.engine import check_cell, check_events
from cde_nets.solvers.errors import Reason, SolverError
from cde_nets.solvers.events import HermiteDense, per_sample_events
from cde_nets.solvers.gradients import GRADIENTS, Adjoint, Backprop, GradientMethod, as_gradient, gradient_names
from cde_nets.solvers.grids import aligned_grid
from cde_nets.solvers.options import (
    IMPLICIT_METHODS,
    REVERSIBLE_METHODS,
    REVERSIBLE_RK_METHODS,
    SPLIT_METHODS,
    SolverOptions,
    check_autocast_method,
    check_shared_controller,
    is_adaptive,
)
from cde_nets.solvers.output_times import with_output_times, with_start_time
from cde_nets.solvers.per_sample.solve import odeint_per_sample
from cde_nets.solvers.precision import autocast_field, check_autocast, check_autocast_state
from cde_nets.solvers.steppers.implicit_grid import IMPLICIT_GRID_OPTIONS, ImplicitGrid, implicit_until_event
from cde_nets.solvers.steppers.methods import RK_METHODS
from cde_nets.solvers.steppers.reversible_rk import OPTIONS as REVERSIBLE_RK_OPTIONS
from cde_nets.solvers.steppers.rk_events import odeint_event_rk
from cde_nets.solvers.transforms import PER_SAMPLE_UNDER_VMAP, differentiated, host_all, under_vmap
from cde_nets.solvers.validation import check_event_output, check_output_times, check_state, nonfinite_message

__all__ = ["odeint", "odeint_adjoint", "odeint_dense", "odeint_event", "METHODS"]

State = torch.Tensor | tuple[torch.Tensor, ...]
# the event search's step limit when `options` set no `max_num_steps` (torchdiffeq's search has none, so an event
# that never changes sign runs it for ever): the blocks' `max_steps` default
EVENT_MAX_STEPS = 100_000
# every method name odeint takes, read live from the registered tableaux (a new tableau is served at once)
# (name -> order; scipy_solver's 0: the order is that of the scipy method it is given)
METHODS = RK_METHODS.with_extra(
    {
        **{m: FIXED[m] for m in FIXED if m not in RK_METHODS},
        **IMPLICIT_METHODS,
        **REVERSIBLE_METHODS,
        **SPLIT_METHODS,
        "scipy_solver": 0,
    }
)

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
    "compile",  # this library's: each step one compiled graph (solvers.steppers.compiled)
}
_FIXED_OPTIONS = {"step_size", "grid_constructor", "perturb", "interp", "max_num_steps", "norm", "compile"}
_ADAMS_OPTIONS = _FIXED_OPTIONS | {"max_iters", "max_order"}
_SCIPY_OPTIONS = {"solver", "min_step", "max_step", "norm"}
# the library's reversible integrator (adaptive, or fixed with `step_size`) and symplectic compositions
_ALF_OPTIONS = {"eta", "first_step", "max_step", "safety", "ifactor", "dfactor", "step_size", "max_num_steps"}
_SPLIT_OPTIONS = {"step_size", "max_num_steps"}
# the options the fast path reads (after step_size became a grid constructor)


def _valid_options(method: str) -> set[str]:
    if method in ADAPTIVE:
        return _ADAPTIVE_OPTIONS
    if method in ("implicit_adams", "fixed_adams"):
        return _ADAMS_OPTIONS
    if method in IMPLICIT:
        return set(IMPLICIT_GRID_OPTIONS)
    if method in REVERSIBLE_RK_METHODS:
        return REVERSIBLE_RK_OPTIONS | {"step_size", "max_num_steps"}
    if method in REVERSIBLE_METHODS:
        return _ALF_OPTIONS
    if method in SPLIT_METHODS:
        return _SPLIT_OPTIONS
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
    # the shared step's controller object, put there by `controller=` (an adaptive method's, checked there)
    own = {"controller"} if isinstance(options.get("controller"), Controller) and method in ADAPTIVE else set()
    if not isinstance(options.get("compile", False), bool):
        raise TypeError(f"`{name}['compile']` must be True or False, got {options['compile']!r}.")
    if options.get("compile") is False:  # the default, said explicitly: nothing for the solvers to read
        options = {k: v for k, v in options.items() if k != "compile"}
    unknown = set(options) - _valid_options(method) - own
    if unknown:
        raise ValueError(
            f"unknown key(s) {sorted(unknown)} in `{name}` for method {method!r} (torchdiffeq would only warn and "
            f"ignore them); valid: {sorted(_valid_options(method))}."
        )
    return dict(options)


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
    if gradient not in gradient_names():
        raise ValueError(f"`gradient` must be one of {gradient_names()}, got {gradient!r}.")
    method = _check_method(method)
    options = _check_options(method, options)
    flat, shapes = check_state(y0, method, method in ADAPTIVE)
    t = check_output_times(t, flat.device)
    _warn_callbacks(func, method)
    chosen = method_object or as_gradient(gradient)
    params = () if isinstance(chosen, Backprop) else _params(func, adjoint_params, gradient)
    rtol, atol = tolerances(rtol, atol, shapes)
    if flat.numel() == 0:  # an empty batch: nothing to integrate; one evaluation joins it to func's graph
        y = flat + 0 * Problem(func, shapes)(t[0], flat)
        return unflatten(y.unsqueeze(0).expand(len(t), *y.shape), shapes, (len(t),))
    sign = -1.0 if len(t) > 1 and host_all(t[0] > t[1]) else 1.0  # under torch.vmap: every instance's order
    max_num_steps = options.pop("max_num_steps", None)
    problem = Problem(func, shapes, sign, max_num_steps, kind(method))
    # a vmap wrapper's requires_grad hides a grad level's, and a jvp level's tangent shows in no requires_grad
    t_grad = differentiated(t) and torch.is_grad_enabled()
    forward_func = Problem(func, shapes) if t_grad else None  # for the times' gradients, in the user's time
    if forward_func is not None:
        flat = with_start_time(forward_func, flat, t[0])
    if len(t) == 1:
        ys = flat.unsqueeze(0).clone()
    else:
        opts = state_norm(flip_options(options, sign, shapes), shapes, method)
        adj = dict(adjoint or {})
        if isinstance(chosen, Adjoint):
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
                gradient=chosen,
                params=params,
                adjoint=adj,
            )
        except AssertionError as exc:
            raise _stopped(exc, problem, flat, t.detach() * sign, rtol, atol, method, opts) from exc
        _check_solution(ys, problem, flat, t.detach() * sign, rtol, atol, method, opts)
    if forward_func is not None:
        ys = with_output_times(forward_func, ys, t)
    return unflatten(ys, shapes, (len(t),))


def _check_solution(ys: torch.Tensor, problem: Problem, *rerun: Any) -> None:
    """Refuse a non-finite solution, naming where the field first returned NaN/inf (one host read per solve: a
    NaN state stays NaN, so the solution's values say whether any step went non-finite)."""
    if not torch.compiler.is_compiling():
        check_result(ys, lambda: _nonfinite(problem, *rerun) or _NONFINITE)


def _stopped(exc: AssertionError, problem: Problem, *rerun: Any) -> SolverError:
    """The error of a solve that stopped on an assertion of the solver's: a step size that underflowed because
    the field returned NaN/inf (its error estimate is then NaN) says so, with where."""
    located = _nonfinite(problem, *rerun)
    if located is not None:
        return SolverError(located, reason=Reason.NONFINITE)
    text = str(exc)
    reason = Reason.UNDERFLOW if "underflow" in text else (Reason.NONFINITE if "non-finite" in text else Reason.OTHER)
    return SolverError(f"the solver stopped: {text[:300]}. Loosen `rtol`/`atol` or use float64.", reason=reason)


_NONFINITE = "the solve returned NaN/inf, though the field's values stayed finite in a re-run of it."


def _nonfinite(problem: Problem, y0: torch.Tensor, s: torch.Tensor, rtol, atol, method: str, opts: dict) -> str | None:
    """Where the forward solve of ``problem`` from ``y0`` at the engine's times ``s`` first met a non-finite field
    value, found by re-running it without gradients up to that evaluation; ``None`` if the field stays finite."""
    watch = Watch(problem.func, stop=True)
    rerun = Problem(watch, problem.shapes, problem.sign, problem.max_num_steps, problem.kind)
    rerun.with_rows, rerun.user = problem.with_rows, dict.fromkeys(problem.user)  # no user callbacks twice
    with torch.no_grad():
        try:
            solve_flat(rerun, y0.detach(), s, rtol=rtol, atol=atol, method=method, options=opts,
                       gradient=as_gradient("backprop"), params=(), adjoint={})  # fmt: skip
        except Exception:  # noqa: BLE001 - Found, or the re-run's own failure: the watch says what it saw
            pass
    if watch.t is None:
        return None
    fix = "use smaller steps (options={'step_size': ...}, or an adaptive method), shrink the weights or inputs, or "
    return nonfinite_message(watch.t, watch.first, "", fix + "use float64.")


def _warn_callbacks(func: Callable, method: str) -> None:
    """torchdiffeq warns when ``func`` has callbacks the method never calls; so does this."""
    names = {n for n in CALLBACKS if getattr(func, n, None) is not None}
    fixed = method in FIXED or method in IMPLICIT
    unused = names if method == "scipy_solver" else names - ({"callback_step"} if fixed else set(CALLBACKS))
    if unused:
        warnings.warn(f"method {method!r} never calls {sorted(unused)} of `func`.", stacklevel=3)


def _autocast(
    func: Callable, y0: State, method: str | None, options: dict | None, rtol: Any, adjoint_rtol: Any = None
) -> tuple[Callable, dict | None]:
    """``options["autocast"]`` (:mod:`~cde_nets.solvers.precision`): ``func`` evaluated under ``torch.autocast``
    in that dtype, its output in the state's, and the options without it; refused, naming the fix, where it
    cannot serve (a dtype, state, method or adaptive ``rtol`` it does not). Unchanged without it."""
    if not isinstance(options, dict) or "autocast" not in options:
        return func, options
    options = dict(options)
    dtype, method = options.pop("autocast"), _check_method(method)
    adaptive = is_adaptive(method, options.get("step_size"))
    check_autocast(dtype, rtol if adaptive else None, "options['autocast']")
    if adjoint_rtol is not None and adaptive:
        check_autocast(dtype, adjoint_rtol, "options['autocast']", "adjoint_rtol")
    check_autocast_method(dtype, method)
    if isinstance(y0, torch.Tensor) or (isinstance(y0, tuple) and y0 and isinstance(y0[0], torch.Tensor)):
        check_autocast_state(dtype, y0 if isinstance(y0, torch.Tensor) else y0[0], "options['autocast']")
    return autocast_field(func, dtype), options


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
    controller: str | Controller = "batch",
    event_mode: str = "first",
) -> Any:
    """Solve ``dy/dt = func(t, y)``, ``y(t[0]) = y0`` at the times ``t``: torchdiffeq's ``odeint``.

    Args:
        func: ``func(t, y)``, ``t`` a 0-d tensor, ``y`` shaped like ``y0`` (a tuple for a tuple ``y0``).
        y0: the initial state at ``t[0]``: a tensor of any shape, or a tuple of tensors.
        t: 1-D tensor of times, strictly increasing or decreasing; ``t[0]`` is the start. May require grad.
        rtol, atol: tolerances of adaptive methods (per part of a tuple state as tuples).
        method: ``"dopri5"`` (default), ``"tsit5"``, ``"dopri8"``, ``"bosh3"``, ``"fehlberg2"``,
            ``"adaptive_heun"``, ``"euler"``, ``"midpoint"``, ``"heun2"``, ``"heun3"``, ``"rk4"``,
            ``"explicit_adams"``, ``"implicit_adams"``, ``"fixed_adams"``, ``"scipy_solver"``, an implicit
            Runge-Kutta method on a fixed grid (torchdiffeq master's): ``"implicit_euler"``,
            ``"implicit_midpoint"``, ``"trapezoid"``, ``"gl4"``, ``"gl6"``, ``"radauIIA3"``, ``"radauIIA5"``,
            ``"sdirk2"``, ``"trbdf2"`` (:mod:`~cde_nets.solvers.steppers.implicit_grid`), this library's reversible
            ``"alf"`` (adaptive, or fixed with ``options={"step_size": h}``), or a symplectic composition for a
            separable field (``"yoshida4"``, ``"verlet"``, ...: Guides → Capabilities lists them).
        options: torchdiffeq's method options; unknown keys raise ``ValueError``. This library's ``"autocast":
            torch.bfloat16`` (or ``float16``) evaluates ``func`` under ``torch.autocast``, its output cast back to
            the state's float32, every gradient method alike (an adaptive ``rtol`` below the low precision's unit
            roundoff, bfloat16's 2⁻⁸, is refused); ``"compile": True`` makes each explicit Runge-Kutta step one
            ``torch.compile`` graph with ``func`` inside (:mod:`~cde_nets.solvers.steppers.compiled`). The implicit
            methods take ``step_size``/``grid_constructor``, ``perturb``, ``interp`` and their Newton solve's
            ``max_iters`` (50), ``newton`` (``"simplified"``, ``"full"``, ``"fixed_point"``), ``newton_tol``.
        event_fn: ``g(t, y)``: integrate from ``t[0]`` until ``g = 0`` instead (``t[1:]`` ignored); returns
            ``(event_t, solution)``, ``solution`` holding ``y0`` and the state at the event. Both differentiable.
            With ``event_mode="per_sample"``, each sample (``y0``'s first axis) stops at its own first sign change
            of ``g(t, y) -> (n,)`` (``t``: ``(n,)``, one per running row) within ``[t[0], t[1]]`` (or at ``t[1]``),
            located on the Hermite interpolant as ``ODEBlock.solve(y0, event=g)`` does, by the same loop
            (:func:`~cde_nets.solvers.events.per_sample_events`): ``event_t`` is then ``(batch,)``.
        gradient: this library's addition: ``"backprop"`` (default, torchdiffeq's), ``"adjoint"`` (the
            backsolve: the continuous adjoint, or for the fixed-grid implicit methods and compositions each
            step's start rebuilt by the step with −h), ``"checkpoint"`` or ``"symplectic"`` (exact gradients of
            the steps at low memory), ``"reversible"`` (states rebuilt by the step's exact inverse: ``alf``, the
            compositions, the symmetric implicit methods), ``"forward"`` (the Jacobian by forward-mode
            differentiation through the steps: for few parameters), or the gradient method object
            (``Adjoint(rtol=1e-9)`` sets the backward solve as ``odeint_adjoint``'s ``adjoint_*``). Guides →
            Capabilities has the table of what serves what.
        adjoint_params: the tensors differentiated by the gradients other than ``"backprop"`` (default: ``func``'s
            parameters).
        controller: this library's addition: ``"batch"`` (default: one step size for the whole batch,
            torchdiffeq's steps), a :class:`~cde_nets.solvers.controllers.Controller` object (another rule for
            the shared step of the adaptive Runge-Kutta methods), or ``"per_sample"``: every sample of the batch
            (``y0``'s first axis) on its own step size, ``func`` called with ``t`` of shape ``(batch,)``, ``t`` of
            shape ``(n,)`` or ``(batch, n)``
            (:func:`~cde_nets.solvers.per_sample.solve.odeint_per_sample`; ``dopri5``/``bosh3``/``tsit5``).
        event_mode: with ``event_fn``: ``"first"`` (default, torchdiffeq's: the whole state stops at the first
            event) or ``"per_sample"`` (each sample at its own).

    Returns:
        ``(len(t), *y0.shape)`` (a tuple of them for a tuple ``y0``); with ``event_fn``, ``(event_t, solution)``.
    """
    _check_compile(options, method, gradient, controller, event_fn)
    func, options = _autocast(func, y0, method, options, rtol, getattr(gradient, "rtol", None))
    rule, options = _controller(controller, method, options)
    if rule.per_sample:
        return _per_sample(func, y0, t, rtol, atol, method, options, event_fn, gradient, rule.name, adjoint_params)
    if event_fn is not None and event_mode != "first":
        return _events_per_sample(
            func, y0, t, event_fn, rtol, atol, method, options, gradient, adjoint_params, event_mode
        )
    if isinstance(gradient, Adjoint) or GRADIENTS.get(str(gradient)) is Adjoint:
        return _adjoint(func, y0, t, rtol, atol, method, options, event_fn, gradient, adjoint_params)
    if event_fn is not None:
        return _until_event(func, y0, t, event_fn, rtol, atol, method, options, gradient, adjoint_params, None)
    kw = dict(rtol=rtol, atol=atol, method=method, options=options, adjoint=None)
    return _solve(func, y0, t, gradient=gradient, adjoint_params=adjoint_params, **kw)


def _check_compile(options, method, gradient, controller, event_fn) -> None:
    """Refuse, naming the fix, ``options["compile"]`` where the compiled step cannot serve the call."""
    if isinstance(options, dict) and options.get("compile") is True:
        from cde_nets.solvers.steppers.compiled import check_compiled

        check_compiled(_check_method(method), as_gradient(gradient), controller)
        _no_compile(options, "event_fn" if event_fn is not None else None)


def _no_compile(options: dict | None, what: str | None) -> None:
    """Refuse ``options["compile"]`` where ``what`` (events, dense output) runs on the eager stepper."""
    if what is not None and isinstance(options, dict) and options.get("compile"):
        raise ValueError(
            f"options={{'compile': True}} serves odeint's solve at the times `t`; {what} runs on the eager "
            "stepper: drop 'compile' from `options` for this call."
        )


def _controller(controller: str | Controller, method: str | None, options: dict | None) -> tuple[Controller, Any]:
    """The controller ``controller`` names, and the options that carry it: a per-sample object's constants go
    where the per-sample loop reads them; a shared-step rule other than torchdiffeq's rides to the stepper."""
    if controller == "batch":  # torchdiffeq's shared step, its constants in `options` (the common call)
        return Integral.from_options({}), options
    # a name takes its constants from `options`; an object holds its own (as_controller refuses both)
    rule = as_controller(controller, options)
    if rule.per_sample and isinstance(controller, Controller):
        options = {**(options or {}), **{k: getattr(rule, k) for k in rule.OPTIONS}}
    elif not rule.per_sample:
        check_shared_controller(controller, _check_method(method))
        options = {**_check_options(_check_method(method), options), "controller": rule}
    return rule, options


def _adjoint(func, y0, t, rtol, atol, method, options, event_fn, gradient, adjoint_params) -> Any:
    """``odeint`` with the continuous adjoint: :func:`odeint_adjoint`, with the backward settings of an
    :class:`~cde_nets.solvers.gradients.Adjoint` object."""
    kw: dict[str, Any] = dict(
        rtol=rtol, atol=atol, method=method, options=options, event_fn=event_fn, adjoint_params=adjoint_params
    )
    if not isinstance(gradient, Adjoint):
        return odeint_adjoint(func, y0, t, **kw)
    if not gradient.seminorm:
        raise ValueError(
            "Adjoint(seminorm=False) in `odeint`: pass a full norm as odeint_adjoint's "
            "`adjoint_options={'norm': ...}` instead."
        )
    backward: dict[str, Any] = dict(
        adjoint_rtol=gradient.rtol, adjoint_atol=gradient.atol, adjoint_method=gradient.method
    )
    return odeint_adjoint(func, y0, t, **kw, **backward)


def _per_sample(func, y0, t, rtol, atol, method, options, event_fn, gradient, controller, params) -> torch.Tensor:
    if under_vmap():
        raise ValueError(PER_SAMPLE_UNDER_VMAP)
    if not isinstance(y0, torch.Tensor):
        raise ValueError("controller='per_sample' needs a tensor `y0` of shape (batch, *state), not a tuple.")
    check_state(y0, method or "dopri5", (method or "dopri5") in ADAPTIVE)
    check_cell(as_gradient(gradient), method or "dopri5", controller)
    if event_fn is not None:
        check_events(method or "dopri5", "per_sample", controller)
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
    unless ``adjoint_options["norm"]`` is a callable. (torchdiffeq's signature, unchanged: per-sample events with
    the adjoint are ``odeint(..., event_fn=g, event_mode="per_sample", gradient=Adjoint(...))``.)
    """
    func, options = _autocast(func, y0, method, options, rtol, rtol if adjoint_rtol is None else adjoint_rtol)
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
            f"method={method!r} takes the backsolve adjoint of its own steps (rebuilt backwards on the forward grid, "
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


def _events_per_sample(
    func, y0, t, event_fn, rtol, atol, method, options, gradient, adjoint_params, event_mode: str = "per_sample"
) -> Any:
    """``(event_t, solution)`` with every sample on its own clock: the per-sample event loop
    (:func:`~cde_nets.solvers.events.per_sample_events`) that ``ODEBlock.solve(y0, event=g)`` runs, over
    ``[t[0], t[1]]``; ``event_t`` ``(batch,)`` (``t[1]`` where a sample had no event), ``solution`` ``y0`` and each
    sample's state at its own event."""
    if not callable(event_fn):
        raise TypeError(f"`event_fn` must be callable as event_fn(t, y), got {type(event_fn).__name__}.")
    res, y0 = _run_per_sample(func, y0, t, event_fn, rtol, atol, method, options, gradient, adjoint_params, event_mode)
    return res.times, torch.stack([y0, res.y])


def odeint_dense(
    func: Callable,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    rtol: Any = 1e-7,
    atol: Any = 1e-9,
    method: str | None = None,
    options: dict | None = None,
    gradient: str | GradientMethod = "backprop",
    adjoint_params: Sequence[torch.Tensor] | None = None,
    controller: str = "batch",
) -> HermiteDense:
    """The trajectory from ``t[0]`` to ``t[-1]`` (increasing) as a dense output: ``odeint_dense(...).evaluate(s)``
    gives the states at any times ``s`` in the span, ``(len(s), *y0.shape)``, differentiable. It is the piecewise
    cubic Hermite interpolant through the solver's states and fields about one step apart (Hairer, Nørsett &
    Wanner, "Solving Ordinary Differential Equations I", §II.6), built by the same loop as
    ``ODEBlock.solve(y0, dense=True)`` (:func:`~cde_nets.solvers.events.per_sample_events`): the same values and
    gradients. ``y0``: a tensor ``(batch, ...)``; the other arguments are :func:`odeint`'s (``controller="batch"``
    only: the loop runs on the shared step)."""
    func, options = _autocast(func, y0, method, options, rtol)
    args = (func, y0, t, None, rtol, atol, method, options, gradient, adjoint_params, "per_sample", controller)
    res, _ = _run_per_sample(*args)
    assert res.knots is not None
    return HermiteDense(*res.knots)


def _run_per_sample(
    func, y0, t, event_fn, rtol, atol, method, options, gradient, adjoint_params, event_mode, controller="batch"
):
    """The per-sample loop of both doors on ``odeint``'s arguments: the block's solver settings built from them
    (:class:`~cde_nets.solvers.options.SolverOptions`), each segment solved by the adapter the block calls too."""
    if not callable(func):
        raise TypeError(f"`func` must be callable as func(t, y), got {type(func).__name__}.")
    _no_compile(options, "per-sample events and dense output")
    method = _check_method(method)
    grad = as_gradient(gradient)
    check_cell(grad, method, controller)  # ODEBlock's order: the gradient's (on construction), then the events'
    check_events(method, event_mode, controller)
    if not isinstance(y0, torch.Tensor) or y0.dim() < 1:
        raise ValueError("per-sample events and dense output need a tensor `y0` of shape (batch, *state), not a tuple.")
    check_state(y0, method, method in ADAPTIVE)
    t = check_output_times(t, y0.device)
    if len(t) < 2 or bool(t[0] > t[-1]) or t.requires_grad:
        raise ValueError(
            "per-sample events and dense output integrate forwards over [t[0], t[-1]]: pass increasing, detached `t`."
        )
    opts = _check_options(method, options)
    step = opts.pop("step_size", None)
    adaptive = is_adaptive(method, step)
    tol = dict(rtol=rtol, atol=atol) if adaptive else {}
    solver = SolverOptions(method, step_size=step, options=opts, **tol)
    t0, t1 = float(t[0]), float(t[-1])
    grid = None if adaptive else aligned_grid([t0, t1], step)
    params: tuple[torch.Tensor, ...] = ()
    if grad.name != "backprop":
        params = _params(func, adjoint_params, grad.name)
    elif isinstance(func, nn.Module):  # as ODEBlock hands them over
        params = tuple(p for p in func.parameters() if p.requires_grad)

    def solve(y: torch.Tensor, times: torch.Tensor, idx: torch.Tensor, g, first_step):
        s = solver if first_step is None else solver.replace(options={**solver.options, "first_step": first_step})
        ys, stats = integrate(func, y, times, solver=s, gradient=grad, params=params, grid=g)
        return ys, stats.steps_forward

    def field(s: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return func(s, y)

    event = None if event_fn is None else (lambda s, y, idx: event_fn(s, y))
    kw: dict[str, Any] = dict(t0=t0, t1=t1, grid=grid, event=event, dense=event_fn is None)
    kw.update(steps_to_points=method in REVERSIBLE_METHODS, free_first_step="first_step" not in opts)
    return per_sample_events(solve, field, y0, **kw), y0


def _until_event(func, y0, t, event_fn, rtol, atol, method, options, gradient, adjoint_params, adjoint):
    """``(event_t, solution)`` from ``t[0]`` until ``event_fn(t, y) = 0``.

    The event is located by torchdiffeq's search on the flattened, forwards problem, on the library's stepper
    (:func:`~cde_nets.solvers.steppers.rk_events.odeint_event_rk`), without a graph (for the
    implicit methods by :func:`~cde_nets.solvers.steppers.implicit_grid.implicit_until_event`, the same search); the
    state there is then solved for at that fixed time in the chosen gradient mode, and the implicit function
    theorem on ``g(t*, y(t*)) = 0`` gives the time's gradient,
    ``dt*/dθ = −(∂g/∂θ + ∂g/∂y ∂y/∂θ) / (∂g/∂t + ∂g/∂y F)``, and the state's, ``dy(t*)/dθ = ∂y/∂θ + F dt*/dθ``.
    """
    if not callable(event_fn):
        raise TypeError(f"`event_fn` must be callable as event_fn(t, y), got {type(event_fn).__name__}.")
    _no_compile(options, "event_fn")
    method = _check_method(method)
    check_cell(as_gradient(gradient), method)  # the order of ODEBlock's checks: the gradient's, then the events'
    check_events(method, "first")
    opts = _check_options(method, options)
    flat, shapes = check_state(y0, method, method in ADAPTIVE)
    t = check_output_times(t, flat.device)
    if len(t) < 2:
        raise ValueError("with `event_fn`, `t` needs two times: the start and any later (or earlier) time.")
    sign = -1.0 if bool(t[0] > t[1]) else 1.0
    limit = opts.pop("max_num_steps", None)
    steps = EVENT_MAX_STEPS if limit is None else int(limit)
    problem = Problem(func, shapes, sign, steps, kind(method))
    event = _WatchedEvent(event_fn, sign, shapes)
    try:
        if method in IMPLICIT:
            grid = ImplicitGrid(problem, method, flip_options(opts, sign, shapes))
            tol = float(atol) if isinstance(atol, float | int) else float(torch.as_tensor(atol).min())
            s_event, found = implicit_until_event(grid, flat.detach(), float(t[0].detach()) * sign, event, tol)
        else:
            s_event, found = _event_search(problem, flat, t, sign, shapes, rtol, atol, method, opts, event)
    except SolverError as exc:
        raise event.no_sign_change(exc, steps, limit is None) from exc
    t_star = (s_event.to(t.dtype) * sign).reshape(())
    if not torch.is_grad_enabled():
        return t_star, unflatten(found, shapes, (2,))
    event_fn = event.combined()
    return _event_state(
        func, y0, t, t_star, found, shapes, event_fn, rtol, atol, method, options, gradient, adjoint_params, adjoint
    )


def _event_search(problem, flat, t, sign, shapes, rtol, atol, method, opts, event):
    """torchdiffeq's event search on the flat, forwards problem, without a graph."""
    rtol, atol = tolerances(rtol, atol, shapes)
    with torch.no_grad():
        try:
            s_event, found = odeint_event_rk(
                problem,
                flat.detach(),
                t.detach()[:2] * sign,
                rtol=rtol,
                atol=atol,
                method=method,
                options=state_norm(flip_options(opts, sign, shapes), shapes, method),
                event_fn=event,
            )
        except AssertionError as exc:
            reason = Reason.UNDERFLOW if "underflow" in str(exc) else Reason.OTHER
            raise SolverError(f"{str(exc)[:300]}", reason=reason) from exc
        except RuntimeError as exc:
            # torchdiffeq's fixed-step search stops itself after 20000 steps, uncounted by the step callback
            words = str(exc).rstrip(".").split()
            if not str(exc).startswith("Reached maximum number of iterations") or not words[-1].isdigit():
                raise
            error = SolverError(str(exc), reason=Reason.MAX_STEPS)
            error.steps = int(words[-1])  # type: ignore[attr-defined]
            raise error from exc
    return s_event, found


class _WatchedEvent:
    """The user's event function on the engine's flat, forwards problem, in the user's time and shapes; it keeps
    its first and last values, which a search that finds no change of sign reports."""

    def __init__(self, event_fn: Callable, sign: float, shapes: list[torch.Size] | None):
        self.event_fn, self.sign, self.shapes = event_fn, sign, shapes
        self.first: tuple[Any, Any] | None = None
        self.last: tuple[Any, Any] | None = None

    def __call__(self, s: torch.Tensor, y: torch.Tensor) -> Any:
        t = -s if self.sign < 0 else s
        g = self.event_fn(t, unflatten(y, self.shapes))
        self.last = (t, g)  # read only for a message: no host read per evaluation
        if self.first is None:
            check_event_output(g, "`event_fn`")
            self.first = self.last
        return g

    def combined(self) -> Callable:
        """The event function as one scalar, as torchdiffeq's search sees several values: each made positive at
        the start by its sign there, the least of them (the first to reach zero ends the solve), so that the
        implicit function theorem differentiates the event that ended it. A single value stays as it is."""
        if self.first is None or self.first[1].numel() == 1:
            return self.event_fn
        signs, event_fn = torch.sign(self.first[1].detach()), self.event_fn
        return lambda t, y: torch.min(event_fn(t, y) * signs)

    def no_sign_change(self, exc: SolverError, limit: int, default: bool) -> SolverError:
        """The error of a search that stopped (``exc``) before the event function changed sign."""
        if exc.reason is Reason.MAX_STEPS and hasattr(exc, "steps"):
            why = f"within {exc.steps} steps (torchdiffeq's limit of a fixed-step search)"
        elif exc.reason is Reason.MAX_STEPS:
            why = f"within {limit} steps (the event search's default limit)" if default else ""
            why = why or f"within max_num_steps={limit} steps"
        else:
            why = f"before the search stopped ({str(exc).rstrip('.')})"
        seen = ""
        if self.first is not None and self.last is not None:
            (t0, g0), (t1, g1) = self.first, self.last
            seen = f": g = {_values(g0)} at t = {float(t0):.6g} (the start), g = {_values(g1)} at t = {float(t1):.6g}"
            seen += " (the last time searched)"
        reason = exc.reason if exc.reason in (Reason.NONFINITE, Reason.NONFINITE_GRADIENT) else Reason.NO_EVENT
        return SolverError(
            f"the event function never changed sign {why}{seen}. Check `event_fn` (the search looks for a change of "
            "sign, not a touch of zero), or raise options['max_num_steps'] if the event lies further on.",
            nfe=exc.nfe,
            reason=reason,
        )


def _values(g: Any) -> str:
    """An event value for a message: one number, or the first few of several."""
    v = torch.as_tensor(g).detach().reshape(-1).tolist()
    text = ", ".join(f"{x:.6g}" for x in v[:4]) + (", ..." if len(v) > 4 else "")
    return text if len(v) == 1 else f"[{text}]"


def _event_state(
    func, y0, t, t_star, found, shapes, event_fn, rtol, atol, method, options, gradient, adjoint_params, adjoint
):
    """``(event_t, solution)`` differentiable by the implicit function theorem on ``g(t*, y(t*)) = 0``."""
    # the state at the fixed time t*, differentiable in the chosen mode; its value is the search's own
    times = torch.stack([t[0], t_star])
    kwargs: dict[str, Any] = dict(rtol=rtol, atol=atol, method=method, options=options)
    if GRADIENTS.get(str(gradient)) is Adjoint:
        # the implicit methods' adjoint is the backsolve of their own steps, whose settings are the forward ones
        backward = {} if method in IMPLICIT else _adjoint_kwargs(adjoint)
        sol = odeint_adjoint(func, y0, times, adjoint_params=adjoint_params, **backward, **kwargs)
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
        g_local = event_fn(tt, unflatten(yd, shapes))
        g_t, g_y = (None, None)
        if isinstance(g_local, torch.Tensor) and g_local.requires_grad:
            g_t, g_y = torch.autograd.grad(g_local, (tt, yd), allow_unused=True)
    dg = torch.zeros((), dtype=t.dtype, device=t.device)
    # dg/dt along the solution; for a complex state torch's ∂g/∂y is ∂g/∂Re y + i ∂g/∂Im y, so the rate is Re(conj · F)
    rate = None if g_y is None else (g_y.conj() * f).real.sum() if g_y.is_complex() else (g_y * f).sum()
    dg = dg + (0.0 if g_t is None else g_t.to(t.dtype)) + (0.0 if rate is None else rate.to(t.dtype))
    if (g_y is None or not bool(g_y.any())) and not bool(dg):
        # g does not move with (t, y) at t*: the search stopped where g jumps to a value of its own (torchdiffeq's
        # examples guard an end time with `zeros_like(t)`, which has no graph). That time moves with nothing, so
        # its gradient is zero, as torchdiffeq's formula gives; the zero stays joined to the inputs' graph.
        event_t = t_star.detach() + (0.0 * y_star.sum()).to(t.dtype) if y_star.requires_grad else t_star.detach()
    else:
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
    if kwargs.get("event_mode", "first") != "first":
        raise ValueError(
            "odeint_event searches without an end time, torchdiffeq's whole-state semantics; per-sample events end "
            "at a time of their own: odeint(func, y0, t=[t0, t1], event_fn=g, event_mode='per_sample')."
        )
    t0 = torch.as_tensor(t0)
    step = -1.0 if reverse_time else 1.0
    t = torch.cat([t0.reshape(-1), t0.detach().reshape(-1) + step])
    if odeint_interface not in (odeint, odeint_adjoint):
        raise ValueError("`odeint_interface` must be cde_nets.odeint or cde_nets.odeint_adjoint.")
    return odeint_interface(func, y0, t, event_fn=event_fn, **kwargs)
