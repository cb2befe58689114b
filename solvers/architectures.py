"""The solver ↔ architecture map of SPEC §6, as one table.

``architecture(scheme, field_kind)`` returns the architecture a scheme realises on a kind of field; kinds are
the ``kind`` attribute fields declare (``hamiltonian``, ``hamiltonian_baseline``, ``cubic_friction``, ``nais``,
``second_order``, ``generic``). A row with kind ``"any"`` applies when no more specific row does.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Architecture", "ARCHITECTURES", "architecture", "markdown_table"]


class Architecture(NamedTuple):
    scheme: str
    field_kind: str
    name: str
    equation: str


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("euler", "any", "ResNet block x + h F(x)", "—"),
    Architecture("euler", "hamiltonian", "H1-DNN (MS2 when K skew and J Kᵀ = I)", "eq. H9"),
    Architecture("euler", "hamiltonian_baseline", "MS2 (skew K)", "H App. I"),
    Architecture("euler", "cubic_friction", "Ruseckas residual", "eq. R109"),
    Architecture("euler", "nais", "NAIS-Net block", "eq. N3"),
    Architecture("symplectic_euler", "hamiltonian", "H2-DNN", "eqs. H12-13"),
    Architecture("symplectic_euler", "hamiltonian_baseline", "MS3", "H App. I"),
    Architecture("symplectic_euler_qp", "hamiltonian_baseline", "MS1 (Verlet)", "H App. I"),
    Architecture("symplectic_euler_qp", "second_order", "second-order residual (B §8), Momentum ResNet", "B §8"),
    Architecture("symplectic_euler", "any", "semi-implicit (symplectic) Euler net, p first", "eqs. H12-13"),
    Architecture("symplectic_euler_qp", "any", "semi-implicit (symplectic) Euler net, q first", "H App. I"),
    Architecture("verlet", "any", "Störmer-Verlet (leapfrog) net", "—"),
    Architecture("momentum", "any", "second-order residual / Momentum ResNet (heavy ball)", "B §8"),
    Architecture("ck", "any", "Hauser C^k network", "eq. S7"),
    Architecture("dense", "any", "DenseNet state space (k lags)", "eq. S22"),
    Architecture("lm2", "any", "LM-ResNet two-step (Ruseckas)", "eq. R111"),
    Architecture("midpoint", "any", "RK2 (midpoint) block, for comparison", "—"),
    Architecture("rk4", "any", "RK4 block, for comparison", "—"),
)


def architecture(scheme: str, field_kind: str = "any") -> tuple[str, str]:
    """``(architecture name, paper equation)`` of ``scheme`` on a field of ``field_kind``."""
    rows = [r for r in ARCHITECTURES if r.scheme == scheme]
    if not rows:
        known = sorted({r.scheme for r in ARCHITECTURES})
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {', '.join(known)}.")
    for r in rows:
        if r.field_kind == field_kind:
            return r.name, r.equation
    for r in rows:
        if r.field_kind == "any":
            return r.name, r.equation
    return rows[0].name, rows[0].equation


def markdown_table() -> str:
    lines = ["| scheme | field | architecture | equation |", "|---|---|---|---|"]
    lines += [f"| {r.scheme} | {r.field_kind} | {r.name} | {r.equation} |" for r in ARCHITECTURES]
    return "\n".join(lines)
