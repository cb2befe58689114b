"""What solvers and schemes call: a field with the call's input fixed, and any ``forward(t, y)`` module as a field.

Blocks never store a call's input on the field. Each call builds a :class:`BoundField` — a plain object, not a
module — that holds the field and that call's ``u`` and answers ``bound(t, y)`` (torchdiffeq's convention) and
``bound.evaluate(l, y, t)`` (a scheme step on piece ``l``). Gradients reach ``u`` because it is an ordinary
tensor in the graph of every evaluation.

:class:`ModuleField` lets a user's own ``nn.Module`` with ``forward(t, y)`` run in discrete mode: its time grid
has ``steps`` pieces of length ``T / steps``, and a scheme stage at time ``t`` calls ``module(t, y)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cde_nets.solvers.errors import check_positive_int
from cde_nets.solvers.per_sample.solve import wants_rows
from cde_nets.solvers.validation import check_field_output, check_floating

from .base import Field

__all__ = ["BoundField", "ModuleField", "as_field", "check_output"]


class ModuleField(Field):
    """A plain module ``F(t, y)`` seen as a field on ``steps`` pieces of ``[0, T]`` (discrete mode's grid).

    The module keeps its own parameters (they are not piecewise); a scheme stage at time ``t`` evaluates
    ``module(t, y)``, so time-dependent modules see the stage's time, e.g. ``t_l + h/2`` for a midpoint stage.
    """

    kind = "generic"

    def __init__(self, module: nn.Module, T: float, steps: int):
        super().__init__(T=T, layers=steps)
        self.module = module

    def forward(self, t: torch.Tensor | float, y: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        if u is not None:
            raise TypeError(f"{type(self.module).__name__} takes no input `u`; drop `u`.")
        return self.module(t, y)

    def evaluate(self, l: int, y: torch.Tensor, *u: torch.Tensor) -> torch.Tensor:
        return self.module(torch.tensor(l * self.grid.h, dtype=y.dtype, device=y.device), y)

    def evaluate_at(self, t: float, y: torch.Tensor) -> torch.Tensor:
        return self.module(torch.tensor(t, dtype=y.dtype, device=y.device), y)

    def check_state(self, y: torch.Tensor, name: str = "y0") -> None:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(y).__name__}.")
        check_floating(name, y)
        if y.dim() < 1:
            raise ValueError(f"`{name}` must be a tensor of shape (batch, ...), got shape {tuple(y.shape)}.")


def as_field(module: nn.Module, T: float | None, steps: int | None) -> Field:
    """``module`` itself when it is a :class:`Field`; otherwise a :class:`ModuleField` on ``steps`` pieces of
    ``[0, T]`` (both required then: a plain module carries no time grid)."""
    if isinstance(module, Field):
        if steps is not None:
            raise ValueError(
                f"`steps` sets the grid of a plain module; {type(module).__name__} has its own grid of "
                f"{module.grid.L} pieces (one step each). Drop `steps`, or build the field with layers={steps}."
            )
        return module
    if not isinstance(module, nn.Module) or not callable(getattr(module, "forward", None)):
        raise TypeError(f"`field` must be an nn.Module with forward(t, y), got {type(module).__name__}.")
    if steps is None or T is None:
        raise ValueError(
            f"{type(module).__name__} is a plain module with no time grid: pass `T=` (end time) and `steps=` "
            "(the number of steps, i.e. layers, of size T / steps)."
        )
    check_positive_int("steps", steps, "the number of layers")
    return ModuleField(module, T, steps)


def check_output(field: nn.Module, y: torch.Tensor, out: Any) -> None:
    """Refuse a field whose output ``F(t, y)`` is not a tensor of ``y``'s shape, naming the field and both shapes.

    ``y' = F(t, y)`` needs ``F(t, y)`` in the state's space; a wrong shape would otherwise fail deep inside a
    solver's step arithmetic (or, worse, broadcast into a silently wrong answer). Called on a solve's first
    evaluation only.
    """
    name = type(field.module if isinstance(field, ModuleField) else field).__name__
    fix = ": check the field's last layer (e.g. its output features)"
    check_field_output(out, y, f"the field {name}", fix=fix)


class BoundField:
    """``field`` with one call's input ``u`` fixed (``None`` for fields without input).

    Attribute reads fall through to the field (``grid``, ``split``, ``separable``, ``state_shape``, ...).
    A plain ``__dict__`` object, not ``__slots__``: torch.compile (2.13) guards on the ``__dict__`` of objects
    alive across a graph break and fails on slotted ones.
    """

    field: Any  # a Field or a plain module: its evaluate* methods are duck-typed

    def __init__(self, field: nn.Module, u: torch.Tensor | None = None, ids: torch.Tensor | None = None):
        self.field = field
        self.u = u
        self.ids = ids  # the batch rows this call's states are (None: all of them, in order)
        self.with_rows = _wants_rows(field)  # forward(t, y, rows): the field reads per-sample data for its rows
        self.stage_times = isinstance(field, ModuleField)  # a plain module reads each stage's own time
        self.checked = False  # the first evaluation's output shape is checked, later ones are not

    def __call__(self, t: torch.Tensor | float, y: torch.Tensor) -> torch.Tensor:
        if self.with_rows:
            rows = self.ids if self.ids is not None else torch.arange(y.shape[0], device=y.device)
            out = self.field(t, y, rows=rows) if self.u is None else self.field(t, y, self.u, rows=rows)
        else:
            out = self.field(t, y) if self.u is None else self.field(t, y, self.u)
        if not self.checked:
            check_output(self.field, y, out)
            self.checked = True
        return out

    def evaluate(self, l: int, y: torch.Tensor, t: float | None = None) -> torch.Tensor:
        """``F`` on piece ``l``; ``t`` is the stage's time, used only by fields that are not piecewise."""
        f = self.field
        if t is not None and self.stage_times:
            out = f.evaluate_at(t, y)
        else:
            out = f.evaluate(l, y) if self.u is None else f.evaluate(l, y, self.u)
        if not self.checked:
            check_output(f, y, out)
            self.checked = True
        return out

    def evaluate_part(self, l: int, y: torch.Tensor, part: int) -> torch.Tensor:
        f = self.field
        return f.evaluate_part(l, y, part) if self.u is None else f.evaluate_part(l, y, part, self.u)

    def evaluate_half(self, l: int, z: torch.Tensor, part: int) -> torch.Tensor:
        f = self.field
        return f.evaluate_half(l, z, part) if self.u is None else f.evaluate_half(l, z, part, self.u)

    def rows(self, idx: torch.Tensor) -> BoundField:
        """The same field on batch rows ``idx`` (a compacted batch): the input restricted to those rows, and a
        field that reads per-sample data handed their batch indices."""
        ids = idx if self.ids is None else self.ids[idx]
        return BoundField(self.field, None if self.u is None else self.u[idx], ids)

    def __getattr__(self, name: str) -> Any:
        if name in ("field", "u", "ids", "with_rows", "stage_times", "checked"):  # not yet set (copying)
            raise AttributeError(name)
        return getattr(self.field, name)


def _wants_rows(field: nn.Module) -> bool:
    """Whether a plain module's ``forward`` takes ``rows``: cde_nets' own fields take their per-sample data as the
    block input ``u`` instead."""
    return not isinstance(field, Field) and wants_rows(field)
