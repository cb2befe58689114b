r"""The engine beneath :mod:`cde_nets.functional` (torchdiffeq's ``odeint`` API): the user's problem normalised to
one flat state integrated forwards, and the one function that hands it to the engine.

A tuple state is concatenated into one tensor (its default error norm stays torchdiffeq's, the largest of its parts'
RMS norms: :func:`state_norm`); decreasing times ``t`` are negated (``s = −t``,
``dy/ds = −func(−s, y)``) with the options that hold times (``step_t``, ``jump_t``, a grid constructor); the
user's torchdiffeq callbacks are forwarded in the user's own time and shapes. :func:`solve_flat` then picks the
engine's piece: the fast Runge-Kutta path (:mod:`solvers.fast_rk`), the piecewise seminorm adjoint
(:mod:`solvers.piecewise_adjoint`), the replayed exact gradients (:mod:`solvers.replay`), or torchdiffeq's
``odeint`` contract on the library's stepper (:mod:`solvers.rk_odeint`, :mod:`solvers.rk_adjoint`), which leaves
to torchdiffeq only the methods the engine lacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import Reason, SolverError
from .fast_rk import fast_applies, odeint_fast
from .gradients import Adjoint, Checkpoint, Forward, GradientMethod
from .gradients.forward import jacobian_solve
from .grids import negated_time_options
from .implicit_grid import ImplicitGrid
from .implicit_tableaux import IMPLICIT_TABLEAUX
from .norms import StateNorm
from .per_sample import wants_rows
from .piecewise_adjoint import piecewise_adjoint
from .replay import replay_gradient
from .rk_adjoint import odeint_adjoint_rk
from .rk_odeint import odeint_rk
from .tableaux import TABLEAUX

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
    "unflatten",
]

State = torch.Tensor | tuple[torch.Tensor, ...]

ADAPTIVE = ("dopri8", "dopri5", "tsit5", "bosh3", "fehlberg2", "adaptive_heun")
FIXED = ("euler", "midpoint", "heun2", "heun3", "rk4", "explicit_adams", "implicit_adams", "fixed_adams")
IMPLICIT = tuple(IMPLICIT_TABLEAUX)  # implicit Runge-Kutta on a fixed grid (solvers.implicit_grid)
_FAST_OPTIONS = {"first_step", "max_step", "min_step", "safety", "ifactor", "dfactor", "jump_t", "perturb"}
_FAST_OPTIONS |= {"grid_constructor", "norm", "step_t"}
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
    reported to a replay's ``recorder`` (:mod:`solvers.replay`) while one listens.

    ``kind``: ``"adaptive"``, ``"fixed"`` or ``None`` (scipy, or a plain evaluation): the forward callbacks are
    those the method calls, so that torchdiffeq, given this object, warns only about the user's own."""

    def __init__(
        self,
        func: Callable,
        shapes: list[torch.Size] | None,
        sign: float = 1.0,
        max_num_steps: int | None = None,
        kind: str | None = None,
    ):
        super().__init__()
        self.func, self.shapes, self.sign, self.kind = func, shapes, sign, kind
        self.max_num_steps, self.n_steps = max_num_steps, 0
        self.recorder: Any = None
        # forward(t, y, rows): a field with per-sample data reads it for the batch rows it is handed (all of them
        # on the shared step)
        self.all_rows: torch.Tensor | None = None
        self.with_rows = shapes is None and wants_rows(func)
        self.user = {n: getattr(func, n, None) for n in (*CALLBACKS, *_ADJOINT_CALLBACKS)}
        if kind is not None:
            self.callback_step = self._step
        if kind == "adaptive":
            self.callback_accept_step = self._accept
            self.callback_reject_step = self._reject
        for name in _ADJOINT_CALLBACKS:
            if self.user[name] is not None:
                setattr(self, name, self.user[name])  # the adjoint's state is a tuple (y, a, ...): passed on as is

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
        if self.shapes is not None:
            if not isinstance(out, tuple | list) or len(out) != len(self.shapes):
                raise TypeError(f"`func` must return a tuple of {len(self.shapes)} tensors for a tuple state.")
            out = torch.cat([o.reshape(-1) for o in out])
        out = -out if self.sign < 0 else out
        if self.recorder is not None:
            self.recorder.evaluated(out)
        return out


def kind(method: str) -> str | None:
    return "adaptive" if method in ADAPTIVE else ("fixed" if method in FIXED or method in IMPLICIT else None)


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


def _step_grid(step_size: float) -> Callable:
    """torchdiffeq's fixed-step grid: ``t_0 + k · step_size`` for ``k = 0, 1, …, ⌈(t_N − t_0)/step_size⌉``, the last
    point moved onto ``t_N``."""

    def construct(func, y0, t):
        n = int(torch.ceil((t[-1] - t[0]) / step_size + 1).item())
        grid = torch.arange(0, n, dtype=t.dtype, device=t.device) * step_size + t[0]
        grid[-1] = t[-1]
        return grid

    return construct


def tolerance(tol: Any, shapes: list[torch.Size] | None, name: str) -> Any:
    if isinstance(tol, torch.Tensor) and tol.requires_grad:
        raise ValueError(f"`{name}` must not require grad.")
    if shapes is not None and isinstance(tol, tuple | list):
        if len(tol) != len(shapes):
            raise ValueError(f"`{name}` as a tuple needs one tolerance per part of `y0` ({len(shapes)}).")
        return torch.cat([torch.as_tensor(v, dtype=torch.float64).expand(s).reshape(-1) for v, s in zip(tol, shapes)])
    return tol


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
    """Solve the flat, forwards problem (``t`` increasing, detached) with the engine: the one place the functional
    API calls it, so that a change of the engine's entry point is a change here only. ``gradient``: one of the
    registered gradient methods the functional API serves (backprop, adjoint, checkpoint, symplectic, forward);
    the adjoint's backward settings come in ``adjoint`` (torchdiffeq's ``adjoint_*`` arguments)."""
    if isinstance(gradient, Forward):
        gradient.check(method)
    if method in IMPLICIT:
        return ImplicitGrid(func, method, options).solve(y0, t, gradient.name, params)
    fast_options = dict(options)
    if "step_size" in fast_options:
        step = fast_options.pop("step_size")
        if step is not None:
            fast_options.setdefault("grid_constructor", _step_grid(step))
    if fast_options.get("interp", "linear") == "linear":
        fast_options.pop("interp", None)
    own_norm = "norm" in options and not isinstance(options["norm"], StateNorm)  # a norm of the user's
    fast = (
        set(fast_options) <= _FAST_OPTIONS
        and isinstance(rtol, float | int | torch.Tensor)
        and isinstance(atol, float | int | torch.Tensor)
        and fast_applies(method, gradient.forward_graph, y0, t, params, fast_options)
    )
    if fast:
        return odeint_fast(
            func,
            y0,
            t,
            method=method,
            rtol=rtol,
            atol=atol,
            options=fast_options,
            graph=gradient.forward_graph,
            steps=getattr(gradient, "steps", "differentiated"),
        )
    if isinstance(gradient, Forward):
        return jacobian_solve(
            func, y0, t, params, method=method, rtol=rtol, atol=atol, options=fast_options, gradient=gradient
        )
    if isinstance(gradient, Adjoint):
        adj_options = adjoint["options"]
        if adj_options.get("norm", "seminorm") == "seminorm" and not own_norm and method != "scipy_solver":
            adj_method = adjoint["method"]
            return piecewise_adjoint(
                func,
                y0,
                t,
                params,
                (),
                rtol=rtol,
                atol=atol,
                method=method,
                options=options,
                adjoint_rtol=adjoint["rtol"],
                adjoint_atol=adjoint["atol"],
                adjoint_method=adj_method,
                adjoint_options={k: v for k, v in adj_options.items() if k != "norm"},
                stats=_NoStats(),
                adjoint_adaptive=adj_method in ADAPTIVE,
            )
        return odeint_adjoint_rk(
            func,
            y0,
            t,
            rtol=rtol,
            atol=atol,
            method=method,
            options=options,
            adjoint_rtol=adjoint["rtol"],
            adjoint_atol=adjoint["atol"],
            adjoint_method=adjoint["method"],
            adjoint_options=adj_options,
            adjoint_params=params,
        )
    if isinstance(gradient, Checkpoint):  # and Symplectic, its subclass
        if not gradient.supports(method):
            raise ValueError(gradient.refusal(method))
        return replay_gradient(
            func,
            y0,
            t,
            params,
            (),
            gradient=gradient.name,
            step_back=gradient.step_back,
            tableau=TABLEAUX[method],
            method=method,
            rtol=rtol,
            atol=atol,
            options=options,
            stats=_NoStats(),
            steps=gradient.steps,
        )
    steps = getattr(gradient, "steps", "differentiated")  # the stepper differentiates the step sizes as asked
    return odeint_rk(func, y0, t, rtol=rtol, atol=atol, method=method, options=options, steps=steps)


class _NoStats:
    """The counters the engine's pieces update (the functional API reports none)."""

    nfe_forward = nfe_backward = steps_forward = steps_backward = rejected_forward = rejected_backward = 0
