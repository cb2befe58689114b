r"""The explicit symplectic splitting methods for separable fields, as checked coefficient tables.

A separable field ``p' = F_p(q)``, ``q' = F_q(p)`` (a Hamiltonian ``H = T(p) + V(q)``; the H2-DNN, MS1, MS3 fields)
is the sum of two fields whose flows are explicit shears: the kick ``p ← p + c h F_p(q)`` and the drift
``q ← q + c h F_q(p)``. A splitting method composes them; with the coefficients ``(a_i, b_i)`` of Ruth (1983) and
McLachlan & Atela (1992) one step is, for ``i = 1, …, s``,

    ``p ← p + b_i h F_p(q)``,   ``q ← q + a_i h F_q(p)``,

which is symplectic for every choice of coefficients (a composition of symplectic shears) and of order ``p`` when
the coefficients satisfy the order conditions of the bi-coloured trees up to ``p``
(:func:`~solvers.steppers.order_conditions.splitting_defects`; Hairer, Lubich & Wanner 2006, §III.2). ``s = 1``,
``a = b = (1)`` is semi-implicit Euler, the H2-DNN layer (Galimberti et al. 2023, eqs. H12-13); the methods here
generalise it.

A :class:`SplittingTableau` checks on construction that its weights sum to 1 and that its declared order conditions
hold to 1e-12 in float64. Some methods were built for ``q'' = f(q)``, a quadratic kinetic energy whose drift
``F_q`` is linear in ``p`` (Runge-Kutta-Nyström problems): there fewer conditions apply, and
``nystrom_order`` is the order they reach; on a separable field with a nonlinear drift (the H2-DNN's
``K_pᵀ σ(K_p p + b_p)``) they have ``order``.

The conditions up to order 10 take a fifth of a second (2410 trees on 71 substeps for ``sofspa10``), so each table is
built, and checked, on first use (:func:`splitting_tableau`), not at import.

DifferentialEquations.jl's names (OrdinaryDiffEq's symplectic methods) map onto these: ``SymplecticEuler`` is
``symplectic_euler`` and ``VelocityVerlet``/``VerletLeapfrog`` are ``verlet`` (kick-drift-kick: the schemes of
:mod:`solvers.schemes.split`); ``PseudoVerletLeapfrog`` is ``pseudo_verlet`` (drift-kick-drift); ``Yoshida6`` is
``yoshida6a`` (``yoshida6`` here is the triple jump of Yoshida-4, another sixth-order method of Yoshida 1990);
the others keep their names in lower case with underscores. Two deliberate differences: OrdinaryDiffEq's stepper
applies its ``b`` to the drift and its ``a`` to the kick, the roles swapped against the papers' convention used
here, which leaves the Nyström methods ``McAte4``, ``McAte5`` and ``CalvoSanz4`` third order on ``q'' = f(q)``
(their order conditions with a linear drift hold only with the papers' roles); and its ``McAte42`` runs McLachlan
(1995)'s coefficients with the roles swapped and the symmetric method's six stages folded into five, which makes it
first order (its issue 85 calls it broken); ``mcate42`` here is that method as published.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

from .order_conditions import splitting_defects

__all__ = [
    "SPLITTING_ORDERS",
    "SPLITTING_SPECS",
    "SplittingSpec",
    "SplittingTableau",
    "kick_drift_kick",
    "splitting_tableau",
]

# float64 coefficients satisfy their conditions to rounding (at most 1e-14 here); a wrong digit misses by far more
_ORDER_TOL = 1e-12


@dataclass(frozen=True)
class SplittingTableau:
    """The coefficients of a splitting method: one step is ``p ← p + b_i h F_p(q)``, ``q ← q + a_i h F_q(p)`` for
    ``i = 1, …, s`` (a zero coefficient is a substep skipped).

    ``order``: on every separable field; ``nystrom_order`` (0: the same): when ``F_q`` is linear in ``p``.
    Construction checks ``Σ a_i = Σ b_i = 1`` and every order condition up to ``order`` (and, with the drift
    linear, up to ``nystrom_order``) to ``1e-12``.
    """

    name: str
    order: int
    a: tuple[float, ...]
    b: tuple[float, ...]
    source: str
    nystrom_order: int = 0

    def __post_init__(self) -> None:
        if len(self.a) != len(self.b) or not self.a:
            raise ValueError(f"splitting {self.name}: `a` and `b` must have the same (non-zero) number of stages")
        for label, w in (("a", self.a), ("b", self.b)):
            if abs(math.fsum(w) - 1.0) > 1e-14:
                raise ValueError(f"splitting {self.name}: the weights `{label}` must sum to 1, not {math.fsum(w)!r}")
        self._check(self.order, False)
        if self.nystrom_order > self.order:
            self._check(self.nystrom_order, True)

    def _check(self, order: int, linear_drift: bool) -> None:
        worst = max(splitting_defects(self.sequence, order, linear_drift), key=lambda d: abs(d[0]))
        if abs(worst[0]) > _ORDER_TOL:
            part = "p (kick)" if worst[1] == 0 else "q (drift)"
            what = "with a linear drift " if linear_drift else ""
            raise ValueError(
                f"splitting {self.name}: misses an order-{_size(worst[2])} condition {what}by {worst[0]:.3g} "
                f"(tree {worst[2]} rooted at {part}), so it is not of the declared order {order}"
            )

    @property
    def sequence(self) -> tuple[tuple[int, float], ...]:
        """The substeps in the order they run: ``(0, b_i)`` kicks ``p``, ``(1, a_i)`` drifts ``q``; zeros left out."""
        out = []
        for ai, bi in zip(self.a, self.b):
            out += [(0, bi), (1, ai)]
        return tuple((part, c) for part, c in out if c != 0.0)

    @property
    def evaluations(self) -> int:
        """Half-field evaluations (``F_p`` or ``F_q``) per step."""
        return len(self.sequence)


def _size(tree: tuple) -> int:
    return 1 + sum(_size(sub) for sub in tree)


def kick_drift_kick(weights: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(a, b)`` of the composition of kick-drift-kick Störmer-Verlet steps of sizes ``w_1 h, …, w_m h``, adjacent
    half kicks merged: ``b = (w_1/2, (w_1 + w_2)/2, …, w_m/2)``, ``a = (w_1, …, w_m, 0)``."""
    w = tuple(weights)
    b = (w[0] / 2, *((w[i - 1] + w[i]) / 2 for i in range(1, len(w))), w[-1] / 2)
    return (*w, 0.0), b


def _palindrome(half: tuple[float, ...]) -> tuple[float, ...]:
    """``(w_1, …, w_k, …, w_1)`` from ``(w_1, …, w_k)``: a symmetric composition's weights."""
    return (*half, *half[-2::-1])


class SplittingSpec(NamedTuple):
    """A method's declared order, coefficients and source, before :class:`SplittingTableau` checks them."""

    order: int
    a: tuple[float, ...]
    b: tuple[float, ...]
    source: str
    nystrom_order: int = 0


def _mcate2() -> tuple[tuple[float, ...], tuple[float, ...]]:
    a2 = 1.0 - math.sqrt(2.0) / 2.0
    b2 = 1.0 / (2.0 * (1.0 - a2))
    return (1.0 - a2, a2), (1.0 - b2, b2)


def _mcate3() -> tuple[tuple[float, ...], tuple[float, ...]]:
    x = 0.9196615230173999
    y = 0.25 / x - x / 2.0
    z = 1.0 - x - y
    return (x, y, z), (z, y, x)


def _candy_roz4() -> tuple[tuple[float, ...], tuple[float, ...]]:
    c = 2.0 ** (1.0 / 3.0)
    a1, a2 = (2.0 + c + 1.0 / c) / 6.0, (1.0 - c - 1.0 / c) / 6.0
    return (a1, a2, a2, a1), (0.0, 1.0 / (2.0 - c), 1.0 / (1.0 - c * c), 1.0 / (2.0 - c))


def _mclachlan_sb3a() -> tuple[tuple[float, ...], tuple[float, ...]]:
    a1, a2 = 0.40518861839525227722, -0.28714404081652408900
    b1, b2 = -3.0 / 73.0, 17.0 / 59.0
    a3, b3 = 0.5 - a1 - a2, 1.0 - 2.0 * (b1 + b2)
    return (a1, a2, a3, a3, a2, a1), (0.0, b1, b2, b3, b2, b1)


def _yoshida6a() -> tuple[float, ...]:
    w1, w2, w3 = -1.17767998417887, 0.235573213359357, 0.784513610477560
    return _palindrome((w3, w2, w1, 1.0 - 2.0 * (w1 + w2 + w3)))


_KAHAN_LI6 = (
    0.39216144400731413927925056,
    0.33259913678935943859974864,
    -0.70624617255763935980996482,
    0.08221359629355080023149045,
    0.79854399093482996339895035,
)
_MCATE8 = (
    0.74167036435061295344822780,
    -0.40910082580003159399730010,
    0.19075471029623837995387626,
    -0.57386247111608226665638773,
    0.29906418130365592384446354,
    0.33462491824529818378495798,
    0.31529309239676659663205666,
    -0.79688793935291635401978884,
)
_KAHAN_LI8 = (
    0.13020248308889008087881763,
    0.56116298177510838456196441,
    -0.38947496264484728640807860,
    0.15884190655515560089621075,
    -0.39590389413323757733623154,
    0.18453964097831570709183254,
    0.25837438768632204729397911,
    0.29501172360931029887096624,
    -0.60550853383003451169892108,
)
_SOFSPA10 = (
    0.07879572252168641926390768,
    0.31309610341510852776481247,
    0.02791838323507806610952027,
    -0.22959284159390709415121340,
    0.13096206107716486317465686,
    -0.26973340565451071434460973,
    0.07497334315589143566613711,
    0.11199342399981020488957508,
    0.36613344954622675119314812,
    -0.39910563013603589787862981,
    0.10308739852747107731580277,
    0.41143087395589023782070412,
    -0.00486636058313526176219566,
    -0.39203335370863990644808194,
    0.05194250296244964703718290,
    0.05066509075992449633587434,
    0.04967437063972987905456880,
    0.04931773575959453791768001,
)

_MCATE2, _MCATE3, _CANDY_ROZ4, _SB3A = _mcate2(), _mcate3(), _candy_roz4(), _mclachlan_sb3a()
SPLITTING_SPECS: dict[str, SplittingSpec] = {
    "pseudo_verlet": SplittingSpec(2, (0.5, 0.5), (0.0, 1.0), "Verlet 1967, drift-kick-drift form"),
    "mcate2": SplittingSpec(2, *_MCATE2, "McLachlan & Atela 1992, optimal 2-stage method"),
    "ruth3": SplittingSpec(3, (2 / 3, -2 / 3, 1.0), (7 / 24, 3 / 4, -1 / 24), "Ruth 1983"),
    "mcate3": SplittingSpec(3, *_MCATE3, "McLachlan & Atela 1992, optimal 3-stage method"),
    "candy_roz4": SplittingSpec(4, *_CANDY_ROZ4, "Candy & Rozmus 1991"),
    "mcate4": SplittingSpec(
        3,
        (0.515352837431122936, -0.085782019412973646, 0.441583023616466524, 0.128846158365384185),
        (0.134496199277431089, -0.224819803079420806, 0.756320000515668291, 0.334003603286321425),
        "McLachlan & Atela 1992, optimal 4-stage Nyström method",
        nystrom_order=4,
    ),
    "calvo_sanz4": SplittingSpec(
        3,
        (0.205177661542290, 0.403021281604210, -0.12092087633891, 0.512721933192410, 0.0),
        (0.061758858135626, 0.33897802655364, 0.61479130717558, -0.14054801465937, 0.12501982279453),
        "Calvo & Sanz-Serna 1993",
        nystrom_order=4,
    ),
    "mcate42": SplittingSpec(4, *_SB3A, "McLachlan 1995, symmetric method S_B3A"),
    "mcate5": SplittingSpec(
        3,
        (
            0.339839625839110000,
            -0.088601336903027329,
            0.5858564768259621188,
            -0.603039356536491888,
            0.3235807965546976394,
            0.4423637942197494587,
        ),
        (
            0.1193900292875672758,
            0.6989273703824752308,
            -0.1713123582716007754,
            0.4012695022513534480,
            0.0107050818482359840,
            -0.0589796254980311632,
        ),
        "McLachlan & Atela 1992, optimal 6-stage Nyström method",
        nystrom_order=5,
    ),
    "yoshida6a": SplittingSpec(6, *kick_drift_kick(_yoshida6a()), "Yoshida 1990, Table 1, solution A"),
    "kahan_li6": SplittingSpec(6, *kick_drift_kick(_palindrome(_KAHAN_LI6)), "Kahan & Li 1997, s = 9"),
    "mcate8": SplittingSpec(8, *kick_drift_kick(_palindrome(_MCATE8)), "McLachlan 1995, s = 15"),
    "kahan_li8": SplittingSpec(8, *kick_drift_kick(_palindrome(_KAHAN_LI8)), "Kahan & Li 1997, s = 17"),
    "sofspa10": SplittingSpec(10, *kick_drift_kick(_palindrome(_SOFSPA10)), "Sofroniou & Spaletta 2005, s = 35"),
}

SPLITTING_ORDERS: dict[str, int] = {name: spec.order for name, spec in SPLITTING_SPECS.items()}
"""Each method's order on any separable field, by name (known without building the table)."""


@cache
def splitting_tableau(name: str) -> SplittingTableau:
    """The checked table of the splitting method ``name`` (one of :data:`SPLITTING_ORDERS`)."""
    if name not in SPLITTING_SPECS:
        raise ValueError(f"unknown splitting method {name!r}; valid: {', '.join(SPLITTING_SPECS)}.")
    return SplittingTableau(name, *SPLITTING_SPECS[name])
