"""Time-varying parameters: ``L`` constant pieces over ``[0, T]``.

Conventions: piece ``l`` holds for ``t`` in ``[l h, (l + 1) h)`` with ``h = T / L``; the last piece also
holds at ``t = T``. One trained tensor serves both modes: continuous mode looks the piece up from ``t``
(:meth:`TimeGrid.index`), discrete mode runs one scheme step per piece and indexes it by ``l`` directly, so no
rounding of ``l * h`` can ever pick a neighbouring piece.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from typing import cast

import torch
from torch import nn

from cde_nets.solvers.errors import check_positive_int
from cde_nets.solvers.times import HOST_TIME

__all__ = ["TimeGrid", "Pieces", "smoothness", "piece_modules"]


class TimeGrid:
    """The partition ``0 = t_0 < t_1 < ... < t_L = T`` with ``t_l = l T / L``.

    ``index(t)`` is exact with respect to the float64 boundaries handed to torchdiffeq as ``jump_t``: the
    solver evaluates just before a jump (``nextafter(t_l, -inf)``) with piece ``l - 1`` and just after it with
    piece ``l``, so an adaptive step never straddles a discontinuity.
    """

    def __init__(self, T: float, layers: int):
        check_positive_int("layers", layers, "number of parameter pieces")
        T = float(T)
        if not math.isfinite(T) or T <= 0:
            raise ValueError(f"`T` must be a finite positive end time, got {T!r}.")
        self.T = T
        self.L = layers
        self.h = T / layers
        # Same formula as torchdiffeq's fixed-grid constructor (arange * step), so grid points coincide bitwise.
        self._bounds = (torch.arange(layers + 1, dtype=torch.float64) * self.h).tolist()
        self._bounds[-1] = T

    @property
    def boundaries(self) -> torch.Tensor:
        """All ``L + 1`` boundaries, float64."""
        return torch.tensor(self._bounds, dtype=torch.float64)

    @property
    def jumps(self) -> torch.Tensor:
        """Interior boundaries ``t_1 .. t_{L-1}`` (empty when time-invariant), float64: torchdiffeq's ``jump_t``."""
        return torch.tensor(self._bounds[1:-1], dtype=torch.float64)

    def index(self, t: float | torch.Tensor) -> int:
        """Piece holding at time ``t`` (clamped to ``[0, L - 1]`` outside ``[0, T]``)."""
        if self.L == 1:
            return 0
        if isinstance(t, torch.Tensor):  # a solver's time tensor carries its value: no read from the device
            tf = getattr(t, HOST_TIME, None)
            tf = float(t.detach()) if tf is None else tf
        else:
            tf = float(t)
        i = bisect.bisect_right(self._bounds, tf) - 1
        return min(max(i, 0), self.L - 1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TimeGrid) and self.L == other.L and self.T == other.T

    def __hash__(self) -> int:
        return hash((self.T, self.L))

    def __repr__(self) -> str:
        return f"TimeGrid(T={self.T}, layers={self.L})"


class Pieces(nn.Module):
    """A parameter that is constant on each of ``L`` pieces: a tensor of shape ``(L, *shape)``.

    ``pieces[l]`` is piece ``l``; ``pieces.at(t)`` is the piece in force at time ``t``. ``trainable=False`` keeps
    it as a buffer (moved with the module, excluded from optimisers and from ``adjoint_params``).
    Inside :func:`~cde_nets.blocks.gathering.gathered`, ``pieces[l]`` returns a view from one ``unbind`` per call
    (see there).
    """

    _unbound: tuple[torch.Tensor, ...] | None = None  # inside gathered: () until the first piece is read

    def __init__(
        self,
        grid: TimeGrid,
        shape: tuple[int, ...],
        init: torch.Tensor | Callable[[torch.Tensor], object] | float | None = None,
        trainable: bool = True,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.grid = grid
        self.shape = tuple(shape)
        if dtype is None:
            dtype = init.dtype if isinstance(init, torch.Tensor) and init.is_floating_point() else None
        data = torch.empty(grid.L, *self.shape, dtype=dtype or torch.get_default_dtype())
        if init is None:
            nn.init.zeros_(data)
        elif isinstance(init, (int, float)):
            data.fill_(float(init))
        elif isinstance(init, torch.Tensor):
            init = init.to(data.dtype)
            if tuple(init.shape) == self.shape:
                data.copy_(init.expand_as(data))
            elif tuple(init.shape) == tuple(data.shape):
                data.copy_(init)
            else:
                raise ValueError(
                    f"`init` has shape {tuple(init.shape)}; expected one piece {self.shape} "
                    f"or all pieces {tuple(data.shape)}."
                )
        else:
            with torch.no_grad():
                for piece in data:
                    init(piece)
        if trainable:
            self.data = nn.Parameter(data)
        else:
            self.register_buffer("data", data)

    @property
    def L(self) -> int:
        return self.grid.L

    def __getitem__(self, l: int) -> torch.Tensor:
        return self.data[l] if self._unbound is None else self.views()[l]

    def views(self) -> tuple[torch.Tensor, ...]:
        """Inside :func:`~cde_nets.blocks.gathering.gathered`: the pieces as views of one ``data.unbind(0)``, made when
        first asked for (a field that reads its :meth:`~cde_nets.fields.base.Field.constants` never needs them)."""
        if not self._unbound:
            # with a graph even when the first read is under no_grad (an event check): every later read of the
            # call differentiates through these views
            with torch.enable_grad():
                object.__setattr__(self, "_unbound", self.data.unbind(0))
        return cast(tuple[torch.Tensor, ...], self._unbound)

    def at(self, t: float | torch.Tensor) -> torch.Tensor:
        return self[self.grid.index(t)]

    def differences(self) -> torch.Tensor:
        """``data[l] - data[l - 1]`` for ``l = 1 .. L - 1`` (empty when ``L == 1``)."""
        return self.data[1:] - self.data[:-1]

    def extra_repr(self) -> str:
        return f"L={self.L}, shape={self.shape}, trainable={isinstance(self.data, nn.Parameter)}"


def piece_modules(module: nn.Module) -> Iterator[Pieces]:
    """Every trainable :class:`Pieces` inside ``module``."""
    for m in module.modules():
        if isinstance(m, Pieces) and isinstance(m.data, nn.Parameter):
            yield m


def set_views(p: Pieces, views: tuple[torch.Tensor, ...] | None) -> None:
    """Make ``p`` hand out ``views[l]`` for piece ``l`` (``()``: one ``unbind`` at the first read), or, with
    ``None``, its own ``data[l]`` again (the class default, so nothing of the call stays on the module)."""
    if views is None:
        vars(p).pop("_unbound", None)
    else:
        object.__setattr__(p, "_unbound", views)


def smoothness(module: nn.Module, scale: float | None = None) -> torch.Tensor:
    """Smoothness penalty over depth: ``scale * Σ_l Σ_pieces ‖θ_l − θ_{l−1}‖²``.

    With ``scale = 1 / (2h)`` this is eq. R82 (Ruseckas); with ``scale = h / 2`` it is R_K of Galimberti et al.
    ``scale=None`` uses ``1 / (2h)`` of the first piece grid found.
    """
    total = None
    for p in piece_modules(module):
        if p.L < 2:
            continue
        s = 1.0 / (2.0 * p.grid.h) if scale is None else scale
        term = s * p.differences().pow(2).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return total
