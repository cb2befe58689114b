"""Sub-solves of a block's field between consecutive times, each inside one parameter piece.

Diagnostics need the state at piece boundaries (energy jumps) and states that stay in the autograd graph so
that ``y(T)`` can be differentiated with respect to ``y(t)`` (adjoint state, sensitivity matrices). Splitting
``[0, T]`` at the requested times and at every piece boundary and solving each segment with the piece held
fixed gives both: no step straddles a jump, and ``y(t_{k+1})`` is a differentiable function of ``y(t_k)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from cde_nets.solvers.adapter import integrate
from cde_nets.solvers.gradients import Backprop
from cde_nets.solvers.grids import aligned_grid
from cde_nets.solvers.times import check_times

if TYPE_CHECKING:
    from cde_nets.blocks.ode import ODEBlock

__all__ = ["FrozenPiece", "merge_times", "piece_of", "evaluate_at", "solve_segments", "solve_piece"]


class _Piecewise(Protocol):
    def evaluate(self, l: int, y: torch.Tensor, /) -> torch.Tensor: ...


def evaluate_piece(field: nn.Module, l: int, y: torch.Tensor) -> torch.Tensor:
    """``F_l(y) = field.evaluate(l, y)`` of a field with parameter pieces: a cde_nets field or any module with such a
    method (duck-typed, so the cast: ``nn.Module`` types unknown attributes as ``Tensor | Module``)."""
    return cast(_Piecewise, field).evaluate(l, y)


class FrozenPiece(nn.Module):
    """``F(t, y) = field.evaluate(l, y)``: the field with piece ``l`` held for all ``t`` (autonomous)."""

    def __init__(self, field: nn.Module, l: int):
        super().__init__()
        self.field = field
        self.l = l

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return evaluate_piece(self.field, self.l, y)


def merge_times(field: nn.Module, t: torch.Tensor | Sequence[float], T: float) -> tuple[list[float], list[int]]:
    """Requested times ``t`` merged with the field's piece boundaries inside ``[0, t[-1]]``.

    Returns the merged increasing times and, for each requested time, its index in them. A requested time
    within ``1e-12 T`` of a boundary is replaced by the boundary (the exact float the grid uses).
    """
    t = check_times(t, T, from_zero=True).cpu().tolist()
    grid = getattr(field, "grid", None)
    bounds = grid.boundaries.tolist() if grid is not None else []
    bounds = [b for b in bounds if b <= t[-1] * (1 + 1e-12)]
    tol = 1e-12 * T
    merged = sorted(set(bounds))
    index = []
    for s in t:
        near = [b for b in merged if abs(b - s) <= tol]
        if not near:
            merged.append(s)
            merged.sort()
    for s in t:
        index.append(min(range(len(merged)), key=lambda i: abs(merged[i] - s)))
    return merged, index


def piece_of(field: nn.Module, t: float) -> int:
    """Piece in force on ``[t, t + dt)`` (0 for fields without a time grid)."""
    grid = getattr(field, "grid", None)
    return 0 if grid is None else grid.index(t)


def evaluate_at(field: nn.Module, l: int, y: torch.Tensor, t: float) -> torch.Tensor:
    """``F_l(y)`` — ``field.evaluate`` when the field has pieces, else ``field(t, y)``."""
    return evaluate_piece(field, l, y) if hasattr(field, "evaluate") else field(torch.tensor(t, dtype=torch.float64), y)


def solve_segments(block: ODEBlock, y0: torch.Tensor, times: Sequence[float], graph: bool = True) -> list[torch.Tensor]:
    """States at ``times`` (increasing, each segment inside one piece), chained so that each state is a
    differentiable function of the previous one (``graph=True``; backprop through the solver's steps).

    Uses the block's method, tolerances and (fixed-step methods) step size. Shapes: ``y0`` is
    ``(batch, *state)``; returns ``len(times)`` tensors of that shape, the first being ``y0`` itself.
    """
    field = block.field
    states = [y0]
    y = y0
    for a, b in zip(times[:-1], times[1:]):
        frozen = FrozenPiece(field, piece_of(field, a)) if hasattr(field, "evaluate") else field
        with torch.set_grad_enabled(graph and torch.is_grad_enabled()):
            y = solve_piece(block, frozen, y, a, b)
        states.append(y)
    return states


def solve_piece(block: ODEBlock, func: nn.Module, y: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """``y(b)`` of ``y' = func(t, y)``, ``y(a) = y``, with the block's method, tolerances and step size; its graph
    differentiates the steps on their mesh (the sizes held fixed), the discretisation of the ODE's own adjoint."""
    span = torch.tensor([a, b], dtype=torch.float64, device=y.device)
    grid = None if block.solver.adaptive else aligned_grid([a, b], block.step_size)
    ys, _ = integrate(func, y, span, solver=block.solver, gradient=Backprop(steps="fixed"), grid=grid)
    return ys[-1]
