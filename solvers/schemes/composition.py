r"""Higher-order symplectic layers for separable fields: compositions of Störmer-Verlet steps.

A symmetric second-order step ``Φ_h`` composed as ``Φ_{γ_1 h} ∘ Φ_{γ_2 h} ∘ Φ_{γ_1 h}`` with
``γ_1 = 1 / (2 − 2^{1/(2k+1)})``, ``γ_2 = 1 − 2γ_1`` has order ``2k + 2`` if ``Φ`` has order ``2k`` (the "triple
jump", Yoshida 1990, "Construction of higher order symplectic integrators", Phys. Lett. A 150, eq. 4.14 and §5;
Hairer, Lubich & Wanner 2006, §II.4, eq. 4.4). Verlet tripled is order 4 (three Verlet steps); order 4 tripled is
order 6 (nine Verlet steps). Each is a composition of shears, so symplectic and explicitly invertible on separable
fields (``p'`` from ``q`` alone, ``q'`` from ``p`` alone): an "H2-DNN of order 4 / 6". Adjacent ``p`` half steps of
consecutive Verlet steps are merged: ``3·2 + 1`` and ``9·2 + 1`` evaluations per layer.
"""

from __future__ import annotations

from .split import _Substeps

__all__ = ["Composition", "Yoshida4", "Yoshida6"]


def _triple(weights: tuple[float, ...], order: int) -> tuple[float, ...]:
    g1 = 1.0 / (2.0 - 2.0 ** (1.0 / (order + 1)))
    g2 = 1.0 - 2.0 * g1
    return tuple(w * g for g in (g1, g2, g1) for w in weights)


class Composition(_Substeps):
    """Verlet steps of sizes ``γ_k h`` in sequence (:attr:`weights`), adjacent ``p`` half steps merged."""

    weights: tuple[float, ...] = (1.0,)

    def stages(self, t, h):
        out: list[tuple[int, float, float]] = []
        tau = t
        for g in self.weights:
            if out and out[-1][0] == 0:
                out[-1] = (0, out[-1][1] + 0.5 * g, tau)
            else:
                out.append((0, 0.5 * g, tau))
            out.append((1, g, tau + 0.5 * g * h))
            tau += g * h
            out.append((0, 0.5 * g, tau))
        return tuple(out)

    def evaluations(self, l):
        return 2 * len(self.weights) + 1


class Yoshida4(Composition):
    """Yoshida's fourth-order triple jump of Störmer-Verlet (Yoshida 1990, eq. 4.14): order 4 and symplectic on
    separable fields, first order elsewhere."""

    name, order, equation = "yoshida4", 4, "Yoshida 1990, eq. 4.14"
    description = "Yoshida triple jump of Verlet (order 4): Verlet steps γ₁h, (1 − 2γ₁)h, γ₁h, γ₁ = 1/(2 − 2^⅓)"
    weights = _triple((1.0,), 2)


class Yoshida6(Composition):
    """The triple jump of :class:`Yoshida4` (Yoshida 1990, §5): nine Verlet steps, order 6 on separable fields."""

    name, order, equation = "yoshida6", 6, "Yoshida 1990, §5"
    description = "triple jump of Yoshida-4 (order 6): nine Verlet steps"
    weights = _triple(_triple((1.0,), 2), 4)
