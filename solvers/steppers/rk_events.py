r"""torchdiffeq's event search (``odeint(..., event_fn=g)``) for the explicit Runge-Kutta methods, on the library's
own stepper.

The search integrates from ``t_0`` until the event function ``g(t, y)`` (several combined into
``min_k g_k(t, y) sign g_k(t_0, y_0)``, so that every one starts positive) changes sign, then bisects
``[t_n, t_{n+1}]``, the step where it did, on the step's interpolant: ``⌈log₂((t_{n+1} − t_n)/atol)⌉`` halvings
keep the half whose ends' signs differ, and the event time is the middle of the last bracket, the state the
interpolant there. As torchdiffeq:

- an adaptive method (Hairer, Nørsett & Wanner, "Solving Ordinary Differential Equations I", §II.4 for the
  steps) asks ``g`` at the end of every attempted step and bisects on the step's dense output, in float64 times
  (the same steps as :func:`~solvers.steppers.fast_rk.odeint_fast`; ``dopri5``'s event times are torchdiffeq's bits);
- a fixed-step method takes steps of ``options["step_size"]`` from ``t_0`` in the state's dtype, bisects on the
  line through the step's ends (``interp="linear"``) or on the cubic Hermite interpolant of its ends and slopes
  (``interp="cubic"``, one more evaluation), and gives up after 20000 steps (``RuntimeError``).

Here a method's dense output is cde_nets' (:mod:`solvers.steppers.tableaux`); the Adams methods and ``scipy_solver`` go
to torchdiffeq's own search.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import fast_rk, rk_odeint
from .complex_state import RealParts
from .fast_rk import _NEXT, _NONE, _PREV, FAST_METHODS, _Adaptive, _Clock, _engine
from .rk_odeint import rk_options
from .tableaux import TABLEAUX

__all__ = ["odeint_event_rk"]

FIXED_MAX_STEPS = 20000  # torchdiffeq's fixed-step search gives up after these


def odeint_event_rk(
    func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    event_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rtol: Any,
    atol: Any,
    method: str,
    options: Mapping | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torchdiffeq.odeint(func, y0, t, rtol=, atol=, method=, options=, event_fn=)`` for a tensor ``y0`` and
    increasing ``t`` (only ``t[0]`` is read): ``(event time, stack([y0, y(event time)]))``, without a graph."""
    if method not in FAST_METHODS:
        import torchdiffeq  # here, not at import: torchdiffeq loads scipy

        return torchdiffeq.odeint(
            func, y0, t, rtol=rtol, atol=atol, method=method, options=dict(options or {}), event_fn=event_fn
        )
    if not fast_rk.ENABLED and rk_odeint.REFERENCE is not None:
        opts = dict(options or {})
        return rk_odeint.REFERENCE(func, y0, t, rtol=rtol, atol=atol, method=method, options=opts, event_fn=event_fn)
    if len(t) != 2:
        raise ValueError(f"an event search needs two times `t` (the start and any later one), got {len(t)}.")
    step = None if options is None else options.get("step_size")
    interp = "linear" if options is None else options.get("interp", "linear")
    opts = rk_options({k: v for k, v in (options or {}).items() if k != "interp"}, y0)
    with torch.no_grad():
        signs = torch.sign(event_fn(t[0], y0))
        event = _Combined(event_fn, signs)
        if y0.is_complex():
            func, real, rtol, atol, opts = RealParts.wrap(func, y0, rtol, atol, opts)
            event = _Combined(lambda s, y: event_fn(s, torch.view_as_complex(y)), signs)
            t_event, y_event = _search(func, real, t, event, rtol, atol, method, opts, step, interp)
            return t_event.to(t), torch.stack([y0, torch.view_as_complex(y_event)])
        t_event, y_event = _search(func, y0, t, event, rtol, atol, method, opts, step, interp)
        return t_event.to(t), torch.stack([y0, y_event])


class _Combined:
    """Several event functions as one that starts positive: ``min_k g_k(t, y) · sign g_k(t_0, y_0)``."""

    def __init__(self, event_fn: Callable, signs: torch.Tensor):
        self.event_fn, self.signs = event_fn, signs

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.min(self.event_fn(t, y) * self.signs)


def _search(func, y0, t, event, rtol, atol, method, options, step, interp) -> tuple[torch.Tensor, torch.Tensor]:
    tab = TABLEAUX[method]
    if tab.adaptive:
        return _adaptive(func, y0, t, event, rtol, atol, tab, options)
    if step is None:
        raise AssertionError(
            "Event handling for fixed step solvers currently requires `step_size` to be provided in options."
        )
    if interp not in ("linear", "cubic"):
        raise ValueError(f"options['interp'] must be 'linear' or 'cubic', got {interp!r}.")
    return _fixed(func, y0, t, event, float(atol), tab, method, options, float(step), interp == "cubic")


def _bisect(
    interpolate: Callable, sign0: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor, event: Callable, tol: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bracket ``[t0, t1]`` halved ``⌈log₂((t1 − t0)/tol)⌉`` times, keeping the half where ``event`` changes
    sign; its middle and the interpolant there."""
    halvings = torch.ceil(torch.log((t1 - t0) / tol) / math.log(2.0))
    for _ in range(int(halvings)):
        mid = (t1 + t0) / 2.0
        same = sign0 == torch.sign(event(mid, interpolate(mid)))
        t0 = torch.where(same, mid, t0)
        t1 = torch.where(same, t1, mid)
    t_event = (t0 + t1) / 2.0
    return t_event, interpolate(t_event)


def _adaptive(func, y0, t, event, rtol, atol, tab, options) -> tuple[torch.Tensor, torch.Tensor]:
    solver = _Adaptive(func, y0, t, tab, rtol, atol, dict(options))
    t_start = t[0].to(torch.float64)

    def at(tf: float) -> torch.Tensor:
        return torch.tensor(tf, dtype=torch.float64, device=y0.device)

    if event(t_start, y0) == 0:
        return t_start, y0
    sign0 = torch.sign(event(t_start, y0))
    eng, last = solver.until(lambda tf, y: bool(sign0 != torch.sign(event(at(tf), y))))
    t0, t1 = float(last[0]), float(last[1])

    def interpolate(s: torch.Tensor) -> torch.Tensor:
        return solver._interpolate(eng, last, float(s))

    return _bisect(interpolate, sign0, at(t0), at(t1), event, torch.as_tensor(atol, dtype=torch.float64))


def _fixed(func, y0, t, event, tol, tab, method, options, step, cubic) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps of ``step`` from ``t[0]``, the times in the state's dtype, until ``event`` changes sign."""
    clock = _Clock(y0)
    perturb = bool(options.get("perturb", False))
    first, last = (_NEXT, _PREV) if perturb else (_NONE, _NONE)
    c = tab.tableau.c
    eng = _engine(func, y0, tab, (tab.tableau.b,), 0.0, 0.0)
    t0 = clock.y(float(t[0]))
    sign0 = torch.sign(event(clock.at(t0), y0))
    y = y0
    for _ in range(FIXED_MAX_STEPS):
        t1 = clock.y(t0 + step)
        eng.set(0, func(clock.at(t0, first), y))
        eng.weights(step)
        times = [
            clock.at(t1 if method == "rk4" else t0 + step * ci, last) if ci == 1.0 else clock.at(t0 + step * ci)
            for ci in c[1:]
        ]
        y1 = eng.run_stages(func, times, fsal=False)
        if bool(sign0 != torch.sign(event(clock.at(t1), y1))):
            return _fixed_bracket(func, clock, event, sign0, t0, t1, y, y1, eng.get(0), tol, cubic)
        t0, y = t1, eng.accept(y1)
    raise RuntimeError(f"Reached maximum number of iterations {FIXED_MAX_STEPS}.")


def _fixed_bracket(func, clock: _Clock, event, sign0, t0, t1, y0, y1, f0, tol, cubic):
    """The bisection on the step ``[t0, t1]``, on its line or its cubic Hermite interpolant (Hairer, Nørsett &
    Wanner, §II.6), the times in the state's dtype."""
    T0, T1 = clock.at(t0), clock.at(t1)
    y0, y1, f0 = y0.clone(), y1.clone(), f0.clone()  # out of the engine's buffers
    f1 = func(T1, y1) if cubic else None

    def interpolate(s: torch.Tensor) -> torch.Tensor:
        x = (s - T0) / (T1 - T0)
        if f1 is not None:
            h = T1 - T0
            h00, h10 = (1 + 2 * x) * (1 - x) * (1 - x), x * (1 - x) * (1 - x)
            h01, h11 = x * x * (3 - 2 * x), x * x * (x - 1)
            return h00 * y0 + h10 * h * f0 + h01 * y1 + h11 * h * f1
        if bool(s == T0):
            return y0
        if bool(s == T1):
            return y1
        return y0 + x * (y1 - y0)

    return _bisect(interpolate, sign0, T0, T1, event, tol)
