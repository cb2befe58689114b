r"""The explicit Runge-Kutta methods as data: one table for both modes (continuous solves replay their accepted
steps with it; discrete-mode Runge-Kutta layers are its tableaux).

A method is a Butcher tableau (Butcher 2016, "Numerical methods for ordinary differential equations", §23)

    ``Y_i = y_0 + h Σ_{j<i} a_ij k_j``,   ``k_i = F(t_0 + c_i h, Y_i)``,   ``y_1 = y_0 + h Σ_i b_i k_i``,

plus, for adaptive methods, the error weights ``e`` (``h Σ_i e_i k_i`` estimates the local error) and the
weights ``m`` of the state at the step's midpoint, ``y_{1/2} = y_0 + h Σ_i m_i k_i``, on which the dense output
(a quartic through ``y_0, y_{1/2}, y_1`` with slopes ``k_first, k_last``) is built.

The coefficients are those torchdiffeq 0.2.5 steps with (the same rational numbers, evaluated to the same
doubles; bosh3's midpoint weights excepted, below), so that :mod:`solvers.gradients.replay` reproduces its accepted
steps to rounding:

- ``dopri5``: Dormand & Prince (1980), "A family of embedded Runge-Kutta formulae", J. Comput. Appl. Math. 6;
  midpoint weights from Shampine (1986), "Some practical Runge-Kutta formulas", Math. Comp. 46.
- ``bosh3``: Bogacki & Shampine (1989), "A 3(2) pair of Runge-Kutta formulas", Appl. Math. Lett. 2. Its dense
  output is the cubic Hermite interpolant that they note comes free (from ``y_0, y_1`` and the slopes
  ``k_1, k_4`` the method has anyway), third order like the method. Here cde_nets deliberately differs from
  torchdiffeq, whose midpoint ``y_0 + h k_2 / 2`` makes every interpolated output (and so ``y(T)``, read off the
  last step's interpolant) only second order: wrong by O(1) on ``y' = t/2 + 1``, which the steps integrate exactly.
- ``rk4``: Kutta's 3/8 rule (torchdiffeq's ``rk4`` is this one, not the classical tableau), in both modes;
  ``rk4_classical``: the classical tableau (Kutta 1901), a discrete-mode scheme (torchdiffeq has no such method).
- ``euler``, ``midpoint``, ``heun2`` (explicit trapezoid), ``heun3`` (Heun's third-order method).
- ``fehlberg2``: Fehlberg's 1(2) pair (Fehlberg 1969, NASA TR R-315, the RKF1(2) formula), stepping with its
  second-order solution; ``adaptive_heun``: Heun's method (the explicit trapezoid) with Euler's as the embedded
  estimate. Neither is FSAL: the last stage is ``F(t_1, ·)`` at a state other than ``y_1``, and torchdiffeq reuses
  it as the next step's first stage all the same, so a step is a map of its start state *and* that carried slope
  (:mod:`solvers.gradients.replay` carries it back). Their dense output is the cubic Hermite one, as ``bosh3``'s.
- ``dopri8``: Prince & Dormand's RK8(7)13M (:mod:`solvers.steppers.dopri8`), with a seventh-order continuous extension.

Evaluation times follow torchdiffeq: a stage with ``c_i = 1`` is evaluated just before ``t_1``
(``nextafter(t_1, −∞)``), so a step that ends on a parameter jump never sees the next piece; the first stage of
a fixed step just after ``t_0``. The first stage of an adaptive step is the last stage of the step before
(for ``fsal`` methods, "first same as last", that is ``F(t_1, y_1)``), re-evaluated at ``y_1`` just after ``t_0``
when that step ended on a jump.
"""

from __future__ import annotations

from .butcher import MethodTableau, Tableau, dense_at, hermite_mid, quartic
from .dopri8 import DOPRI8

__all__ = ["MethodTableau", "TABLEAUX", "Tableau", "dense_at", "hermite_mid", "quartic"]


def _tab(a, b, c) -> Tableau:
    return Tableau(a=tuple(tuple(r) for r in a), b=tuple(b), c=tuple(c))


_DOPRI5_B = (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0)
_DOPRI5 = MethodTableau(
    name="dopri5",
    order=5,
    tableau=_tab(
        a=[
            [],
            [1 / 5],
            [3 / 40, 9 / 40],
            [44 / 45, -56 / 15, 32 / 9],
            [19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729],
            [9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656],
            list(_DOPRI5_B[:-1]),
        ],
        b=_DOPRI5_B,
        c=[0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0],
    ),
    error=(
        35 / 384 - 1951 / 21600,
        0.0,
        500 / 1113 - 22642 / 50085,
        125 / 192 - 451 / 720,
        -2187 / 6784 - -12231 / 42400,
        11 / 84 - 649 / 6300,
        -1.0 / 60.0,
    ),
    mid=(
        6025192743 / 30085553152 / 2,
        0.0,
        51252292925 / 65400821598 / 2,
        -2691868925 / 45128329728 / 2,
        187940372067 / 1594534317056 / 2,
        -1776094331 / 19743644256 / 2,
        11237099 / 235043384 / 2,
    ),
)

_BOSH3_B = (2 / 9, 1 / 3, 4 / 9, 0.0)
_BOSH3 = MethodTableau(
    name="bosh3",
    order=3,
    tableau=_tab(a=[[], [1 / 2], [0.0, 3 / 4], list(_BOSH3_B[:-1])], b=_BOSH3_B, c=[0.0, 1 / 2, 3 / 4, 1.0]),
    error=(2 / 9 - 7 / 24, 1 / 3 - 1 / 4, 4 / 9 - 1 / 3, -1 / 8),
    mid=hermite_mid(_BOSH3_B),  # not torchdiffeq's second-order y_0 + h k_2 / 2 (module docstring)
)


def _expand(scale: float, *factors: tuple[float, ...]) -> tuple[float, ...]:
    """``scale · Π factors`` (each a polynomial in ``θ``, lowest power first) as the coefficients of
    ``θ^1 … θ^4``."""
    out = [scale]
    for f in factors:
        prod = [0.0] * (len(out) + len(f) - 1)
        for i, x in enumerate(out):
            for j, y in enumerate(f):
                prod[i + j] += x * y
        out = prod
    out += [0.0] * (5 - len(out))
    return tuple(out[1:5])


_THETA, _THETA2 = (0.0, 1.0), (0.0, 0.0, 1.0)
_TSIT5_B = (
    0.09646076681806522951816731316512876,
    0.01,
    0.4798896504144995747752495322905966,
    1.379008574103741893192274821856873,
    -3.290069515436080679901047585711364,
    2.324710524099773982415355918398766,
    0.0,
)
_TSIT5_EMBEDDED = (
    0.09468075576583945807478876255758923,
    0.009183565540343253096776363936645314,
    0.4877705284247615707855642599631228,
    1.234297566930478985655109673884238,
    -2.707712349983525454881109975059322,
    1.866628418170587035753719399566211,
    1 / 66,
)
# Tsitouras' continuous extension b_i(θ) (his section 3), in the factored form he gives it
_TSIT5_DENSE = tuple(
    zip(
        _expand(
            -1.0530884977290216, _THETA, (-1.3299890189751412, 1.0), (0.7139816917074209, -1.4364028541716351, 1.0)
        ),
        _expand(0.1017, _THETA2, (1.2949852507374631, -2.1966568338249754, 1.0)),
        _expand(2.490627285651252793, _THETA2, (1.57803468208092486, -2.38535645472061657, 1.0)),
        _expand(-16.54810288924490272, _THETA2, (-1.21712927295533244, 1.0), (-0.61620406037800089, 1.0)),
        _expand(47.37952196281928122, _THETA2, (-1.203071208372362603, 1.0), (-0.658047292653547382, 1.0)),
        _expand(-34.87065786149660974, _THETA2, (-1.2, 1.0), (-2 / 3, 1.0)),
        _expand(2.5, _THETA2, (-1.0, 1.0), (-0.6, 1.0)),
    )
)
_TSIT5 = MethodTableau(
    name="tsit5",
    order=5,
    tableau=_tab(
        a=[
            [],
            [0.161],
            [-0.008480655492356988544426874250230775, 0.3354806554923569885444268742502308],
            [
                2.897153057105493432130432594192939,
                -6.359448489975074843148159912383826,
                4.362295432869581411017727318190887,
            ],
            [
                5.325864828439256604428877920840511,
                -11.74888356406282787774717033978577,
                7.495539342889836208304604784564358,
                -0.09249506636175524925650207933207192,
            ],
            [
                5.861455442946420028659251486982648,
                -12.92096931784710929170611868178336,
                8.159367898576158643180400794539253,
                -0.07158497328140099722453054252582974,
                -0.02826905039406838290900305721271224,
            ],
            list(_TSIT5_B[:-1]),
        ],
        b=_TSIT5_B,
        c=[0.0, 0.161, 0.327, 0.9, 0.9800255409045096857298102862870246, 1.0, 1.0],
    ),
    error=tuple(b - e for b, e in zip(_TSIT5_B, _TSIT5_EMBEDDED)),
    dense=_TSIT5_DENSE,
    dense_order=4,
)
_FEHLBERG2_B = (1 / 512, 255 / 256, 1 / 512)
_FEHLBERG2 = MethodTableau(
    name="fehlberg2",
    order=2,
    tableau=_tab(a=[[], [1 / 2], [1 / 256, 255 / 256]], b=_FEHLBERG2_B, c=[0.0, 1 / 2, 1.0]),
    error=(1 / 512 - 1 / 256, 0.0, 1 / 512),  # the embedded first-order weights (1/256, 255/256, 0)
    mid=hermite_mid(_FEHLBERG2_B),  # not torchdiffeq's first-order y_0 + h k_2 / 2
)
_ADAPTIVE_HEUN = MethodTableau(
    name="adaptive_heun",
    order=2,
    tableau=_tab(a=[[], [1.0]], b=[0.5, 0.5], c=[0.0, 1.0]),
    error=(0.5, -0.5),  # Euler's step y_0 + h k_1 embedded
    mid=hermite_mid((0.5, 0.5)),  # not torchdiffeq's first-order y_0 + h k_1 / 2
)
TABLEAUX: dict[str, MethodTableau] = {
    "dopri8": DOPRI8,
    "dopri5": _DOPRI5,
    "tsit5": _TSIT5,
    "bosh3": _BOSH3,
    "fehlberg2": _FEHLBERG2,
    "adaptive_heun": _ADAPTIVE_HEUN,
    "euler": MethodTableau("euler", 1, _tab([[]], [1.0], [0.0])),
    "midpoint": MethodTableau("midpoint", 2, _tab([[], [0.5]], [0.0, 1.0], [0.0, 0.5])),
    "heun2": MethodTableau("heun2", 2, _tab([[], [1.0]], [0.5, 0.5], [0.0, 1.0])),
    "heun3": MethodTableau("heun3", 3, _tab([[], [1 / 3], [0.0, 2 / 3]], [1 / 4, 0.0, 3 / 4], [0.0, 1 / 3, 2 / 3])),
    "rk4": MethodTableau(
        "rk4",
        4,
        _tab([[], [1 / 3], [-1 / 3, 1.0], [1.0, -1.0, 1.0]], [1 / 8, 3 / 8, 3 / 8, 1 / 8], [0.0, 1 / 3, 2 / 3, 1.0]),
    ),
    "rk4_classical": MethodTableau(
        "rk4_classical",
        4,
        _tab([[], [0.5], [0.0, 0.5], [0.0, 0.0, 1.0]], [1 / 6, 1 / 3, 1 / 3, 1 / 6], [0.0, 0.5, 0.5, 1.0]),
        continuous=False,
    ),
}
