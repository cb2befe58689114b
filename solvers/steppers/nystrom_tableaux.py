r"""Runge-Kutta-Nyström methods for second-order fields ``q'' = f(q)`` or ``f(q, q')``, as checked tables.

One step from ``(q_0, v_0)`` (Hairer, Nørsett & Wanner 1993, "Solving ordinary differential equations I", §II.14):

    ``Q_i = q_0 + c_i h v_0 + h² Σ_j a_ij k_j``,   ``V_i = v_0 + h Σ_j av_ij k_j``,   ``k_i = f(Q_i, V_i)``,
    ``q_1 = q_0 + h v_0 + h² Σ_i b_i k_i``,   ``v_1 = v_0 + h Σ_i bp_i k_i``

(``V_i`` only for a method that allows ``f`` to depend on ``q'``: ``av`` given). A method integrates the second-order
field directly instead of its first-order form ``(q, v)' = (v, f)``: the stages never evaluate the trivial half
``q' = v``. An adaptive method carries embedded weights ``(b̂, b̂p)`` of a lower order (the error estimate is the
difference of the two solutions) and may carry a dense output: weights ``b_i(θ)``, ``bp_i(θ)`` polynomial in ``θ``
with ``q(t_0 + θh) = q_0 + θ h v_0 + (θh)² Σ b_i(θ) k_i``, ``v(t_0 + θh) = v_0 + θ h Σ bp_i(θ) k_i``.

A :class:`NystromTableau` checks on construction, to 1e-12, the Nyström-tree order conditions
(:func:`~solvers.steppers.order_conditions.nystrom_defects`) of its solution, of its embedded solution and of its dense
output at ``θ = 1/4, 1/2, 3/4`` (and that the dense output at ``θ = 1`` is the step).

- ``nystrom4``: Nyström's fourth-order method for ``q'' = f(t, q, q')`` (four evaluations; Abramowitz & Stegun 1964,
  eq. 25.5.20; Hairer, Nørsett & Wanner 1993, §II.14).
- ``dprkn6``: Dormand & Prince's 6(4) pair with a free sixth-order dense output, ``q'' = f(q)`` only
  (Dormand & Prince 1987, "Runge-Kutta-Nyström triples", Comput. Math. Appl. 13, 937-949): six evaluations per
  step, the last one at the new point (first same as last). Its dense output is sixth order in ``q`` and fifth in
  ``q'``.
- ``dprkn8``: the 8(6) pair of Dormand, El-Mikkawy & Prince (1987, "High-order embedded Runge-Kutta-Nyström
  formulae", IMA J. Numer. Anal. 7, 423-430), ``q'' = f(q)``: eight evaluations per step (first same as last), no
  dense output (an adaptive solve ends steps on the requested times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .order_conditions import nystrom_defects

__all__ = ["NYSTROM_TABLEAUX", "NystromTableau", "dense_weights"]

_ORDER_TOL = 1e-12

Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class NystromTableau:
    """A Runge-Kutta-Nyström method (module docstring): ``a``, ``av`` strictly lower triangular (explicit).

    ``embedded``: ``(b̂, b̂p)`` of order ``embedded_order`` (adaptive methods). ``dense_q``, ``dense_v``: per stage,
    the coefficients of ``θ^0 … θ^m`` in ``b_i(θ)``, ``bp_i(θ)``; ``dense_order`` is the order of ``q(t_0 + θh)``
    (that of ``q'`` is one less). ``fsal``: the last stage is ``f(q_1)`` (``c = 1``, its row of ``a`` is ``b``, and
    ``f`` does not read ``q'``), the next step's first."""

    name: str
    order: int
    c: tuple[float, ...]
    a: Matrix
    b: tuple[float, ...]
    bp: tuple[float, ...]
    source: str
    av: Matrix | None = None
    embedded: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    embedded_order: int = 0
    dense_q: Matrix | None = None
    dense_v: Matrix | None = None
    dense_order: int = 0

    def __post_init__(self) -> None:
        s = len(self.c)
        rows = [("a", self.a)] + ([("av", self.av)] if self.av is not None else [])
        for label, m in rows:
            if len(m) != s or any(len(r) != s or any(r[j] != 0.0 for j in range(i, s)) for i, r in enumerate(m)):
                raise ValueError(f"nystrom {self.name}: `{label}` must be {s}×{s} and strictly lower triangular")
        for label, w in (("b", self.b), ("bp", self.bp)):
            if len(w) != s:
                raise ValueError(f"nystrom {self.name}: `{label}` has {len(w)} weights for {s} stages")
        self._check("the solution", self.b, self.bp, self.order)
        if self.embedded is not None:
            self._check("the embedded solution", *self.embedded, self.embedded_order)
        if self.dense_q is not None and self.dense_v is not None:
            bq, bv = dense_weights(self, 1.0)
            if max(abs(x - y) for x, y in zip((*bq, *bv), (*self.b, *self.bp))) > _ORDER_TOL:
                raise ValueError(f"nystrom {self.name}: the dense output at θ = 1 must be the step")
            for theta in (0.25, 0.5, 0.75):
                self._check(f"the dense output at θ = {theta}", *dense_weights(self, theta), self.dense_order, theta)

    def _check(self, what: str, b, bp, order: int, theta: float = 1.0) -> None:
        defects = nystrom_defects(self.c, self.a, b, bp, order, self.av, theta)
        if theta != 1.0:  # the derivative of an order-p position is order p − 1
            defects = [d for d in defects if d[1] == "q" or d[2] < order]
        worst = max(defects, key=lambda d: abs(d[0]))
        if abs(worst[0]) > _ORDER_TOL:
            raise ValueError(
                f"nystrom {self.name}: {what} misses an order-{worst[2]} condition of {worst[1]} by "
                f"{worst[0]:.3g} (tree {worst[3]}), so it is not of order {order}"
            )

    @property
    def stages(self) -> int:
        return len(self.c)

    @property
    def velocity_dependent(self) -> bool:
        """Whether the method serves ``f(q, q')`` (it carries ``av``)."""
        return self.av is not None

    @property
    def adaptive(self) -> bool:
        return self.embedded is not None

    @property
    def fsal(self) -> bool:
        return self.av is None and self.c[-1] == 1.0 and self.a[-1] == self.b and self.b[-1] == 0.0


def dense_weights(tab: NystromTableau, theta: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(b_i(θ), bp_i(θ))``, the dense output's weights at ``θ``."""
    if tab.dense_q is None or tab.dense_v is None:
        raise ValueError(f"nystrom {tab.name} has no dense output")
    bq = tuple(sum(r * theta**k for k, r in enumerate(row)) for row in tab.dense_q)
    bv = tuple(sum(r * theta**k for k, r in enumerate(row)) for row in tab.dense_v)
    return bq, bv


def _lower(s: int, entries: dict[tuple[int, int], float]) -> Matrix:
    return tuple(tuple(entries.get((i, j), 0.0) for j in range(s)) for i in range(s))


def _nystrom4() -> NystromTableau:
    return NystromTableau(
        "nystrom4",
        4,
        c=(0.0, 0.5, 0.5, 1.0),
        a=_lower(4, {(1, 0): 1 / 8, (2, 0): 1 / 8, (3, 2): 1 / 2}),
        av=_lower(4, {(1, 0): 1 / 2, (2, 1): 1 / 2, (3, 2): 1.0}),
        b=(1 / 6, 1 / 6, 1 / 6, 0.0),
        bp=(1 / 6, 2 / 6, 2 / 6, 1 / 6),
        source="Abramowitz & Stegun 1964, eq. 25.5.20",
    )


def _dprkn6_dense(r: float) -> tuple[Matrix, Matrix]:
    """DPRKN6's dense output (Dormand & Prince 1987): the weights of ``q`` and of ``v`` as polynomials in the
    step fraction, one row per stage, ``r = √8581``."""
    d, e = 22529243880, 11264621940
    dense_q = (
        (2106 / 4212, -5244 / 4212, 6386 / 4212, -3819 / 4212, 900 / 4212),
        (0.0,) * 5,
        (
            0.0,
            18 * (81356461 + 25954829 * r) / d,
            (22190560391 - 1109665151 * r) / d,
            -6 * (4929647204 - 156109769 * r) / d,
            1800 * (5860823 - 152228 * r) / d,
        ),
        (
            0.0,
            18 * (81356461 - 25954829 * r) / d,
            (22190560391 + 1109665151 * r) / d,
            -6 * (4929647204 + 156109769 * r) / d,
            1800 * (5860823 + 152228 * r) / d,
        ),
        (0.0, 200 * 195 / 17901, -200 * 620 / 17901, 200 * 651 / 17901, -200 * 225 / 17901),
        (0.0, -117 / 110, 757 / 220, -823 / 220, 15 / 11),
    )
    dense_v = (
        (1.0, -15732 / 4212, 25544 / 4212, -19095 / 4212, 5400 / 4212),
        (0.0,) * 5,
        (
            0.0,
            27 * (81356461 + 25954829 * r) / e,
            2 * (22190560391 - 1109665151 * r) / e,
            -15 * (4929647204 - 156109769 * r) / e,
            5400 * (5860823 - 152228 * r) / e,
        ),
        (
            0.0,
            27 * (81356461 - 25954829 * r) / e,
            2 * (22190560391 + 1109665151 * r) / e,
            -15 * (4929647204 + 156109769 * r) / e,
            5400 * (5860823 + 152228 * r) / e,
        ),
        (0.0, 1000 * 117 / 17901, -1000 * 496 / 17901, 1000 * 651 / 17901, -1000 * 270 / 17901),
        (0.0, -702 / 220, 3028 / 220, -4115 / 220, 1800 / 220),
    )
    return dense_q, dense_v


def _dprkn6() -> NystromTableau:
    r = math.sqrt(8581.0)
    c = (0.0, (209 - r) / 900, (209 - r) / 450, (209 + r) / 450, 9 / 10, 1.0)
    b = (329 / 4212, 0.0, (84119543 + 366727 * r) / 409622616, (84119543 - 366727 * r) / 409622616, 200 / 17901, 0.0)
    a = _lower(
        6,
        {
            (1, 0): (26131 - 209 * r) / 810000,
            (2, 0): (26131 - 209 * r) / 607500,
            (2, 1): (26131 - 209 * r) / 303750,
            (3, 0): (980403512254 + 7781688431 * r) / 11694469921875,
            (3, 1): -(1262884486208 + 15385481287 * r) / 11694469921875,
            (3, 2): (7166233891441 + 78694563299 * r) / 46777879687500,
            (4, 0): -9 * (329260 + 3181 * r) / 27040000,
            (4, 1): 27 * (35129 + 3331 * r) / 13520000,
            (4, 2): -27 * (554358343 + 31040327 * r) / 464060480000,
            (4, 3): 153 * (8555257 - 67973 * r) / 2745920000,
            **{(5, j): b[j] for j in range(5)},
        },
    )
    bp = (
        329 / 4212,
        0.0,
        (389225579 + 96856 * r) / 1024056540,
        (389225579 - 96856 * r) / 1024056540,
        2000 / 17901,
        1 / 20,
    )
    b_hat = ((2701 + 23 * r) / 4563, -(9829 + 131 * r) / 9126, 5 * (1798 + 17 * r) / 9126, 0.0, 0.0, 0.0)
    bp_hat = (
        115 / 2106,
        0.0,
        (84119543 + 366727 * r) / 256014135,
        (84119543 - 366727 * r) / 256014135,
        6950 / 17901,
        -1 / 10,
    )
    dense_q, dense_v = _dprkn6_dense(r)
    return NystromTableau(
        "dprkn6",
        6,
        c=c,
        a=a,
        b=b,
        bp=bp,
        source="Dormand & Prince 1987",
        embedded=(b_hat, bp_hat),
        embedded_order=4,
        dense_q=dense_q,
        dense_v=dense_v,
        dense_order=6,
    )


def _dprkn8() -> NystromTableau:
    entries = {
        (1, 0): 1 / 800,
        (2, 0): 1 / 600,
        (2, 1): 1 / 300,
        (3, 0): 9 / 200,
        (3, 1): -9 / 100,
        (3, 2): 9 / 100,
        (4, 0): -66701 / 197352,
        (4, 1): 28325 / 32892,
        (4, 2): -2665 / 5482,
        (4, 3): 2170 / 24669,
        (5, 0): 227015747 / 304251000,
        (5, 1): -54897451 / 30425100,
        (5, 2): 12942349 / 10141700,
        (5, 3): -9499 / 304251,
        (5, 4): 539 / 9250,
        (6, 0): -1131891597 / 901789000,
        (6, 1): 41964921 / 12882700,
        (6, 2): -6663147 / 3220675,
        (6, 3): 270954 / 644135,
        (6, 4): -108 / 5875,
        (6, 5): 114 / 1645,
        (7, 0): 13836959 / 3667458,
        (7, 1): -17731450 / 1833729,
        (7, 2): 1063919505 / 156478208,
        (7, 3): -33213845 / 39119552,
        (7, 4): 13335 / 28544,
        (7, 5): -705 / 14272,
        (7, 6): 1645 / 57088,
    }
    b = (223 / 7938, 0.0, 1175 / 8064, 925 / 6048, 41 / 448, 925 / 14112, 1175 / 72576, 0.0, 0.0)
    entries.update({(8, j): b[j] for j in range(8)})
    b_hat = (
        7987313 / 109941300,
        0.0,
        1610737 / 44674560,
        10023263 / 33505920,
        -497221 / 12409600,
        10023263 / 78180480,
        1610737 / 402071040,
        0.0,
        0.0,
    )
    bp_hat = (
        7987313 / 109941300,
        0.0,
        1610737 / 40207104,
        10023263 / 23454144,
        -497221 / 6204800,
        10023263 / 23454144,
        1610737 / 40207104,
        -4251941 / 54970650,
        3 / 20,
    )
    return NystromTableau(
        "dprkn8",
        8,
        c=(0.0, 1 / 20, 1 / 10, 3 / 10, 1 / 2, 7 / 10, 9 / 10, 1.0, 1.0),
        a=_lower(9, entries),
        b=b,
        bp=(223 / 7938, 0.0, 5875 / 36288, 4625 / 21168, 41 / 224, 4625 / 21168, 5875 / 36288, 223 / 7938, 0.0),
        source="Dormand, El-Mikkawy & Prince 1987",
        embedded=(b_hat, bp_hat),
        embedded_order=6,
    )


NYSTROM_TABLEAUX: dict[str, NystromTableau] = {tab.name: tab for tab in (_nystrom4(), _dprkn6(), _dprkn8())}
