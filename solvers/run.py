"""What the engine is handed: one solve (:class:`Run`), whichever door built it.

``ODEBlock`` builds it from a block's field and :class:`~solvers.options.SolverOptions`; ``cde_nets.odeint`` from
torchdiffeq's arguments, normalised to one flat state integrated forwards (:mod:`solvers.dropin`). Both hand it to
:func:`solvers.engine.solve`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .gradients.piecewise_adjoint import PiecewiseParam

__all__ = ["Backward", "Run", "Settings"]


class Settings(Protocol):
    """How to integrate, as the steppers read it (:class:`~solvers.options.SolverOptions` is one)."""

    @property
    def method(self) -> str: ...
    @property
    def rtol(self) -> Any: ...
    @property
    def atol(self) -> Any: ...
    @property
    def step_size(self) -> float | None: ...
    @property
    def max_steps(self) -> int: ...
    @property
    def options(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Backward:
    """The continuous adjoint's backward solve as torchdiffeq's ``odeint_adjoint`` sets it per call
    (``adjoint_rtol``, ``adjoint_atol``, ``adjoint_method``, ``adjoint_options``): tolerances may be tensors."""

    rtol: Any
    atol: Any
    method: str
    options: Mapping[str, Any]


@dataclass
class Run:
    """One solve of ``y' = func(t, y)`` from ``y0`` at the times ``t`` (float64 or the state's dtype, increasing
    unless a gradient method turns it round).

    ``solver`` says how (method, tolerances, step budget); ``options`` are the torchdiffeq options of the forward
    solve (the solver's own plus the jump times or grid); ``params`` the tensors to differentiate (parameters and
    any tensor the field closes over); ``pieces`` those of them that are constant on pieces of time; ``jump_t``
    (adaptive) and ``grid`` (fixed steps) where the field's parameters jump. ``interpolated``: torchdiffeq's
    fixed-grid semantics (outputs between grid points read off the step by interpolation, not stepped to);
    ``backward``: the adjoint's backward solve set per call (else the gradient method's own settings).
    """

    func: Any
    y0: torch.Tensor
    t: torch.Tensor
    solver: Settings
    options: dict
    params: tuple[torch.Tensor, ...]
    pieces: tuple[PiecewiseParam, ...] = ()
    jump_t: torch.Tensor | None = None
    grid: torch.Tensor | None = None
    interpolated: bool = False
    backward: Backward | None = None

    @property
    def stats(self) -> Any:
        return self.func.stats

    @property
    def method(self) -> str:
        return self.solver.method
