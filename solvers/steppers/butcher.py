r"""An explicit Runge-Kutta method as data that checks itself: its Butcher tableau (Butcher 2016, "Numerical
methods for ordinary differential equations", §23), error and midpoint weights, and continuous extension, each
held to its order conditions on construction (:mod:`solvers.steppers.order_conditions`). The methods themselves are in
:mod:`solvers.steppers.tableaux`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .order_conditions import order_defects

__all__ = ["MethodTableau", "Tableau", "dense_at", "hermite_mid", "quartic"]

# float64 coefficients satisfy their order conditions to rounding; a wrong digit breaks one by far more
_ORDER_TOL = 1e-12


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


@dataclass(frozen=True)
class MethodTableau:
    """A torchdiffeq method: its tableau, and for adaptive methods the error and midpoint weights.

    ``fsal``: the last stage is ``F(t_1, y_1)`` (its row of ``a`` equals ``b``): the next step's first stage.
    ``continuous``: a method continuous mode serves (a torchdiffeq method); else a discrete-mode scheme only.
    ``dense``: a method's own continuous extension ``y(t_0 + θh) = y_0 + h Σ_i b_i(θ) k_i`` as the coefficients
    ``dense[p][i]`` of ``θ^(p+1)`` in ``b_i(θ)`` (order ``dense_order``); without it the dense output is the quartic
    through the midpoint ``mid``. ``dense_stages``: stages the extension needs beyond the step's own, each
    ``(c, a)`` with ``a`` over every stage before it (evaluated only for a step an output is read from); ``dense``
    then weighs those too.

    Construction checks the order conditions (:mod:`solvers.steppers.order_conditions`): ``b`` to ``order``, the
    embedded weights ``b − error`` to ``order − 1``, and ``dense`` to ``dense_order`` at ``θ = 1/4, 1/2, 3/4`` (and
    ``b_i(1) = b_i``).
    """

    name: str
    order: int
    tableau: Tableau
    error: tuple[float, ...] | None = None
    mid: tuple[float, ...] | None = None
    continuous: bool = True
    dense: tuple[tuple[float, ...], ...] | None = None
    dense_order: int = 0
    dense_stages: tuple[tuple[float, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        s = len(self.tableau.b)
        for name, w in (("error", self.error), ("mid", self.mid)):
            if w is not None and len(w) != s:
                raise ValueError(f"tableau {self.name}: `{name}` has {len(w)} weights for {s} stages")
        if self.error is not None and abs(sum(self.error)) > 1e-14:
            raise ValueError(f"tableau {self.name}: error weights must sum to 0")
        if self.mid is not None and abs(sum(self.mid) - 0.5) > 1e-14:
            raise ValueError(f"tableau {self.name}: midpoint weights must sum to 1/2")
        for j, (c, row) in enumerate(self.dense_stages):
            if len(row) != s + j or abs(sum(row) - c) > 1e-13:
                raise ValueError(f"tableau {self.name}: dense stage {j} needs {s + j} weights summing to c = {c}")
        b = self.tableau.b
        self._check_order("b", b, self.order)
        if self.error is not None:
            self._check_order("the embedded b - error", [bi - ei for bi, ei in zip(b, self.error)], self.order - 1)
        if self.dense is not None:
            n = len(self.all_c)
            if any(len(row) != n for row in self.dense):
                raise ValueError(f"tableau {self.name}: every row of `dense` (θ^1, θ^2, …) needs {n} weights")
            padded = (*b, *[0.0] * (n - s))
            if max(abs(x - y) for x, y in zip(dense_at(self, 1.0), padded)) > _ORDER_TOL:
                raise ValueError(f"tableau {self.name}: the dense output at θ = 1 must be the step, b_i(1) = b_i")
            for theta in (0.25, 0.5, 0.75):
                self._check_order(f"dense at θ = {theta}", dense_at(self, theta), self.dense_order, theta)

    def _check_order(self, what: str, weights, order: int, theta: float = 1.0) -> None:
        worst = max(order_defects(self.all_a, weights, order, theta), key=lambda d: abs(d[0]))
        if abs(worst[0]) > _ORDER_TOL:
            raise ValueError(
                f"tableau {self.name}: {what} misses an order-{order} condition by {worst[0]:.3g} (tree {worst[1]})"
            )

    @property
    def adaptive(self) -> bool:
        return self.error is not None

    @property
    def stages(self) -> int:
        return len(self.tableau.b)

    @property
    def all_a(self) -> tuple[tuple[float, ...], ...]:
        """The rows of ``a``, the dense output's own stages after the step's."""
        return (*self.tableau.a, *(row for _, row in self.dense_stages))

    @property
    def all_c(self) -> tuple[float, ...]:
        """The nodes ``c``, the dense output's own stages after the step's."""
        return (*self.tableau.c, *(c for c, _ in self.dense_stages))

    @property
    def fsal(self) -> bool:
        t = self.tableau
        return t.c[-1] == 1.0 and t.b[-1] == 0.0 and tuple(t.a[-1]) == tuple(t.b[:-1])


def dense_at(tab: MethodTableau, theta: float) -> tuple[float, ...]:
    """The weights ``b_i(θ)`` of a method's own continuous extension (``tab.dense``) at ``θ``, over its stages and
    then its dense stages."""
    assert tab.dense is not None
    return tuple(sum(p * theta ** (q + 1) for q, p in enumerate(column)) for column in zip(*tab.dense))


def hermite_mid(b: tuple[float, ...]) -> tuple[float, ...]:
    """Midpoint weights of the cubic Hermite interpolant through ``y_0, y_1`` with slopes ``k_1, k_s``:
    ``p(1/2) = y_0 + h (Σ_i b_i k_i / 2 + (k_1 − k_s) / 8)``. The quartic dense output through this midpoint is
    that cubic; its error within a step is ``O(h^4)`` plus the step's own, so it keeps the order of a method of
    order ≤ 3 whose ``k_s`` is ``F(t_1, ·)`` at a state within ``O(h^2)`` of ``y_1``."""
    m = [bi / 2 for bi in b]
    m[0] += 1 / 8
    m[-1] -= 1 / 8
    return tuple(m)


def quartic(y0: Any, y1: Any, ymid: Any, d: Any, end: Any, x: Any) -> Any:
    """torchdiffeq's dense output between two steps: the quartic ``p(x)``, ``x ∈ [0, 1]``, with ``p(0) = y_0``,
    ``p(1/2) = y_{1/2}``, ``p(1) = y_1`` and end slopes ``p'(0) = d = h k_1``, ``p'(1) = end = h k_s``, as the
    nested products torchdiffeq evaluates (so the replays give its bits)."""
    r1 = y1 - y0 - d
    r2 = end - d
    r3 = ymid - y0 - 0.5 * d
    a4 = 2 * r2 - 8 * r1 + 16 * r3
    b3 = r2 - 2 * r1 - 2 * a4
    c2 = r1 - b3 - a4
    return y0 + x * (d + x * (c2 + x * (b3 + x * a4)))
