"""Discrete schemes as objects: one step per parameter piece, and each scheme *is* a layer architecture.

A scheme declares its convergence ``order``, the ``state`` it carries (``"plain"``; ``"split"``: a ``(p, q)`` pair;
``"velocity"``: ``(x, v)``; ``"lags"``: ``k`` differences or lagged states), the fields on which its properties
hold, and its learnable per-layer coefficients (:meth:`Scheme.coefficient_init`; the net creates them).
``scheme.for_field(field, split)`` returns the scheme as it runs on that field — it knows how to reach the
field's halves and reports the ``order``, ``properties`` and ``variant`` (row of the architecture map) that hold
there — and refuses a field it cannot run on. Then ``init(y0)``, ``step(f, l, state, h, coef, t)``,
``readout(state)``; states are tuples of tensors, never packed per layer.

``f`` is the field bound to one call: ``f.evaluate(l, y, t=...)`` (piece ``l``; ``t``, the stage's time, is used
only by fields that are not piecewise, e.g. a plain ``forward(t, y)`` module), ``f.evaluate_part(l, y, part)``
and, on separable fields, ``f.evaluate_half(l, z, part)`` (``p'`` from ``q`` alone, ``q'`` from ``p`` alone).
Updates ``y + h F`` go through :func:`~.base.axpy`: one fused ``torch.add(y, F, alpha=h)`` eagerly, the written-out
form under ``torch.compile`` (torch 2.13's inductor mis-lowers add-with-alpha after a matmul: answers off by 6 on
an H1 net). This module never imports ``cde_nets``.
"""

from .base import Scheme, State, Tableau, dense_matrix
from .composition import Composition, Yoshida4, Yoshida6
from .implicit import GL4, GL6, ImplicitMidpoint, ImplicitRungeKutta
from .lags import CK, LM2, Dense
from .leapfrog import ALF
from .momentum import Momentum
from .nystrom import DPRKN6, DPRKN8, Nystrom, Nystrom4
from .projected import Projected
from .registry import SCHEME_CLASSES, SCHEMES, get_scheme
from .runge_kutta import RK4, Euler, Midpoint, RK4Classical, RungeKutta
from .split import SymplecticEuler, SymplecticEulerQP, Verlet
from .splitting import SPLITTING_SCHEMES, Splitting

__all__ = [
    "Tableau",
    "Scheme",
    "State",
    "Euler",
    "RungeKutta",
    "Midpoint",
    "RK4",
    "RK4Classical",
    "SymplecticEuler",
    "SymplecticEulerQP",
    "Verlet",
    "Momentum",
    "CK",
    "Dense",
    "LM2",
    "ALF",
    "Composition",
    "Yoshida4",
    "Yoshida6",
    "Splitting",
    "Projected",
    "Nystrom",
    "Nystrom4",
    "DPRKN6",
    "DPRKN8",
    "SPLITTING_SCHEMES",
    "ImplicitRungeKutta",
    "ImplicitMidpoint",
    "GL4",
    "GL6",
    "SCHEME_CLASSES",
    "SCHEMES",
    "get_scheme",
    "dense_matrix",
]
