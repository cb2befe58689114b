"""Where a solve must step: fixed-step grids aligned with parameter jumps, and the torchdiffeq options that carry
the jumps (``jump_t``) or the grid (``grid_constructor``) to the solver."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .options import ADAPTIVE_METHODS

__all__ = [
    "adjoint_options",
    "aligned_grid",
    "grid_constructor",
    "jump_options",
    "negated_time_options",
    "step_grid",
    "stepper_options",
]


def aligned_grid(boundaries: Sequence[float], step_size: float | None) -> torch.Tensor:
    """A fixed-step grid that contains every piece boundary, with steps of at most ``step_size`` (float64).

    Without ``step_size`` it is the boundaries themselves: one step per piece, the discrete-mode grid.
    """
    pts = [float(boundaries[0])]
    for a, b in zip(boundaries[:-1], boundaries[1:]):
        n = 1 if step_size is None else max(1, math.ceil((b - a) / step_size - 1e-9))
        pts.extend(a + (b - a) * (i / n) for i in range(1, n))
        pts.append(float(b))
    return torch.tensor(pts, dtype=torch.float64)


def grid_constructor(grid: torch.Tensor):
    """torchdiffeq ``grid_constructor``: ``grid`` cut to the span of the requested times, plus those times.

    torchdiffeq calls it with the times as given (decreasing for the adjoint's backward solve, which it then
    negates), so the grid is returned in the same direction.
    """

    def construct(func, y0, t):
        lo, hi = (t[0], t[-1]) if t[0] <= t[-1] else (t[-1], t[0])
        g = grid.to(device=t.device, dtype=t.dtype)
        pts = torch.unique(torch.cat([g[(g >= lo) & (g <= hi)], t]))
        return pts if t[0] <= t[-1] else pts.flip(0)

    return construct


def step_grid(step_size: float):
    """torchdiffeq's fixed-step grid as a ``grid_constructor``: ``t_0 + k · step_size`` for
    ``k = 0, 1, …, ⌈(t_N − t_0)/step_size⌉``, the last point moved onto ``t_N``."""

    def construct(func, y0, t):
        n = int(torch.ceil((t[-1] - t[0]) / step_size + 1).item())
        grid = torch.arange(0, n, dtype=t.dtype, device=t.device) * step_size + t[0]
        grid[-1] = t[-1]
        return grid

    return construct


def stepper_options(options: dict) -> dict:
    """torchdiffeq's options as the library's explicit stepper reads them: ``step_size`` as the grid it makes,
    the default ``interp="linear"`` dropped. Both ``step_size`` and ``grid_constructor`` is refused (torchdiffeq
    would take one and ignore the other)."""
    options = dict(options)
    step = options.pop("step_size", None)
    if step is not None:
        if "grid_constructor" in options:
            raise ValueError("options: `step_size` and `grid_constructor` are exclusive; pass one.")
        options["grid_constructor"] = step_grid(float(step))
    if options.get("interp", "linear") == "linear":
        options.pop("interp", None)
    return options


def jump_options(method: str, jump_t: torch.Tensor | None, grid: torch.Tensor | None) -> dict:
    if method in ADAPTIVE_METHODS:
        return {"jump_t": jump_t} if jump_t is not None and len(jump_t) else {}
    # Evaluate just after a grid point at a step's start and just before it at its end, so a step inside
    # piece l never sees piece l +- 1 through rounding of t.
    opts: dict = {"perturb": True}
    if grid is not None:
        opts["grid_constructor"] = grid_constructor(grid)
    return opts


def adjoint_options(method: str, jump_t, grid, seminorm: bool) -> dict:
    opts = jump_options(method, jump_t, grid)
    if seminorm and method in ADAPTIVE_METHODS:
        opts["norm"] = "seminorm"
    return opts


def negated_time_options(options: dict) -> dict:
    """``options`` for the same solve in the time ``s = −t`` (how a solve over decreasing times runs forwards, as
    torchdiffeq does it): ``step_t`` and ``jump_t`` negated, a grid constructor asked and answered in ``t``."""
    options = dict(options)
    for key in ("step_t", "jump_t"):
        if options.get(key) is not None:
            options[key] = -torch.as_tensor(options[key])
    if "grid_constructor" in options:
        grid = options["grid_constructor"]
        options["grid_constructor"] = lambda f, y0, s: -grid(f, y0, -s)
    return options
