"""The one core both doors call: :func:`solve` takes a :class:`~solvers.run.Run` and a gradient method and
returns the states at ``run.t`` with that method's backward pass attached.

Shaped after diffrax's ``diffeqsolve`` (Kidger 2021, "On neural differential equations", §5): the choice of how to
differentiate is an object (:mod:`solvers.gradients`) that declares what it serves (``supports``/``check``: one
refusal, the same from ``ODEBlock`` and from ``cde_nets.odeint``) and owns the solve where its backward pass needs
one of its own. The engine picks the stepper family by what the method is:

- the library's fixed-step methods (implicit Runge-Kutta, symplectic compositions) sweep their grid with the
  gradient the method object names (:attr:`~solvers.gradients.GradientMethod.sweep`); a run with torchdiffeq's
  fixed-grid semantics (``run.interpolated``: outputs read off the steps by interpolation) takes the implicit
  methods on that grid (:mod:`solvers.steppers.implicit_grid`);
- every explicit Runge-Kutta method runs on the library's own stepper (:mod:`solvers.steppers.fast_rk`) wherever the
  gradient differentiates the forward operations, or none is needed;
- the reversible Runge-Kutta methods (:mod:`solvers.steppers.reversible_rk`) step themselves, rebuilding their
  states backwards for ``gradient="reversible"`` and differentiated directly for ``"backprop"``;
- otherwise the gradient method's own solve (replay, continuous adjoint, reversible, forward mode);
- under ``torch.vmap`` the adaptive explicit Runge-Kutta methods run on a loop of tensor decisions instead
  (:mod:`solvers.steppers.vmappable`: each vmapped instance on its own steps), differentiated by backprop, by the
  continuous adjoint (:mod:`solvers.gradients.vmap_adjoint`), by the replay of each instance's attempts
  (:mod:`solvers.gradients.vmap_checkpoint`, :mod:`solvers.gradients.vmap_symplectic`), by the interpolating and
  Gauss adjoints (:mod:`solvers.gradients.vmap_interpolating`, :mod:`solvers.gradients.vmap_gauss`) or by its
  tangents (:mod:`solvers.gradients.vmap_forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .controllers import Controller, is_per_sample
from .gradients.backprop import Backprop
from .gradients.base import GradientMethod
from .gradients.vmap_adjoint import adjoint_vmapped, field_inputs
from .gradients.vmap_checkpoint import checkpoint_vmapped
from .gradients.vmap_forward import forward_vmapped
from .gradients.vmap_gauss import gauss_vmapped
from .gradients.vmap_interpolating import interpolating_vmapped
from .gradients.vmap_symplectic import symplectic_vmapped
from .grids import stepper_options
from .options import IMPLICIT_METHODS, OWN_FIXED_METHODS, REVERSIBLE_METHODS, REVERSIBLE_RK_METHODS, SPLIT_METHODS
from .per_sample.solve import check_per_sample_gradient
from .run import Run
from .steppers.fast_rk import fast_applies, odeint_fast
from .steppers.implicit_grid import IMPLICIT_GRID_GRADIENTS, ImplicitGrid
from .steppers.implicit_ode import integrate_implicit
from .steppers.methods import FIXED_METHODS
from .steppers.reversible_rk import integrate_reversible_rk
from .steppers.split_ode import integrate_split
from .steppers.vmappable import solve_vmapped, vmap_methods, vmap_options
from .transforms import forward_mode_only, tracked, transform_counts, under_transform, under_vmap

__all__ = ["EVENTS_UNDER_VMAP", "EVENT_MODES", "check_cell", "check_events", "solve"]

#: the gradient methods with a backward pass of their own under torch.vmap (each instance's on its own steps)
_VMAP_GRADIENTS: dict[str, Callable[[Run, Any, dict], torch.Tensor | None]] = {
    "adjoint": adjoint_vmapped,
    "checkpoint": checkpoint_vmapped,
    "symplectic": symplectic_vmapped,
    "forward": forward_vmapped,
    "interpolating": interpolating_vmapped,
    "gauss": gauss_vmapped,
}
#: the two event semantics: the whole state stops at the first event (torchdiffeq's ``odeint_event``: the search of
#: :mod:`solvers.steppers.rk_events`), or each sample at its own (the loop of :mod:`solvers.events`)
EVENT_MODES = ("first", "per_sample")
#: both doors' refusal of events and dense output inside torch.vmap
EVENTS_UNDER_VMAP = (
    "events (`event_fn`, `event`, `stop`) and dense output under torch.vmap: locating an event (and keeping a "
    "trajectory) sizes and reads each instance's steps on the host, which vmap cannot batch. Solve the instances as "
    "one batch outside vmap instead: odeint(func, Y0, t, event_fn=g, event_mode='per_sample') or "
    "ODEBlock.solve(Y0, event=g) stop each sample at its own event (or loop over the instances)."
)


def check_cell(gradient: GradientMethod, method: str, controller: str | Controller = "batch") -> None:
    """Refuse, naming the fix, a gradient method that cannot serve ``method`` under ``controller``: the one check
    both doors make, in one order (the controller's refusal is the more specific)."""
    check_per_sample_gradient(controller, gradient, method)
    gradient.check(method)


def check_events(method: str, event_mode: str = "per_sample", controller: str | Controller = "batch") -> None:
    """Refuse, naming the fix, events or dense output (``event_mode="per_sample"``: the same loop) that no door
    serves for ``method`` under ``controller`` (none under ``torch.vmap``): the one check of
    ``ODEBlock.solve(event=, dense=)`` and of ``cde_nets.odeint(event_fn=)``/``odeint_dense``, so both refuse with
    the same message."""
    if under_vmap():
        raise ValueError(EVENTS_UNDER_VMAP)
    if event_mode not in EVENT_MODES:
        raise ValueError(
            f"`event_mode` must be 'first' (the whole state stops at the first event, torchdiffeq's odeint_event) "
            f"or 'per_sample' (each sample of the batch stops at its own event); got {event_mode!r}."
        )
    if is_per_sample(controller):
        raise ValueError(
            "controller='per_sample' serves outputs at times `t` (and per-sample `t_end`); events (`event`, "
            "`event_fn`, `stop`) and dense output run on the shared step: use controller='batch' for them."
        )
    if event_mode == "first" and (method in REVERSIBLE_METHODS or method in SPLIT_METHODS):
        raise ValueError(
            f"event_mode='first' runs torchdiffeq's event search, on the Runge-Kutta methods (explicit and "
            f"implicit), not on method={method!r}: use event_mode='per_sample', which locates each sample's "
            "events on the steps of any method."
        )


def _differentiated(run: Run, gradient: GradientMethod) -> bool:
    """Whether a ``torch.func`` level or autograd differentiates ``run.y0`` or a tensor the field reaches."""
    try:
        tensors = field_inputs(run, gradient.name)[2]
    except ValueError:  # an adjoint_params entry the field does not reach, or a differentiated tensor held out of reach
        return True
    return tracked(run.y0) or any(tracked(x) for x in tensors)


def _transform_refusal(run: Run, gradient: GradientMethod) -> ValueError:
    return ValueError(
        f"gradient={gradient.name!r} with method={run.method!r} under a torch.func transform: torch.func runs "
        f"this gradient method's own backward pass on the adaptive explicit methods {vmap_methods()} only; use "
        "one of them, or gradient='backprop' (torch.func differentiates the solve itself), or torch.autograd "
        "instead of torch.func."
    )


def _check_higher_order(run: Run, gradient: GradientMethod) -> None:
    """Refuse, naming the fix, a second derivative through a backward pass torch.func cannot differentiate: the
    replays' and the quadratures' (a vector-Jacobian product taken without a graph of its own), and every own
    backward pass under forward mode over reverse (``hessian``: torch.func asks the Function for a ``jvp``). The
    continuous adjoint's backward solve is itself differentiable, so ``jacrev(jacrev(...))`` serves it."""
    reverse, forward = transform_counts()
    nested = (reverse >= 2 and gradient.name != "adjoint") or (reverse >= 1 and forward >= 1)
    if nested and _differentiated(run, gradient):
        raise ValueError(
            f"gradient={gradient.name!r} under nested torch.func transforms ({reverse} reverse-mode, {forward} "
            "forward-mode level(s): a second derivative): its backward pass is not differentiable there; use "
            "gradient='backprop' (torch.func differentiates the solve itself to any order), or 'adjoint' for "
            "jacrev of jacrev/grad."
        )


def _under_transform(run: Run, gradient: GradientMethod) -> torch.Tensor | None:
    """A gradient method's own backward pass under ``torch.func.grad``/``jacrev``/``vjp`` (no ``vmap``): torch.func
    takes an ``autograd.Function`` only in the form the vmapped solves' are written in, so those serve here too (on
    the loop of tensor decisions, the single solve's steps); ``None`` where nothing is differentiated."""
    own = _VMAP_GRADIENTS.get(gradient.name)
    if own is None or run.method not in vmap_methods():
        if _differentiated(run, gradient):
            raise _transform_refusal(run, gradient)
        return None
    return own(run, gradient, vmap_options(run))


def solve(run: Run, gradient: GradientMethod) -> torch.Tensor:
    """The states at ``run.t``, ``(len(t), *y0.shape)``, with ``gradient``'s backward pass attached; a
    ``ValueError`` naming the fix where ``gradient`` cannot serve ``run.method``."""
    gradient.check(run.method)
    compiled = getattr(run.solver, "compile", False) or run.options.get("compile", False)
    if gradient.name != "backprop" and torch.is_grad_enabled() and under_transform():
        _check_higher_order(run, gradient)
    if under_vmap():  # each instance on its own steps: the loop of tensor decisions (solvers.steppers.vmappable)
        if compiled:
            raise ValueError(
                "compile=True compiles a step that reads its error on the host, which torch.vmap refuses: drop "
                "compile inside vmap (the vmapped loop serves every instance on its own steps)."
            )
        own = _VMAP_GRADIENTS.get(gradient.name)
        if own is not None and torch.is_grad_enabled() and run.method in vmap_methods():
            vmapped = own(run, gradient, vmap_options(run))
            if vmapped is not None:
                return vmapped
        if gradient.name != "backprop" and torch.is_grad_enabled() and run.method in FIXED_METHODS:
            if _differentiated(run, gradient):
                raise _transform_refusal(run, gradient)
            gradient = Backprop()  # nothing is differentiated: no backward pass to choose, the grid as vmap runs it
        vmapped = solve_vmapped(run, gradient)
        if vmapped is not None:
            return vmapped
    elif gradient.name != "backprop" and torch.is_grad_enabled() and under_transform():
        if forward_mode_only():  # jvp's tangents are the solve's own derivative: no backward pass to choose
            gradient = Backprop()
        else:
            served = _under_transform(run, gradient)
            if served is not None:
                return served
    if compiled:
        return _compiled(run, gradient)
    if run.method in OWN_FIXED_METHODS:
        return _own_fixed_step(run, gradient)
    if run.method in REVERSIBLE_RK_METHODS:  # served by 'reversible' (the rebuild) and 'backprop' (sweep names which)
        return integrate_reversible_rk(
            run.func,
            run.y0,
            run.t,
            solver=run.solver,
            reversible=gradient.sweep == "reversible",
            params=run.params,
            jump_t=run.jump_t,
            grid=run.grid,
        )
    s, options = run.solver, stepper_options(run.options)
    scalar_tolerances = all(isinstance(tol, float | int | torch.Tensor) for tol in (s.rtol, s.atol))
    if scalar_tolerances and fast_applies(run.method, gradient.forward_graph, run.y0, run.t, run.params, options):
        return odeint_fast(
            run.func,
            run.y0,
            run.t,
            method=s.method,
            rtol=s.rtol,
            atol=s.atol,
            options=options,
            graph=gradient.forward_graph,
            steps=getattr(gradient, "steps", "differentiated"),
        )
    return gradient.solve(run)


def _compiled(run: Run, gradient: GradientMethod) -> torch.Tensor:
    """A solve whose every step is one compiled graph with the field inside (:mod:`solvers.steppers.compiled`,
    imported here: torch.compile's import is paid only by solves that ask for it)."""
    from .steppers.compiled import check_compiled, odeint_compiled

    check_compiled(run.method, gradient)
    tl = run.t.tolist()
    if not all(a < b for a, b in zip(tl, tl[1:])) or run.t.requires_grad:
        raise ValueError(
            "compile=True integrates forwards to times that need no gradient; `t` is decreasing or requires grad: "
            "drop compile for this call."
        )
    options = stepper_options({k: v for k, v in run.options.items() if k != "compile"})
    s = run.solver
    steps = getattr(gradient, "steps", "differentiated")
    checkpoint = gradient.name == "checkpoint"
    return odeint_compiled(
        run.func,
        run.y0,
        run.t,
        method=s.method,
        rtol=s.rtol,
        atol=s.atol,
        options=options,
        steps=steps,
        checkpoint=checkpoint,
        params=run.params if checkpoint else (),
    )


def _own_fixed_step(run: Run, gradient: GradientMethod) -> torch.Tensor:
    """A solve by one of cde_nets' own fixed-step methods: the implicit Runge-Kutta sweep (gradients of each step by
    the implicit function theorem) or a symplectic composition, with the gradient ``gradient.sweep`` names. They
    count their own evaluations, so they get the field itself, not the counting wrapper."""
    s, sweep = run.solver, str(gradient.sweep)
    if run.interpolated and s.method in IMPLICIT_METHODS:
        grid_solver = ImplicitGrid(run.func, s.method, dict(run.options))
        if sweep in IMPLICIT_GRID_GRADIENTS:
            return grid_solver.solve(run.y0, run.t, sweep, run.params)
        grid = grid_solver.grid(run.y0, run.t)
        _check_on_grid(run.t, grid, gradient)
        return _one_sample(run, grid, sweep)
    field: Any = getattr(run.func, "field", run.func)
    if s.method in SPLIT_METHODS:  # the composition calls the field's halves: the user's own module
        field = getattr(run.func, "composed", field)
    kw: dict[str, Any] = dict(
        method=s.method, gradient=sweep, params=run.params, grid=run.grid, max_steps=s.max_steps, stats=run.stats
    )
    if s.method in SPLIT_METHODS:
        return integrate_split(field, run.y0, run.t, **kw)
    options = {k: v for k, v in s.options.items() if k in ("newton", "max_iters", "newton_tol")}
    return integrate_implicit(field, run.y0, run.t, options=options, **kw)


def _one_sample(run: Run, grid: torch.Tensor, sweep: str) -> torch.Tensor:
    """torchdiffeq's state is one sample, whatever its shape: the sweep (which reads a leading batch axis, one
    Newton system per row) sees it as one row, so the stage Jacobian couples every component, as the grid
    solver's (:mod:`solvers.steppers.implicit_grid`) does."""
    shape, func = run.y0.shape, run.func

    def row(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return func(t, y.reshape(shape)).reshape(1, -1)

    options = {k: v for k, v in run.solver.options.items() if k in ("newton", "max_iters", "newton_tol")}
    kw: dict[str, Any] = dict(method=run.method, gradient=sweep, params=run.params, grid=grid, options=options)
    ys = integrate_implicit(row, run.y0.reshape(1, -1), run.t, max_steps=run.solver.max_steps, stats=run.stats, **kw)
    return ys.reshape(len(run.t), *shape)


def _check_on_grid(t: torch.Tensor, grid: torch.Tensor, gradient: GradientMethod) -> None:
    """A sweep that steps to every output time serves torchdiffeq's grid semantics only where the outputs lie on
    the grid (nothing to interpolate)."""
    on = set(grid.tolist())
    if any(v not in on for v in t.tolist()):
        raise ValueError(
            f"gradient={gradient.name!r} steps to every output time, but `t` has times between the points of the "
            "fixed grid, which torchdiffeq's semantics read by interpolation: put every time of `t` on the grid "
            "(options={'grid_constructor': ...} or no `step_size`, so that the grid is `t`)."
        )
