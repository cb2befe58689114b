"""The solver ↔ architecture map of SPEC §6, as one table.

``architecture(scheme, field_kind)`` returns the architecture a scheme realises on a kind of field; kinds are
the ``kind`` attribute fields declare (``hamiltonian``, ``ms1``, ``ms2``, ``ms3``, ``cubic_friction``, ``nais``,
``second_order``, ``generic``). A row with kind ``"any"`` applies when no more specific row does.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Architecture", "ARCHITECTURES", "architecture", "architecture_table"]


class Architecture(NamedTuple):
    scheme: str
    field_kind: str
    name: str
    equation: str


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("euler", "any", "ResNet block x + h F(x)", "—"),
    Architecture("euler", "hamiltonian", "H1-DNN (MS2 when K skew and J Kᵀ = I)", "eq. H9"),
    Architecture("euler", "ms2", "MS2 (skew K)", "H App. I, eq. 39"),
    Architecture("euler", "cubic_friction", "Ruseckas residual", "eq. R109"),
    Architecture("euler", "nais", "NAIS-Net block", "eq. N3"),
    Architecture("symplectic_euler", "any", "semi-implicit (symplectic) Euler net, p first", "eqs. H12-13"),
    Architecture("symplectic_euler", "hamiltonian", "H2-DNN", "eqs. H12-13"),
    Architecture("symplectic_euler", "ms3", "MS3", "H App. I, eq. 40"),
    Architecture("symplectic_euler_qp", "any", "semi-implicit (symplectic) Euler net, q first", "H App. I"),
    Architecture("symplectic_euler_qp", "ms1", "MS1 (Verlet)", "H App. I, eq. 38"),
    Architecture("symplectic_euler_qp", "second_order", "second-order residual (B §8), Momentum ResNet", "B §8"),
    Architecture("verlet", "any", "Störmer-Verlet (leapfrog) net", "—"),
    Architecture("momentum", "any", "second-order residual / Momentum ResNet (heavy ball), own m_l, η_l", "B §8"),
    Architecture("momentum", "second_order", "second-order residual (B §8), m = 1 − hγ, η = hη from the field",
                 "B §8"),
    Architecture("ck", "any", "Hauser C^k network", "eq. S7"),
    Architecture("dense", "any", "DenseNet state space (k lags)", "eq. S22"),
    Architecture("lm2", "any", "LM-ResNet two-step (Ruseckas)", "eq. R111"),
    Architecture("midpoint", "any", "RK2 (midpoint) block, for comparison", "—"),
    Architecture("rk4", "any", "RK4 block, for comparison", "—"),
)


def architecture(scheme, field_kind="any") -> tuple[str, str]:
    """``(architecture name, paper equation)`` of ``scheme`` on a field of ``field_kind``.

    ``scheme``: a name or an object with ``.name`` (a :class:`~solvers.schemes.Scheme`); ``field_kind``: a kind
    string or an object with a ``.kind`` attribute (a field). Kinds without a row of their own get the ``"any"`` row.
    """
    scheme = getattr(scheme, "name", scheme)
    if not isinstance(field_kind, str):
        field_kind = getattr(field_kind, "kind", "generic")
    rows = {r.field_kind: r for r in ARCHITECTURES if r.scheme == scheme}
    if not rows:
        known = list(dict.fromkeys(r.scheme for r in ARCHITECTURES))
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {', '.join(known)}.")
    row = rows.get(field_kind, rows["any"])
    return row.name, row.equation


def architecture_table() -> str:
    """The map as the README shows it (markdown)."""
    lines = ["| scheme | field | architecture | equation |", "|---|---|---|---|"]
    lines += [f"| `{r.scheme}` | {r.field_kind} | {r.name} | {r.equation} |" for r in ARCHITECTURES]
    return "\n".join(lines)
