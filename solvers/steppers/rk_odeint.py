r"""torchdiffeq's ``odeint`` contract for the explicit Runge-Kutta methods, on the library's own stepper.

:func:`solvers.steppers.fast_rk.odeint_fast` takes one tensor over increasing times. The continuous adjoint's backward
solve needs more: its state is a tuple (the state ``y``, its adjoint ``a``, the parameter gradients), it runs
from ``t_i`` down to ``t_{i−1}``, and its error norm is a function of the tuple. :func:`odeint_rk` reduces such a
solve to the stepper's as torchdiffeq reduces it to its own loop, so that the steps are the same:

- a tuple state is one flat tensor, its parts concatenated (a complex part as its real and imaginary parts), the
  field's output likewise; the norm sees the parts (by default the largest of their RMS norms,
  :class:`~solvers.norms.StateNorm`), and so do the callbacks;
- decreasing times run forwards in ``s = −t`` on the field ``−F(−s, y)``, with ``jump_t``/``step_t`` negated and
  a grid constructor asked in ``t`` (:func:`solvers.grids.negated_time_options`); callbacks see ``t``.

Every method of :data:`solvers.steppers.tableaux.TABLEAUX` that continuous mode serves runs here, with cde_nets'
tableaux and dense outputs (so ``bosh3``'s interpolant is the third-order one, and ``tsit5`` exists); the Adams methods
and ``scipy_solver``, which only torchdiffeq has, go to its public ``odeint`` under their own names, and so do the
fixed-step methods on a half-precision state (float16, bfloat16: the stepper rounds its weights and times in
float32 or float64; torchdiffeq's ``euler`` … ``rk4`` are the same methods).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..grids import negated_time_options, stepper_options
from ..norms import StateNorm
from . import fast_rk
from .fast_rk import FAST_METHODS, STEPPER_OPTIONS, odeint_fast

__all__ = ["odeint_rk", "rk_options"]

_CALLBACKS = ("callback_step", "callback_accept_step", "callback_reject_step")
# While ``fast_rk.ENABLED`` is False the tests route every solve here to this reference (torchdiffeq's own loop,
# with cde_nets' interpolants: tests/torchdiffeq_reference.py), called as ``torchdiffeq.odeint``, to compare the
# stepper with the integrator of record step for step.
REFERENCE: Callable[..., Any] | None = None


def rk_options(options: Mapping | None, y0: Any) -> dict:
    """torchdiffeq's options of an explicit Runge-Kutta method as the stepper takes them: ``step_size`` as the
    grid constructor torchdiffeq builds from it, the default ``interp="linear"`` and a ``dtype`` that leaves the
    times in float64 dropped. Raises ``ValueError`` naming any other key."""
    options = stepper_options(dict(options or {}))
    if "dtype" in options:
        real = _real_dtype(y0)
        if torch.promote_types(options["dtype"], real) != torch.float64:
            raise ValueError(
                f"options['dtype']={options['dtype']} would step the times in {real}: the library's stepper keeps "
                "them in float64. Drop `dtype` (or pass torch.float64)."
            )
        options.pop("dtype")
    options.pop("max_num_steps", None)  # torchdiffeq's limit: the counting wrapper enforces it as `max_steps`
    unknown = sorted(set(options) - STEPPER_OPTIONS)
    if unknown:
        raise ValueError(f"options {unknown} are not taken by the library's Runge-Kutta stepper.")
    return options


def _real_dtype(y0: Any) -> torch.dtype:
    first = y0 if isinstance(y0, torch.Tensor) else y0[0]
    return first.real.dtype if first.is_complex() else first.dtype


def odeint_rk(
    func: Callable[[torch.Tensor, Any], Any],
    y0: torch.Tensor | tuple[torch.Tensor, ...],
    t: torch.Tensor,
    *,
    rtol: Any,
    atol: Any,
    method: str,
    options: Mapping | None = None,
    graph: bool = True,
    steps: str = "differentiated",
    land_on_jumps: bool = False,
) -> Any:
    """``torchdiffeq.odeint(func, y0, t, rtol=, atol=, method=, options=)``: ``y0`` a tensor or a tuple of them,
    ``t`` increasing or decreasing (and detached); the callbacks of ``func`` are called as torchdiffeq calls them.
    ``method`` is a library name; without ``graph`` the solve runs under no-grad. ``steps`` and ``land_on_jumps``:
    see :func:`~solvers.steppers.fast_rk.odeint_fast`. Returns ``(len(t), *y0.shape)``, a tuple of them for a tuple
    ``y0``."""
    if method not in FAST_METHODS or _real_dtype(y0) not in (torch.float32, torch.float64):
        # the Adams methods, scipy_solver, and half-precision states of the fixed-step methods (the stepper rounds
        # its weights and times in float32/float64)
        import torchdiffeq  # here, not at import: torchdiffeq loads scipy

        return torchdiffeq.odeint(func, y0, t, rtol=rtol, atol=atol, method=method, options=dict(options or {}))
    if not fast_rk.ENABLED and REFERENCE is not None:
        return REFERENCE(func, y0, t, rtol=rtol, atol=atol, method=method, options=dict(options or {}))
    if t.requires_grad:
        raise ValueError("odeint_rk: `t` must not require grad (detach it; its gradient is the caller's).")
    options = dict(options or {})
    parts: _Parts | None = None
    if not isinstance(y0, torch.Tensor):
        parts = _Parts(y0)
        func = _Flat(func, parts)
        norm = options.get("norm")
        options["norm"] = StateNorm(parts.sizes) if norm is None else parts.norm(norm)
        y0 = parts.flat(y0)
    if len(t) > 1 and bool(t[0] > t[1]):
        t, func, options = -t, _Reversed(func), negated_time_options(options)
    options = rk_options(options, y0)  # after the negation: a `step_size` grid is laid out in the solve's time
    kw = dict(rtol=rtol, atol=atol, options=options, graph=graph, steps=steps, land_on_jumps=land_on_jumps)
    ys = odeint_fast(func, y0, t, method=method, **kw)
    return ys if parts is None else parts.split(ys)


class _Parts:
    """The parts of a tuple state and the flat real tensor they make (a complex part as its real and imaginary
    parts, last)."""

    def __init__(self, y0: Sequence[torch.Tensor]):
        self.shapes = [y.shape for y in y0]
        self.complex = [y.is_complex() for y in y0]
        self.sizes = [y.numel() * (2 if c else 1) for y, c in zip(y0, self.complex)]

    def flat(self, ys: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([(torch.view_as_real(y) if c else y).reshape(-1) for y, c in zip(ys, self.complex)])

    def split(self, flat: torch.Tensor, lead: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """The parts of ``flat`` (``(*lead, n)``; by default all but the last axis lead)."""
        lead = tuple(flat.shape[:-1]) if lead is None else lead
        out = []
        for part, shape, c in zip(flat.split(self.sizes, dim=-1), self.shapes, self.complex):
            if c:
                pairs = part.reshape((*lead, *shape, 2))
                if pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
                    pairs = pairs.clone()  # a complex view needs whole pairs
                out.append(torch.view_as_complex(pairs))
            else:
                out.append(part.reshape((*lead, *shape)))
        return tuple(out)

    def norm(self, norm: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda flat: norm(self.split(flat, ()))


def _forward_callbacks(wrapper: Any, func: Any, convert: Callable) -> None:
    for name in _CALLBACKS:
        callback = getattr(func, name, None)
        if callback is not None:
            setattr(wrapper, name, lambda t0, y, dt, _cb=callback: _cb(*convert(t0, y), dt))


class _Flat:
    """A field of a tuple state as the field of the flat tensor. Callbacks get the parts of a copy: without a
    graph the stepper's state lives in buffers it reuses, and a callback may keep a part (as the piecewise
    adjoint keeps its readings)."""

    def __init__(self, func, parts: _Parts):
        self.func, self.parts = func, parts
        _forward_callbacks(self, func, lambda t0, y: (t0, parts.split(y.clone(), ())))

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.parts.flat(self.func(t, self.parts.split(y, ())))


class _Reversed:
    """``−F(−s, y)``: the field in the time ``s = −t``."""

    def __init__(self, func):
        self.func = func
        _forward_callbacks(self, func, lambda s0, y: (-s0, y))

    def __call__(self, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -self.func(-s, y)
