"""The solver ↔ architecture map of discrete mode, as one table in code.

``architecture(scheme, field_kind, variant)`` returns the architecture a scheme realises on a kind of field; kinds
are the ``kind`` attribute fields declare (``hamiltonian``, ``ms1``, ``ms2``, ``ms3``, ``cubic_friction``, ``nais``,
``second_order``, ``generic``). ``variant`` says which parameters and properties the scheme actually has on the field
(:attr:`solvers.schemes.Scheme.variant` of the scheme resolved for it): ``""`` as declared, ``"non-separable"`` for a
split scheme on a field whose halves are not separable (explicit, not symplectic), ``"field velocity"`` for momentum
on an order-2 field (``m``, ``η`` from the field). A row with kind ``"any"`` applies when no more specific row does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .steppers.splitting_tableaux import SPLITTING_SPECS

__all__ = ["Architecture", "ARCHITECTURES", "architecture", "architecture_table"]


class Architecture(NamedTuple):
    scheme: str
    field_kind: str
    name: str
    equation: str
    variant: str = ""


_NS, _FV = "non-separable", "field velocity"


def _splitting_rows() -> tuple[Architecture, ...]:
    """Three rows per splitting method of :mod:`solvers.steppers.splitting_tableaux`, from its declared order and
    source."""
    rows: list[Architecture] = []
    for name, spec in SPLITTING_SPECS.items():
        nystrom = f" (order {spec.nystrom_order} for q'' = f(q))" if spec.nystrom_order else ""
        rows += [
            Architecture(name, "any", f"{name} net: symplectic splitting, order {spec.order}{nystrom}", spec.source),
            Architecture(
                name, "hamiltonian", f"H2-DNN of order {spec.order} ({name} splitting)", f"eqs. H12-13; {spec.source}"
            ),
            Architecture(
                name, "any", "splitting-type net, first order (not symplectic: the field is not separable)", "—", _NS
            ),
        ]
    return tuple(rows)


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("euler", "any", "ResNet block x + h F(x)", "—"),
    Architecture("euler", "hamiltonian", "H1-DNN (MS2 when K skew and J Kᵀ = I)", "eq. H9"),
    Architecture("euler", "ms2", "MS2 (skew K)", "H App. I, eq. 39"),
    Architecture("euler", "cubic_friction", "Ruseckas residual", "eq. R109"),
    Architecture("euler", "nais", "NAIS-Net block", "eq. N3"),
    Architecture("symplectic_euler", "any", "semi-implicit (symplectic) Euler net, p first", "eqs. H12-13"),
    Architecture("symplectic_euler", "hamiltonian", "H2-DNN", "eqs. H12-13"),
    Architecture("symplectic_euler", "ms3", "MS3", "H App. I, eq. 40"),
    Architecture(
        "symplectic_euler",
        "any",
        "semi-implicit Euler net, p first (not symplectic: the field is not separable)",
        "—",
        _NS,
    ),
    Architecture("symplectic_euler_qp", "any", "semi-implicit (symplectic) Euler net, q first", "H App. I"),
    Architecture("symplectic_euler_qp", "ms1", "MS1 (Verlet)", "H App. I, eq. 38"),
    Architecture(
        "symplectic_euler_qp",
        "any",
        "semi-implicit Euler net, q first (not symplectic: the field is not separable)",
        "—",
        _NS,
    ),
    Architecture("symplectic_euler_qp", "second_order", "second-order residual (B §8), Momentum ResNet", "B §8", _NS),
    Architecture("verlet", "any", "Störmer-Verlet (leapfrog) net", "—"),
    Architecture(
        "verlet", "any", "explicit Verlet-type net, first order (not symplectic: the field is not separable)", "—", _NS
    ),
    Architecture("yoshida4", "any", "Yoshida-4 net: triple jump of Störmer-Verlet, order 4", "Yoshida 1990"),
    Architecture("yoshida4", "hamiltonian", "H2-DNN of order 4 (Yoshida triple jump of Verlet)", "eqs. H12-13"),
    Architecture(
        "yoshida4", "any", "Verlet-type composition, first order (not symplectic: the field is not separable)", "—", _NS
    ),
    Architecture("yoshida6", "any", "Yoshida-6 net: triple jump of Yoshida-4, order 6", "Yoshida 1990"),
    Architecture("yoshida6", "hamiltonian", "H2-DNN of order 6 (triple jump of Yoshida-4)", "eqs. H12-13"),
    Architecture(
        "yoshida6", "any", "Verlet-type composition, first order (not symplectic: the field is not separable)", "—", _NS
    ),
    Architecture("implicit_midpoint", "any", "implicit-midpoint net y' = y + h F((y + y')/2), invertible", "GL1"),
    Architecture(
        "implicit_midpoint", "hamiltonian", "symplectic H-DNN by implicit midpoint (any J, K; H1 included)", "eq. H8"
    ),
    Architecture("gl4", "any", "Gauss-Legendre net, 2 stages, order 4, invertible", "GL2"),
    Architecture("gl4", "hamiltonian", "symplectic H-DNN of order 4 by Gauss-Legendre (any J, K; H1)", "eq. H8"),
    Architecture("gl6", "any", "Gauss-Legendre net, 3 stages, order 6, invertible", "GL3"),
    Architecture("gl6", "hamiltonian", "symplectic H-DNN of order 6 by Gauss-Legendre (any J, K; H1)", "eq. H8"),
    Architecture("momentum", "any", "second-order residual / Momentum ResNet (heavy ball), own m_l, η_l", "B §8"),
    Architecture("momentum", "any", "heavy ball on the field's own velocity, m, η from the field", "B §8", _FV),
    Architecture(
        "momentum", "second_order", "second-order residual (B §8), m = 1 − hγ, η = hη from the field", "B §8", _FV
    ),
    Architecture("ck", "any", "Hauser C^k network", "eq. S7"),
    Architecture("dense", "any", "DenseNet state space (k lags)", "eq. S22"),
    Architecture("lm2", "any", "LM-ResNet two-step (Ruseckas)", "eq. R111"),
    Architecture("alf", "any", "asynchronous leapfrog (MALI) net, state (y, v), invertible", "MALI Alg. 1"),
    Architecture("midpoint", "any", "RK2 (midpoint) block, for comparison", "—"),
    Architecture("rk4", "any", "RK4 block (Kutta's 3/8 rule, torchdiffeq's rk4), for comparison", "—"),
    Architecture("rk4_classical", "any", "RK4 block (classical tableau), for comparison", "—"),
    Architecture("nystrom4", "any", "Nyström net: RKN step of order 4 on (x, v)", "Abramowitz & Stegun 25.5.20"),
    Architecture(
        "nystrom4", "second_order", "second-order residual net by the Nyström step, order 4", "B §8; A&S 25.5.20"
    ),
    Architecture("dprkn6", "any", "Nyström net: Dormand-Prince RKN step of order 6, q'' = f(q)", "DP 1987"),
    Architecture(
        "dprkn6", "second_order", "undamped second-order net (Hauser C²) by DPRKN6, order 6", "S §2.2; DP 1987"
    ),
    Architecture("dprkn8", "any", "Nyström net: Dormand-El-Mikkawy-Prince RKN step of order 8, q'' = f(q)", "DEP 1987"),
    Architecture(
        "dprkn8", "second_order", "undamped second-order net (Hauser C²) by DPRKN8, order 8", "S §2.2; DEP 1987"
    ),
    *_splitting_rows(),
)


def architecture(scheme: Any, field_kind: Any = "any", variant: str | None = None) -> tuple[str, str]:
    """``(architecture name, paper equation)`` of ``scheme`` on a field of ``field_kind``.

    ``scheme``: a name or a :class:`~solvers.schemes.Scheme`; ``field_kind``: a kind string, or a field — then a
    scheme object resolves the variant it has on that field (e.g. ``"non-separable"`` for ``symplectic_euler`` on
    ``Hamiltonian(K="full")``, :meth:`~solvers.schemes.Scheme.architecture`). ``variant``: the row variant
    (default: the scheme object's, else ``""``). Kinds without a row of their own get the ``"any"`` row of that
    variant.
    """
    name = getattr(scheme, "name", scheme)
    if not isinstance(field_kind, str):
        if variant is None and hasattr(scheme, "architecture"):
            return scheme.architecture(field_kind)
        field_kind = getattr(field_kind, "kind", "generic")
    if variant is None:
        variant = getattr(scheme, "variant", "")
    rows = [r for r in ARCHITECTURES if r.scheme == name]
    if not rows:
        known = list(dict.fromkeys(r.scheme for r in ARCHITECTURES))
        raise ValueError(f"unknown scheme {name!r}; valid schemes: {', '.join(known)}.")
    by_kind = {r.field_kind: r for r in rows if r.variant == variant}
    row = by_kind.get(field_kind, by_kind.get("any"))
    if row is None:
        raise ValueError(f"scheme {name!r} has no architecture row for variant {variant!r}.")
    return row.name, row.equation


def architecture_table() -> str:
    """The map as the README shows it (markdown)."""
    lines = ["| scheme | field | variant | architecture | equation |", "|---|---|---|---|---|"]
    lines += [
        f"| `{r.scheme}` | {r.field_kind} | {r.variant or '—'} | {r.name} | {r.equation} |" for r in ARCHITECTURES
    ]
    return "\n".join(lines)
