r"""The explicit symplectic splitting methods as layers: one stepper, :class:`Splitting`, runs any table of
:mod:`solvers.steppers.splitting_tableaux`.

A layer is ``p ← p + b_i h F_p(q)``, ``q ← q + a_i h F_q(p)`` for ``i = 1, …, s`` (Ruth 1983; McLachlan & Atela
1992): with ``s = 1``, ``a = b = (1)`` the H2-DNN layer (Galimberti et al. 2023, eqs. H12-13), and each method of the
table a deeper H2-DNN layer of higher order. On separable fields every substep is a shear by the other half, so the
layer is symplectic and explicitly invertible (its substeps undone in reverse order); elsewhere (``split=`` on any
field, or a field whose halves are coupled) it runs as the same explicit substeps, first order and not symplectic,
labelled ``variant = "non-separable"``.
"""

from __future__ import annotations

from typing import Any

from ..steppers.splitting_tableaux import SPLITTING_SPECS, SplittingTableau, splitting_tableau
from .split import _Substeps

__all__ = ["SPLITTING_SCHEMES", "Splitting"]


class Splitting(_Substeps):
    """A splitting method of :mod:`solvers.steppers.splitting_tableaux` on a ``(p, q)`` split (subclasses set
    :attr:`name`;
    :data:`SPLITTING_SCHEMES` holds one per table)."""

    @property
    def tableau(self) -> SplittingTableau:
        """The method's coefficients, checked against its order conditions on first use."""
        return splitting_tableau(self.name)

    def evaluations(self, l):
        return self.tableau.evaluations

    def stages(self, t, h):
        out = []
        drifted = 0.0
        for part, c in self.tableau.sequence:
            # time moves with the drift (t as one more drifted coordinate); negative coefficients can take it
            # outside the step, where a piecewise field would read a neighbouring piece: clamped into the step
            out.append((part, c, t + h * min(max(drifted, 0.0), 1.0)))
            if part == 1:
                drifted += c
        return tuple(out)


def _scheme(name: str) -> type[Splitting]:
    spec = SPLITTING_SPECS[name]
    nystrom = f"; order {spec.nystrom_order} when q' is linear in p (q'' = f(q))" if spec.nystrom_order else ""
    attrs: dict[str, Any] = {
        "name": name,
        "order": spec.order,
        "equation": spec.source,
        "description": f"splitting method {name} ({spec.source}): order {spec.order} on separable fields{nystrom}",
        "__doc__": f"{spec.source}: order {spec.order} and symplectic on separable fields{nystrom}.",
    }
    return type("".join(w.capitalize() for w in name.split("_")), (Splitting,), attrs)


SPLITTING_SCHEMES: dict[str, type[Splitting]] = {name: _scheme(name) for name in SPLITTING_SPECS}
