r"""Per-sample adaptive step control: every sample of a batch on its own time, step size and error ratio.

A shared-step solver (torchdiffeq, :mod:`solvers.steppers.fast_rk`) measures one error norm over the whole batch, so the
stiffest sample sets everyone's step: on a batch of Van der Pol oscillators with ``μ`` drawn from ``[1, 25]`` it
takes about 2.7 times the steps of the median sample. Here each sample ``b`` carries its own clock: the step of
Hairer, Nørsett & Wanner ("Solving Ordinary Differential Equations I", §II.4) is taken on every row at once,

    ``Y_i = y + h_b Σ_{j<i} a_ij k_j``,   ``k_i = F(t_b + c_i h_b, Y_i)``,   ``err_b = h_b Σ_i e_i k_i``,

with the error ratio ``r_b = ‖err_b / (atol_b + rtol_b max(|y_b|, |y_{b,1}|))‖_RMS`` taken over the sample's own
components; the sample's step is accepted where ``r_b ≤ 1`` and its next step comes from the PI controller of
Hairer's DOPRI5 code (Gustafsson 1991; Hairer & Wanner, "Solving Ordinary Differential Equations II", §IV.2;
:mod:`solvers.per_sample.control`), the initial step that of Hairer, Nørsett & Wanner's algorithm on the sample
alone. The shared step keeps torchdiffeq's rule (an accepted step never shrinks the next), bit for bit; the PI
rule takes fewer calls per sample (1178 batched calls against 1424 on the mixed Van der Pol batch of
``benchmarks/per_sample.py``). Acceptance, the step update and the state update
are ``torch.where`` on the device. Every sweep makes one batched field evaluation per stage over the samples still
running; samples that pass their last output time leave the batch (their rows are dropped once a quarter of the
running rows have finished, until no more than a sixteenth of the batch is left; until then they ride along frozen
at their end), so late sweeps cost less. One small
tensor is read back per sweep (how many samples still run, whether any failed, whether an output time was
passed), and one more per output time passed. So every sample takes the steps it would take alone, and the field
is called ``max_b(nfe_b)`` times: the count of the sample that needs the most.

Outputs are read off the accepted step that holds them, with the method's dense output
(:mod:`solvers.steppers.fast_rk`): ``y(t_0 + x h) = y_0 + h Σ_i β_i(x) k_i``. Methods: ``dopri5``, ``bosh3``
and ``tsit5`` (its own continuous extension; :mod:`solvers.steppers.tableaux`).

The field sees ``t`` of shape ``(m,)`` (one time per running row, in the state's dtype) and ``y`` of shape
``(m, *state)``, the rows in batch order; it must be row-wise (a row's derivative depends on that row alone).
Without a graph (no gradient, or a replaying gradient's forward) both are buffers the next sweep writes again:
a field that keeps them past its call must copy them.
Gradients (:mod:`solvers.per_sample.grads`, :mod:`solvers.per_sample.adjoint`): ``backprop`` through the sweeps,
``checkpoint`` and ``symplectic`` replaying each sweep from its stored inputs (the same per-sample steps: the
gradient of the steps taken, as backprop's), and the continuous ``adjoint`` with a per-sample backward solve.
Every row's step sizes are functions of its state through its error ratio and the PI controller, differentiated
as such (:mod:`solvers.gradients.step_sizes`, :mod:`solvers.per_sample.steps`; ``steps="fixed"`` holds them constant).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..controllers import is_per_sample
from ..errors import check_positive_int
from ..options import PER_SAMPLE_METHODS, validate_tolerances
from ..steppers.tableaux import TABLEAUX
from .adjoint import adjoint_rows
from .grads import advance_for, integrate_rows
from .loop import TIME_SPAN, PerSampleInfo, Stepper

__all__ = [
    "PER_SAMPLE_GRADIENTS",
    "PER_SAMPLE_METHODS",
    "TIME_SPAN",
    "PerSampleInfo",
    "check_per_sample_gradient",
    "odeint_per_sample",
    "wants_rows",
]

_OPTIONS = {
    "first_step",
    "max_step",
    "min_step",
    "safety",
    "ifactor",
    "dfactor",
    "max_num_steps",
    "jump_t",
    "time_spans",
}

Tol = float | torch.Tensor
PER_SAMPLE_GRADIENTS = ("backprop", "checkpoint", "symplectic", "adjoint")


def _times(t: Any, t_end: Any, y0: torch.Tensor) -> torch.Tensor:
    """The output times as ``(batch, n)`` float64 on ``y0``'s device, checked."""
    B = y0.shape[0]
    kw: dict[str, Any] = dict(dtype=torch.float64, device=y0.device)
    if t_end is not None:
        if isinstance(t_end, torch.Tensor) and t_end.requires_grad and torch.is_grad_enabled():
            raise ValueError("per-sample control does not differentiate end times; pass `t_end.detach()`.")
        te = torch.as_tensor(t_end).detach().to(**kw)
        if te.shape != (B,):
            raise ValueError(
                f"`t_end` must have shape (batch,) = ({B},), one end time per sample; got {tuple(te.shape)}."
            )
        start = torch.zeros((), **kw) if t is None else torch.as_tensor(t).detach().to(**kw).reshape(-1)
        if start.numel() != 1:
            raise ValueError(
                "with `t_end`, `t` is the common start time (a number or None for 0); pass per-sample "
                "output times as `t` of shape (batch, n) instead of `t_end`."
            )
        times = torch.stack((start.expand(B), te), 1)
    else:
        if t is None:
            raise ValueError("pass the output times `t` ((n,) or (batch, n)) or the end times `t_end` ((batch,)).")
        times = torch.as_tensor(t).to(**kw)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError("per-sample control does not differentiate output times; pass `t.detach()`.")
        if times.dim() == 1:
            times = times.expand(B, -1)
        if times.dim() != 2 or times.shape[0] != B or times.shape[1] < 2:
            raise ValueError(
                f"`t` must have shape (n,) or (batch, n) = ({B}, n) with n >= 2 (start and end); "
                f"got {tuple(times.shape)}."
            )
    if not bool(torch.isfinite(times).all()):
        raise ValueError("`t` holds NaN/inf; output times must be finite.")
    bad = ~(times[:, 1:] > times[:, :-1]).all(1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"the output times of sample {i} are not strictly increasing ({times[i].tolist()}); per-sample control "
            "integrates forwards: sort each row of `t` (and give each `t_end` after the start)."
        )
    return times.contiguous()


def _tolerance(name: str, value: Tol, B: int, y0: torch.Tensor) -> torch.Tensor:
    """A tolerance as a ``(m, 1)`` column in the state's dtype: a number for all, or ``(batch,)`` per sample."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.shape != (B,):
            raise ValueError(f"`{name}` must be a number or a (batch,) = ({B},) tensor; got {tuple(value.shape)}.")
        for v in value.tolist():
            validate_tolerances(v, v)
        return value.detach().to(dtype=y0.dtype, device=y0.device).reshape(B, 1)
    v = float(value)
    validate_tolerances(v, v)
    return torch.full((B, 1), v, dtype=y0.dtype, device=y0.device)


class _Field:
    """The user's field on ``(m, N)`` rows, counted; every call checks the output's shape (a field that
    broadcasts a scalar-time assumption or full-batch data against fewer rows would otherwise go wrong). During
    the forward solve a module without hooks is called through its ``forward`` (:func:`_plain_forward`)."""

    def __init__(self, func: Callable, shape: torch.Size, info: PerSampleInfo, rows: bool):
        self.func, self.shape, self.info, self.rows = func, shape, info, rows
        self.call = _plain_forward(func)
        self.flat = len(shape) == 1  # a (batch, N) state: no reshaping
        self.counts: PerSampleInfo | None = info  # once the forward solve is done: the backward pass's, if any

    def forward_done(self) -> None:
        """The forward solve is over: the backward pass (replays, the adjoint) calls the field as given."""
        self.counts, self.call = self.info.backward, self.func

    def __call__(self, t: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        m = y.shape[0]
        try:
            ys = y if self.flat else y.view(m, *self.shape)
            k = self.call(t, ys, ids) if self.rows else self.call(t, ys)
        except Exception as exc:
            note = getattr(exc, "add_note", None)  # Python 3.11+: the user's exception, unchanged but for a note
            if note is not None:
                B = self.info.steps.shape[0]
                handed = f"{m} of the batch's {B} rows (finished samples leave the batch)" if m < B else f"{m} rows"
                note(
                    f"controller='per_sample' called the field with `t` of shape ({m},) and {handed}: a field "
                    "that needs a scalar `t` must use the shared step (controller='batch'); one with per-sample "
                    f"data (a tensor of length {B}) must read it for the rows it is handed: give its forward a "
                    "third parameter named `rows`, forward(t, y, rows), and it receives their batch indices "
                    "(use data[rows])."
                )
            raise
        if not isinstance(k, torch.Tensor) or k.shape != (y.shape if self.flat else (m, *self.shape)):
            got = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
            raise ValueError(
                f"the field returned {got} for a state of shape {(m, *self.shape)} and `t` of shape ({m},); "
                "controller='per_sample' passes one time per running sample: broadcast `t` against the rows "
                "(e.g. t[:, None]) and read per-sample data for the rows running (give forward a parameter "
                "`rows`: forward(t, y, rows) receives their batch indices), or use the shared step "
                "(controller='batch')."
            )
        if self.counts is not None:
            self.counts.nfe += 1
            self.counts.rows += m
        return k if self.flat else k.reshape(m, -1)


def _check_call(method: str, y0: torch.Tensor, options: Mapping[str, Any] | None) -> dict:
    """A copy of ``options`` once ``method``, ``y0`` and the options' names are checked."""
    if method not in PER_SAMPLE_METHODS:
        raise ValueError(
            f"controller='per_sample' serves methods {list(PER_SAMPLE_METHODS)}, not {method!r}; use one of them, "
            "or the shared step (controller='batch') for other methods."
        )
    if not isinstance(y0, torch.Tensor) or y0.dim() < 1 or not y0.is_floating_point():
        raise ValueError("`y0` must be a float tensor of shape (batch, *state).")
    opts = dict(options or {})
    unknown = set(opts) - _OPTIONS
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for controller='per_sample'; valid: {sorted(_OPTIONS)}.")
    return opts


def _empty_batch(func: Callable[..., torch.Tensor], y0: torch.Tensor, times: torch.Tensor, rows) -> torch.Tensor:
    """An empty batch: nothing to integrate; one evaluation joins the result to ``func``'s graph."""
    t0 = times[:, 0].to(y0.dtype)
    f0 = func(t0, y0, torch.zeros(0, dtype=torch.long, device=y0.device)) if rows else func(t0, y0)
    return (y0 + 0 * f0).unsqueeze(0).expand(times.shape[1], *y0.shape)


def odeint_per_sample(
    func: Callable[..., torch.Tensor],
    y0: torch.Tensor,
    t: Any = None,
    *,
    t_end: Any = None,
    method: str = "dopri5",
    rtol: Tol = 1e-6,
    atol: Tol = 1e-8,
    options: Mapping[str, Any] | None = None,
    rows: bool | None = None,
    gradient: Any = "backprop",
    params: Sequence[torch.Tensor] | None = None,
    return_info: bool = False,
) -> Any:
    """Solve ``y_b' = func(t, y)_b`` for every sample ``b`` of ``y0`` (``(batch, *state)``) on its own steps.

    Args:
        t: output times, ``(n,)`` for all samples or ``(batch, n)`` per sample, each row strictly increasing; the
            first column is each sample's start, the last its end.
        t_end: instead of ``t``: ``(batch,)`` end times (``t`` then a common start, default 0).
        rtol, atol: numbers, or ``(batch,)`` tensors of per-sample tolerances.
        options: ``first_step``, ``max_step``, ``min_step``, ``safety`` (0.9), ``ifactor`` (10), ``dfactor`` (0.2);
            and, as torchdiffeq names them, ``max_num_steps`` (attempted steps allowed per sample before
            :class:`~solvers.errors.SolverError`, default 100 000) and ``jump_t`` (times where ``func`` jumps,
            common to all samples: a step that would cross one is shortened to end on it, and the next step's first
            stage is read just after it); ``time_spans``: every time tensor ``func`` sees carries the least and
            greatest of its values on the host, ``getattr(t, TIME_SPAN)``, read with each sweep's counts: a
            piecewise field finds the pieces in force without a read of its own.
        rows: call ``func(t, y, rows)`` with ``rows`` the ``(m,)`` batch indices of the running rows (for a field
            with per-sample data: gather it with ``data[rows]``); default: when ``func`` (its ``forward``, for a
            module) has a parameter named ``rows`` (:func:`wants_rows`).
        gradient: ``"backprop"`` (default), ``"checkpoint"``, ``"symplectic"`` or ``"adjoint"``, or the gradient
            method object (``Adjoint(rtol=1e-8)`` sets the backward solve's tolerances).
        params: for ``"checkpoint"``, ``"symplectic"`` and ``"adjoint"``, the tensors ``func`` reads whose
            gradients are wanted (default: ``func``'s parameters when it is a module).
        return_info: also return the :class:`PerSampleInfo`.

    Returns ``(n, batch, *state)``: ``out[j, b]`` is sample ``b`` at ``t[b, j]`` (and the info if asked).
    """
    opts = _check_call(method, y0, options)
    max_steps = check_positive_int("options['max_num_steps']", opts.pop("max_num_steps", 100_000), "attempted steps")
    jump_t, time_spans = opts.pop("jump_t", None), opts.pop("time_spans", False)
    name = _gradient_name(gradient, method)
    times = _times(t, t_end, y0)
    B = y0.shape[0]
    if B == 0:
        out = _empty_batch(func, y0, times, rows)
        return (out, PerSampleInfo.zeros(0, y0.device)) if return_info else out
    info = PerSampleInfo.zeros(B, y0.device)
    F = _Field(func, y0.shape[1:], info, wants_rows(func) if rows is None else rows)
    stepper = Stepper(F, TABLEAUX[method], y0, opts, B)
    stepper.jumps = _jumps(jump_t, y0.device)
    stepper.spans = time_spans
    rt, at = _tolerance("rtol", rtol, B, y0), _tolerance("atol", atol, B, y0)
    y = y0.reshape(B, -1)
    graph = torch.is_grad_enabled()
    stepper.differentiated = graph and name != "adjoint" and _steps(gradient) == "differentiated"
    if name in ("checkpoint", "symplectic", "adjoint") and graph:
        params = _params(func, params, name)
        info.backward = PerSampleInfo.zeros(B, y0.device)
    if name == "adjoint" and graph:
        cfg = dict(stepper=stepper, times=times, rtol=rt, atol=at, info=info, max_steps=max_steps)
        cfg |= dict(adjoint_rtol=getattr(gradient, "rtol", None), adjoint_atol=getattr(gradient, "atol", None))
        cfg |= dict(first_step=opts.get("first_step"), design=getattr(gradient, "design", "joint"))
        out = adjoint_rows(cfg, y, params or ())
    else:
        mode = name if graph and name != "adjoint" else "none"
        advance = advance_for(mode, stepper, params or ())
        kw: dict[str, Any] = dict(max_steps=max_steps, first_step=opts.get("first_step"), advance=advance)
        out = integrate_rows(stepper, y, times, rt, at, info, **kw)
    F.forward_done()
    out = out.view(times.shape[1], *y0.shape)
    return (out, info) if return_info else out


_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _plain_forward(func: Callable) -> Callable:
    """``func.forward`` for a module that ``nn.Module.__call__`` would only forward to (no hooks of its own or
    global, not compiled, not traced: its fast path), else ``func``: the forward solve calls the field several
    times a sweep, and the two Python frames of ``__call__`` cost about 0.9 µs a call (4 % of the mixed Van der
    Pol batch's forward). Read once per solve: hooks added while it runs count from the next solve."""
    if not isinstance(func, nn.Module) or type(func).__call__ is not nn.Module.__call__:
        return func
    own = (func._forward_hooks, func._forward_pre_hooks, func._backward_hooks, func._backward_pre_hooks)
    from torch.nn.modules import module

    shared = [getattr(module, name, True) for name in _GLOBAL_HOOKS]  # a name torch no longer has: keep __call__
    if any(own) or any(shared) or func._compiled_call_impl is not None or torch._C._get_tracing_state():
        return func
    return func.forward


def _jumps(jump_t: Any, device: torch.device) -> torch.Tensor | None:
    """``jump_t`` sorted, float64, ``inf`` appended (the "next jump" past the last); ``None`` for none."""
    if jump_t is None:
        return None
    jumps = torch.as_tensor(jump_t, dtype=torch.float64).detach().reshape(-1).to(device)
    if not bool(torch.isfinite(jumps).all()):
        raise ValueError("`jump_t` must hold finite times.")
    return torch.cat((jumps.sort().values, jumps.new_full((1,), torch.inf))) if len(jumps) else None


def wants_rows(func: Callable) -> bool:
    """Whether ``func`` takes the batch indices of the rows it is handed: its ``forward`` (a module) or itself
    has a parameter named ``rows`` (the one way a field reads per-sample data, in every door: finished samples
    leave a per-sample or stopping batch, so a field holding a tensor of one entry per sample reads
    ``data[rows]``). Asked on every solve, so read once per module class (a ``forward`` set on the instance is
    read each time) and, for a plain function, off its code object rather than by ``inspect.signature``."""
    if isinstance(func, nn.Module) and "forward" not in func.__dict__:
        cls = type(func)
        if cls not in _ROWS_BY_CLASS:
            _ROWS_BY_CLASS[cls] = _takes_rows(func.forward)
        return _ROWS_BY_CLASS[cls]
    return _takes_rows(func.forward if isinstance(func, nn.Module) else func)


_ROWS_BY_CLASS: dict[type, bool] = {}


def _takes_rows(fn: Callable) -> bool:
    code = getattr(fn, "__code__", None)
    if isinstance(fn, types.FunctionType | types.MethodType) and code is not None and not hasattr(fn, "__wrapped__"):
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        return "rows" in names
    try:
        return "rows" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False


def check_per_sample_gradient(controller: Any, gradient: Any, method: str) -> None:
    """Refuse, at construction, a gradient method per-sample steps do not serve."""
    if is_per_sample(controller):
        _gradient_name(gradient, method)


def _gradient_name(gradient: Any, method: str) -> str:
    """The gradient method's short name, if per-sample steps serve it; else an error naming those that do."""
    name = gradient if isinstance(gradient, str) else getattr(gradient, "name", repr(gradient))
    if name not in PER_SAMPLE_GRADIENTS:
        raise ValueError(
            f"gradient={name!r} does not serve per-sample steps; controller='per_sample' takes gradient "
            f"{list(PER_SAMPLE_GRADIENTS)}, or use the shared step (controller='batch') for {name!r}."
        )
    if getattr(gradient, "budget", None) is not None:
        raise ValueError(
            f"controller='per_sample' keeps every sweep's inputs; {gradient!r} has a `budget` it would ignore: "
            "drop budget=, or use the shared step (controller='batch') for the budget."
        )
    if name == "adjoint" and not isinstance(gradient, str):
        backward_method = getattr(gradient, "method", None)
        if backward_method not in (None, method):
            raise ValueError(
                f"controller='per_sample' solves the adjoint backwards with the forward's method {method!r}; "
                f"drop Adjoint(method={backward_method!r})."
            )
        if not getattr(gradient, "seminorm", True):
            raise ValueError(
                "controller='per_sample' keeps the parameter gradient out of the backward solve's error norm "
                "(it is the method's quadrature, not a state): drop Adjoint(seminorm=False)."
            )
    return name


def _steps(gradient: Any) -> str:
    """What the gradient differentiates of the step sizes (:mod:`solvers.gradients.step_sizes`): per-sample control has
    its own controller, so torchdiffeq's setting has no counterpart here."""
    steps = getattr(gradient, "steps", "differentiated")
    if steps == "torchdiffeq":
        raise ValueError(
            "steps='torchdiffeq' reproduces torchdiffeq's backprop through its shared step; controller='per_sample' "
            "has its own controller: use steps='differentiated' (the default) or 'fixed'."
        )
    return steps


def _params(func: Any, params: Sequence[torch.Tensor] | None, name: str) -> list[torch.Tensor]:
    """The tensors a replay or adjoint backward pass differentiates: ``params``, or a module's parameters."""
    if params is not None:
        return [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]
    if isinstance(func, nn.Module):
        return [p for p in func.parameters() if p.requires_grad]
    raise ValueError(
        f"gradient={name!r} differentiates the tensors `func` reads through its own backward pass: pass them as "
        "`params=[...]` (a module's parameters are taken by default), or use gradient='backprop', which follows "
        "any tensor `func` reads."
    )
