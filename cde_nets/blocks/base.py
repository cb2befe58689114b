"""The base of every block — continuous (:class:`~cde_nets.ODEBlock`), stochastic (:class:`~cde_nets.SDEBlock`)
and discrete (:class:`~cde_nets.DiscreteNet`): one way to call, one result type, one validation.

``block(y0, u=None)`` returns the final state, a tensor, whatever the options; ``block.solve(y0, u=None, t=None)``
returns a :class:`~cde_nets.blocks.solution.Solution` with everything else (saved states, statistics, per-sample
stopping, integrated regularisers). The block input ``u`` of a non-autonomous field travels with the call, and
everything a call produces travels with its result: a block keeps nothing between calls (every solve also reports
its solution into the open :func:`~cde_nets.integrated_terms` collections).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from cde_nets.blocks.solution import Solution
from cde_nets.fields.base import Field
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.errors import check_positive
from cde_nets.solvers.times import check_times
from cde_nets.solvers.validation import check_floating

__all__ = ["Block"]


class Block(nn.Module):
    """Shared by every block. Subclasses implement :meth:`solve`."""

    field: nn.Module
    T: float

    def __init__(self, field: nn.Module, T: float | None):
        super().__init__()
        if not isinstance(field, nn.Module) or not callable(getattr(field, "forward", None)):
            raise TypeError(f"`field` must be an nn.Module with forward(t, y), got {type(field).__name__}.")
        _check_signature(field)
        self.field = field
        grid = getattr(field, "grid", None)
        if T is None:
            if grid is None:
                raise ValueError(
                    f"{type(field).__name__} has no time grid: pass `T=` (the end time of the integration)."
                )
            T = grid.T
        self.T = check_positive("T", T, "T is the end time of the integration over [0, T].")
        if grid is not None and grid.L > 1 and abs(self.T - grid.T) > 1e-12 * grid.T:
            raise ValueError(
                f"`T`={self.T} differs from the field's T={grid.T}, over which its {grid.L} parameter pieces "
                "are laid out; leave `T` unset or build the field with this T."
            )

    # -- the one way to call ---------------------------------------------------------------------------
    def forward(self, y0: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        """The final state for ``y(0) = y0`` (``(batch, *state_shape)``); ``u``: the block input of a field with
        ``needs_input`` (``(batch, *input_shape)``)."""
        return self.solve(y0, u).y

    def solve(
        self, y0: torch.Tensor, u: torch.Tensor | None = None, t: Sequence[float] | torch.Tensor | None = None
    ) -> Solution:
        """Solve from ``y0`` and return a :class:`~cde_nets.blocks.solution.Solution`; ``t``: times at which to save the
        state (increasing, within ``[0, T]``)."""
        raise NotImplementedError

    # -- shared validation -----------------------------------------------------------------------------
    def bind(self, y0: torch.Tensor, u: torch.Tensor | None) -> BoundField:
        """Check ``y0`` and ``u`` against the field and return the field bound to this call's input."""
        field = self.field
        if isinstance(field, Field):
            field.check_state(y0, "y0")
            field.check_input(u, y0.shape[0] if isinstance(y0, torch.Tensor) and y0.dim() else 0, "u")
        else:
            _check_tensor_state(y0)
            if u is not None:
                raise TypeError(
                    f"`u` was given but {type(field).__name__} is a plain module called as F(t, y); "
                    "drop `u`, or write the field as a cde_nets Field with needs_input."
                )
        self._check_dtype(y0)
        return BoundField(field, u)

    def _check_dtype(self, y0: torch.Tensor) -> None:
        for p in self.field.parameters():
            if p.is_floating_point() and p.dtype != y0.dtype:
                raise TypeError(
                    f"`y0` is {y0.dtype} but the field's parameters are {p.dtype}; convert one of them "
                    f"(e.g. `block.to({y0.dtype})` or `y0.to({p.dtype})`)."
                )
            return

    @staticmethod
    def check_times(t: Sequence[float] | torch.Tensor, T: float, device: torch.device | None = None) -> torch.Tensor:
        """``t`` as a float64 tensor: 1-D, strictly increasing, at least two times, within ``[0, T]``
        (:func:`~cde_nets.solvers.times.check_times`)."""
        return check_times(t, T, device)


def _check_tensor_state(y0: object) -> None:
    if not isinstance(y0, torch.Tensor):
        raise TypeError(f"`y0` must be a torch.Tensor, got {type(y0).__name__}.")
    check_floating("y0", y0)
    if y0.dim() < 1:
        raise ValueError(f"`y0` must be a tensor of shape (batch, ...), got shape {tuple(y0.shape)}.")


def _check_signature(field: nn.Module) -> None:
    """A field is called as ``F(t, y)``: refuse, by name, a module whose ``forward`` cannot take two arguments."""
    try:
        sig = inspect.signature(field.forward)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        sig.bind(0.0, None, **({"rows": None} if "rows" in sig.parameters else {}))
    except TypeError:
        raise TypeError(
            f"`field` is called as F(t, y), but {type(field).__name__}.forward{sig} does not take (t, y); wrap it, "
            f"e.g. `class F(nn.Module): def forward(self, t, y): return module(y)`."
        ) from None
