"""The scheme base class and the Butcher tableau (see :mod:`solvers.schemes`)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..architectures import architecture

def axpy(y: torch.Tensor, h: float, F: torch.Tensor) -> torch.Tensor:
    """``y + h F``. Eagerly as one ``torch.add(y, F, alpha=h)`` kernel (one rounding; the form the recorded
    results were computed with); under ``torch.compile`` written out, because torch 2.13's inductor mis-lowers
    add-with-alpha after a matmul (answers off by 6 on an H1 net). The two agree to float rounding."""
    if torch.compiler.is_compiling():
        return y + h * F
    return torch.add(y, F, alpha=h)


__all__ = ["Tableau", "Scheme", "State", "axpy", "dense_matrix"]


State = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Tableau:
    """An explicit Butcher tableau; checks itself (rows of ``a`` sum to ``c``, weights ``b`` sum to 1)."""

    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    c: tuple[float, ...]

    def __post_init__(self) -> None:
        s = len(self.b)
        if len(self.a) != s or len(self.c) != s:
            raise ValueError("tableau: a, b, c must describe the same number of stages")
        for i, (row, ci) in enumerate(zip(self.a, self.c)):
            if len(row) != i:
                raise ValueError(f"tableau: explicit row {i} must have {i} entries")
            if abs(sum(row) - ci) > 1e-14:
                raise ValueError(f"tableau: row {i} of a sums to {sum(row)}, not c = {ci}")
        if abs(sum(self.b) - 1.0) > 1e-14:
            raise ValueError("tableau: weights b must sum to 1")


def dense_matrix(k: int) -> torch.Tensor:
    """``M[n, i] = (−1)^i C(n, i)`` (0-based, ``i <= n``): backward differences ↔ lags, its own inverse (Hauser,
    eq. S21)."""
    M = torch.zeros(k, k, dtype=torch.float64)
    for n in range(k):
        for i in range(n + 1):
            M[n, i] = (-1) ** i * math.comb(n, i)
    return M


class Scheme:
    """Base class: declarations and the defaults of a one-stage scheme on the field's own state."""

    name: str = ""
    order: int = 1
    state: str = "plain"
    equation: str = "—"
    description: str = ""
    coefficients: tuple[str, ...] = ()  # learnable per-layer tensors the net creates (coefficient_init)
    lags: int = 1
    variant: str = ""  # row variant of the architecture map on the resolved field ("" = as declared)
    properties: frozenset[str] = frozenset()

    def options(self) -> dict[str, Any]:
        """The options this instance was built with (shown by ``repr``)."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"

    # -- the field ----------------------------------------------------------------------------------------
    def for_field(self, field: Any, split: tuple[int, int] | None = None) -> Scheme:
        """The scheme as it runs on ``field`` (a copy; ``order``, ``properties`` and ``variant`` are the ones that
        hold there). Raises ``ValueError`` naming the fix when it cannot run on ``field``."""
        if split is not None:
            raise ValueError(
                f"`split` applies to the split schemes (symplectic_euler, symplectic_euler_qp, "
                f"verlet), not {self.name!r}; drop `split`."
            )
        return copy.copy(self)

    def architecture(self, field: Any = None) -> tuple[str, str]:
        """``(name, paper equation)`` of the network this scheme makes on ``field`` (a field, or a kind string for
        the row as declared)."""
        if field is None or isinstance(field, str):
            return architecture(self.name, field or "any", self.variant)
        return architecture(self.name, getattr(field, "kind", "generic"), self._resolve_quiet(field).variant)

    def _resolve_quiet(self, field: Any) -> Scheme:
        try:
            return self.for_field(field)
        except ValueError:
            return self

    # -- learnable coefficients -----------------------------------------------------------------------------
    def coefficient_init(self, L: int, channels: int) -> dict[str, torch.Tensor]:
        """Initial values of the scheme's learnable tensors for ``L`` layers (names: :attr:`coefficients`)."""
        return {}

    def coefficient_values(self, params: dict[str, torch.Tensor], h: float, ndim: int) -> dict[str, torch.Tensor]:
        """Per-layer coefficients ``(L, ...)`` from the learnable tensors, shaped to broadcast over a state of
        ``ndim`` dimensions."""
        return {}

    # -- running --------------------------------------------------------------------------------------------
    def evaluations(self, l: int) -> int:
        """Field evaluations of layer ``l``."""
        return 1

    def init(self, y0: torch.Tensor) -> State:
        """The scheme state for the input ``y0``."""
        return (y0,)

    def step(self, f: Any, l: int, state: State, h: float, coef: dict | None = None, t: float | None = None) -> State:
        """Advance ``state`` by one layer with piece ``l`` of ``f`` and step ``h``; ``t``: the layer's start time
        (default ``l h``; per-sample stopping past the last piece passes its own). ``coef``: per-layer views of
        :meth:`coefficient_values` (``coef[name][l]``)."""
        raise NotImplementedError

    def readout(self, state: State) -> torch.Tensor:
        """The field-shaped state of a scheme state."""
        return state[0]
