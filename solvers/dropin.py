r"""The engine beneath :mod:`cde_nets.functional` (torchdiffeq's ``odeint`` API): the user's problem normalised to
one flat state integrated forwards, and the one function that hands it to the engine.

A tuple state is concatenated into one tensor (its default error norm stays torchdiffeq's, the largest of its parts'
RMS norms: :func:`state_norm`); decreasing times ``t`` are negated (``s = −t``,
``dy/ds = −func(−s, y)``) with the options that hold times (``step_t``, ``jump_t``, a grid constructor); the
user's torchdiffeq callbacks are forwarded in the user's own time and shapes. :func:`solve_flat` then hands the
problem to the engine (:func:`solvers.engine.solve`), the core ``ODEBlock`` calls too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .counting import SolverStats
from .engine import solve
from .errors import Reason, SolverError
from .gradients import Adjoint, GradientMethod
from .grids import negated_time_options, step_grid
from .norms import StateNorm
from .options import ADAPTIVE_METHODS, FIXED_METHODS, REVERSIBLE_METHODS, SPLIT_METHODS
from .per_sample.solve import wants_rows
from .run import Backward, Run
from .steppers.implicit_tableaux import IMPLICIT_TABLEAUX
from .validation import check_field_output, check_tolerance, check_tolerances

__all__ = [
    "ADAPTIVE",
    "CALLBACKS",
    "FIXED",
    "IMPLICIT",
    "Problem",
    "flip_options",
    "kind",
    "solve_flat",
    "state_norm",
    "tolerance",
    "tolerances",
    "unflatten",
]

State = torch.Tensor | tuple[torch.Tensor, ...]

ADAPTIVE = ADAPTIVE_METHODS
# torchdiffeq's fixed-step multistep methods too (the value: the highest order its Adams-Bashforth-Moulton steps reach)
FIXED = FIXED_METHODS.with_extra({"explicit_adams": 12, "implicit_adams": 12, "fixed_adams": 12})
IMPLICIT = tuple(IMPLICIT_TABLEAUX)  # implicit Runge-Kutta on a fixed grid (solvers.steppers.implicit_grid)
CALLBACKS = ("callback_step", "callback_accept_step", "callback_reject_step")
_ADJOINT_CALLBACKS = tuple(f"{c}_adjoint" for c in CALLBACKS)


def unflatten(y: torch.Tensor, shapes: list[torch.Size] | None, lead: tuple[int, ...] = ()) -> State:
    if shapes is None:
        return y
    parts, i = [], 0
    for s in shapes:
        n = s.numel()
        parts.append(y[..., i : i + n].reshape((*lead, *s)))
        i += n
    return tuple(parts)


class Problem(nn.Module):
    """The user's ``func`` as the engine sees it: a flat state, time negated when ``t`` decreases (``sign = −1``),
    torchdiffeq's callbacks forwarded in the user's time and shapes, ``max_num_steps`` counted, and the steps
    reported to a replay's ``recorder`` (:mod:`solvers.gradients.replay`) while one listens.

    ``kind``: ``"adaptive"``, ``"fixed"`` or ``None`` (scipy, or a plain evaluation): the forward callbacks are
    those the method calls, so that torchdiffeq, given this object, warns only about the user's own."""

    shapes: list[torch.Size] | None
    sign: float
    kind: str | None
    max_num_steps: int | None
    n_steps: int
    recorder: Any
    stats: SolverStats
    composed: Callable
    checked: bool
    all_rows: torch.Tensor | None
    with_rows: bool

    def __init__(
        self,
        func: Callable,
        shapes: list[torch.Size] | None,
        sign: float = 1.0,
        max_num_steps: int | None = None,
        kind: str | None = None,
    ):
        super().__init__()
        self.func = func  # a module is registered: the problem's parameters are the field's
        # plain values straight into the instance (nn.Module.__setattr__ costs a few microseconds each, per solve)
        self.__dict__.update(
            shapes=shapes,
            sign=sign,
            kind=kind,
            max_num_steps=max_num_steps,
            n_steps=0,
            recorder=None,
            stats=SolverStats(),  # the engine's pieces count here; the functional API reports none
            # what a symplectic composition calls the halves of: the user's separable module, on a forwards
            # tensor state
            composed=func if shapes is None and sign > 0 else self,
            checked=False,  # the first evaluation's output is checked against the state, later ones are not
            # forward(t, y, rows): a field with per-sample data reads it for the batch rows it is handed (all of
            # them on the shared step)
            all_rows=None,
            with_rows=shapes is None and wants_rows(func),
        )
        self.user: dict[str, Any] = {n: _attribute(func, n) for n in (*CALLBACKS, *_ADJOINT_CALLBACKS)}
        if kind is not None:
            self.__dict__["callback_step"] = self._step
        if kind == "adaptive":
            self.__dict__.update(callback_accept_step=self._accept, callback_reject_step=self._reject)
        for name in _ADJOINT_CALLBACKS:
            if self.user[name] is not None:  # the adjoint's state is a tuple (y, a, ...): passed on as is
                self.__dict__[name] = self.user[name]

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # a private wrapper nobody hooks: straight to forward (nn.Module's hook dispatch costs per evaluation)
        return self.forward(t, y)

    def _user(self, name: str, t0, y0, dt) -> None:
        user = self.user[name]
        if user is not None:
            user(-t0 if self.sign < 0 else t0, unflatten(y0, self.shapes), dt)

    def _step(self, t0, y0, dt) -> None:
        self.n_steps += 1
        if self.max_num_steps is not None and self.n_steps > self.max_num_steps:
            at = float(torch.as_tensor(t0).detach()) * self.sign
            raise SolverError(
                f"max_num_steps={self.max_num_steps} exceeded at t={at:.6g}; raise "
                "`options['max_num_steps']` or loosen `rtol`/`atol` (the field may be stiff).",
                reason=Reason.MAX_STEPS,
            )
        if self.recorder is not None:
            if self.kind == "fixed":
                self.recorder.accept(t0, y0, dt)
            else:
                self.recorder.step(t0, y0, dt)
        self._user("callback_step", t0, y0, dt)

    def _accept(self, t0, y0, dt) -> None:
        if self.recorder is not None:
            self.recorder.accept(t0, y0, dt)
        self._user("callback_accept_step", t0, y0, dt)

    def _reject(self, t0, y0, dt) -> None:
        if self.recorder is not None:
            self.recorder.reject(t0, y0, dt)
        self._user("callback_reject_step", t0, y0, dt)

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.with_rows:
            if self.all_rows is None or self.all_rows.shape[0] != y.shape[0]:
                self.all_rows = torch.arange(y.shape[0], device=y.device)
            out = self.func(-t if self.sign < 0 else t, y, rows=self.all_rows)
        else:
            out = self.func(-t if self.sign < 0 else t, unflatten(y, self.shapes))
        if not self.checked:
            check_field_output(out, unflatten(y, self.shapes), "`func`", "func(t, y)")
            self.checked = True
        if self.shapes is not None:
            out = torch.cat([o.reshape(-1) for o in out])
        out = -out if self.sign < 0 else out
        if self.recorder is not None:
            self.recorder.evaluated(out)
        return out


def _attribute(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)`` without a module's ``__getattr__`` raising and catching an ``AttributeError``
    for each absent callback (a few microseconds each, on every solve)."""
    if isinstance(obj, nn.Module) and not hasattr(type(obj), name) and name not in obj.__dict__:
        found = [d[name] for d in (obj._parameters, obj._buffers, obj._modules) if name in d]
        return found[0] if found else None
    return getattr(obj, name, None)


def kind(method: str) -> str | None:
    if method in ADAPTIVE or method in REVERSIBLE_METHODS:
        return "adaptive"
    return "fixed" if method in FIXED or method in IMPLICIT or method in SPLIT_METHODS else None


def flip_options(options: dict, sign: float, shapes: list[torch.Size] | None, adjoint: bool = False) -> dict:
    """Options in the engine's time and state: negated ``step_t``/``jump_t``/grid, a tuple state's ``norm``."""
    options = negated_time_options(options) if sign < 0 else dict(options)
    if shapes is not None and callable(options.get("norm")) and not isinstance(options["norm"], StateNorm):
        norm = options["norm"]
        if adjoint:  # the backward state (t, y, a, *parameter gradients): y and a in the user's parts
            options["norm"] = lambda s: norm((s[0], *unflatten(s[1], shapes), *unflatten(s[2], shapes), *s[3:]))
        else:
            options["norm"] = lambda y: norm(unflatten(y, shapes))
    return options


def state_norm(options: dict, shapes: list[torch.Size] | None, method: str) -> dict:
    """``options`` with torchdiffeq's default error norm of a tuple state for an adaptive method: the largest of
    its parts' RMS norms (:class:`~solvers.norms.StateNorm`) where ``options`` name no ``norm``."""
    if shapes is None or method not in ADAPTIVE or "norm" in options:
        return options
    return {**options, "norm": StateNorm([s.numel() for s in shapes])}


def tolerance(tol: Any, shapes: list[torch.Size] | None, name: str) -> Any:
    """``rtol`` or ``atol`` as the engine takes it (a tuple state's tuple as one flat tensor), checked
    (:func:`~solvers.validation.check_tolerance`: torchdiffeq's ``0`` allowed, a negative value refused)."""
    check_tolerance(name, tol, zero_ok=True)
    return _flat_tolerance(tol, shapes, name)


def _flat_tolerance(tol: Any, shapes: list[torch.Size] | None, name: str) -> Any:
    if isinstance(tol, torch.Tensor) and tol.requires_grad:
        raise ValueError(f"`{name}` must not require grad.")
    if shapes is not None and isinstance(tol, tuple | list):
        if len(tol) != len(shapes):
            raise ValueError(f"`{name}` as a tuple needs one tolerance per part of `y0` ({len(shapes)}).")
        return torch.cat([torch.as_tensor(v, dtype=torch.float64).expand(s).reshape(-1) for v, s in zip(tol, shapes)])
    return tol


def tolerances(rtol: Any, atol: Any, shapes: list[torch.Size] | None) -> tuple[Any, Any]:
    """Both tolerances (:func:`tolerance`), refused where both are zero."""
    check_tolerances(rtol, atol, zero_ok=True)
    return _flat_tolerance(rtol, shapes, "rtol"), _flat_tolerance(atol, shapes, "atol")


def solve_flat(
    func: Problem,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    rtol: Any,
    atol: Any,
    method: str,
    options: dict,
    gradient: GradientMethod,
    params: tuple[torch.Tensor, ...],
    adjoint: dict,
) -> torch.Tensor:
    """Solve the flat, forwards problem (``t`` increasing, detached) on the engine (:func:`solvers.engine.solve`),
    the same core ``ODEBlock`` calls. ``gradient``: a registered gradient method; the adjoint's backward settings
    come per call in ``adjoint`` (torchdiffeq's ``adjoint_*`` arguments)."""
    backward = None
    if isinstance(gradient, Adjoint) and adjoint:
        backward = Backward(adjoint["rtol"], adjoint["atol"], adjoint["method"], adjoint["options"])
    step_size, grid = None, None
    if method in REVERSIBLE_METHODS or method in SPLIT_METHODS:  # the block's own methods: the grid is handed over
        options = dict(options)
        step_size = options.pop("step_size", None)
        grid = None if step_size is None else step_grid(step_size)(func, y0, t)
    settings = _Settings(method, rtol, atol, options, step_size, max_steps=func.max_num_steps or 2**62)
    interpolated = method in IMPLICIT
    run = Run(func, y0, t, settings, options, params, grid=grid, interpolated=interpolated, backward=backward)
    return solve(run, gradient)


@dataclass(frozen=True)
class _Settings:
    """The forward solve's settings as torchdiffeq's arguments give them (tolerances may be tensors); the step
    budget (``max_num_steps``) is counted by :class:`Problem`."""

    method: str
    rtol: Any
    atol: Any
    options: dict
    step_size: float | None = None
    max_steps: int = 2**62
