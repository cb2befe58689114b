r"""Implicit Runge-Kutta methods as data: a full Butcher tableau with its order and declared properties.

An ``s``-stage method with tableau ``(A, b, c)`` takes one step of size ``h`` from ``y_0`` at ``t_0`` by solving the
stage equations for the stage increments ``Z_i`` (Hairer & Wanner 1996, "Solving ordinary differential equations
II", §IV.8, eq. 8.2)

    ``Z_i = h Σ_j a_ij F(t_0 + c_j h, y_0 + Z_j)``,   ``y_1 = y_0 + h Σ_i b_i F(t_0 + c_i h, y_0 + Z_i)``.

Every tableau checks itself on construction: rows of ``A`` sum to ``c``, the rooted-tree order conditions up to
``min(order, 4)`` (Butcher 2016, "Numerical methods for ordinary differential equations", §31), the quadrature
conditions ``Σ b_i c_i^{k−1} = 1/k`` up to ``order``, and every declared property:

- ``symplectic``: ``b_i a_ij + b_j a_ji − b_i b_j = 0`` for all ``i, j`` (Sanz-Serna 1988; Hairer, Lubich & Wanner
  2006, "Geometric numerical integration", Thm. VI.4.3): the step map preserves every quadratic invariant and the
  canonical 2-form.
- ``symmetric``: ``a_ij + a_{s+1−i, s+1−j} = b_j`` (HLW 2006, Thm. V.2.3): ``Φ_{−h} = Φ_h^{−1}``, so a step is
  undone by the step with ``−h`` (the memory-free gradient uses this).
- ``A-stable``: ``|R(z)| ≤ 1`` on ``Re z ≤ 0`` for the stability function ``R(z) = 1 + z bᵀ(I − zA)^{−1} 1``
  (checked on the imaginary axis, with the poles in the right half-plane).
- ``L-stable``: A-stable and ``R(−∞) = 0``.
- ``stiffly accurate``: the last row of ``A`` is ``b`` (then ``y_1`` is the last stage).

Coefficients: Gauss-Legendre (Butcher 1964, "Implicit Runge-Kutta processes", Math. Comp. 18), Radau IIA (Ehle 1969;
Hairer & Wanner 1996, Table IV.5.5-6), SDIRK2 (Alexander 1977, "Diagonally implicit Runge-Kutta methods for stiff
ODEs", SIAM J. Numer. Anal. 14, γ = 1 − 1/√2), TR-BDF2 as an ESDIRK (Hosea & Shampine 1996, "Analysis and
implementation of TR-BDF2", Appl. Numer. Math. 20, γ = 2 − √2). Names as in torchdiffeq's fixed-step implicit
solvers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ImplicitTableau", "IMPLICIT_TABLEAUX", "PROPERTIES"]

PROPERTIES = frozenset({"symplectic", "symmetric", "A-stable", "L-stable", "stiffly accurate"})


@dataclass(frozen=True)
class ImplicitTableau:
    """A full Butcher tableau ``(a, b, c)``, its classical ``order`` and declared ``properties``; checked on
    construction (see the module)."""

    name: str
    order: int
    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    c: tuple[float, ...]
    properties: frozenset[str] = field(default_factory=frozenset)
    reference: str = ""

    def __post_init__(self) -> None:
        s = len(self.b)
        if len(self.a) != s or len(self.c) != s or any(len(r) != s for r in self.a):
            raise ValueError(f"tableau {self.name}: a must be {s}×{s} and c of length {s}")
        unknown = set(self.properties) - PROPERTIES
        if unknown:
            raise ValueError(f"tableau {self.name}: unknown properties {sorted(unknown)}; known: {sorted(PROPERTIES)}")
        A, b, c = self.A, np.array(self.b), np.array(self.c)
        for i in range(s):
            if abs(A[i].sum() - c[i]) > 1e-14:
                raise ValueError(f"tableau {self.name}: row {i} of a sums to {A[i].sum()}, not c = {c[i]}")
        for residual, cond in _order_conditions(A, b, c, self.order):
            if abs(residual) > 1e-13:
                raise ValueError(f"tableau {self.name}: order condition {cond} fails by {residual:.3g}")
        for prop in self.properties:
            bad = _property_defect(prop, A, b)
            if bad > 1e-13:
                raise ValueError(f"tableau {self.name}: declared {prop!r} but its condition fails by {bad:.3g}")

    @property
    def A(self) -> np.ndarray:
        return np.array(self.a, dtype=np.float64)

    @property
    def stages(self) -> int:
        return len(self.b)

    @property
    def symplectic(self) -> bool:
        return "symplectic" in self.properties

    @property
    def symmetric(self) -> bool:
        return "symmetric" in self.properties

    def stability(self, z: complex) -> complex:
        """``R(z) = 1 + z bᵀ (I − zA)^{−1} 1``: the step's factor on ``y' = λy``, ``z = hλ``."""
        return _stability(self.A, np.array(self.b), z)


def _order_conditions(A: np.ndarray, b: np.ndarray, c: np.ndarray, order: int):
    """``(residual, name)`` of the rooted-tree conditions up to ``min(order, 4)`` and the quadrature conditions
    ``Σ b c^{k−1} = 1/k`` up to ``order``."""
    trees = [
        (1, lambda: b.sum() - 1, "Σb = 1"),
        (2, lambda: b @ c - 1 / 2, "Σbc = 1/2"),
        (3, lambda: b @ c**2 - 1 / 3, "Σbc² = 1/3"),
        (3, lambda: b @ A @ c - 1 / 6, "Σb a c = 1/6"),
        (4, lambda: b @ c**3 - 1 / 4, "Σbc³ = 1/4"),
        (4, lambda: (b * c) @ A @ c - 1 / 8, "Σbc a c = 1/8"),
        (4, lambda: b @ A @ c**2 - 1 / 12, "Σb a c² = 1/12"),
        (4, lambda: b @ A @ A @ c - 1 / 24, "Σb a a c = 1/24"),
    ]
    out = [(float(f()), name) for p, f, name in trees if p <= order]
    out += [(float(b @ c ** (k - 1) - 1 / k), f"Σbc^{k - 1} = 1/{k}") for k in range(5, order + 1)]
    return out


def _stability(A: np.ndarray, b: np.ndarray, z: complex) -> complex:
    s = len(b)
    return complex(1 + z * b @ np.linalg.solve(np.eye(s) - z * A, np.ones(s)))


def _property_defect(prop: str, A: np.ndarray, b: np.ndarray) -> float:
    if prop == "symplectic":
        return float(np.abs(b[:, None] * A + (b[:, None] * A).T - np.outer(b, b)).max())
    if prop == "symmetric":
        return float(np.abs(A + A[::-1, ::-1] - b[None, :]).max())
    if prop == "stiffly accurate":
        return float(np.abs(A[-1] - b).max())
    # A-stability: no pole of R in the left half-plane (eigenvalues of A with Re < 0) and |R(iy)| ≤ 1
    ev = np.linalg.eigvals(A)
    defect = max(0.0, float(-ev.real.min()))
    # |R(iy)| on 400 points of the imaginary axis, one batched solve (import time: this runs for every tableau)
    z = 1j * np.concatenate([-np.logspace(-3, 6, 200), np.logspace(-3, 6, 200)])
    s = len(b)
    k = np.linalg.solve(np.eye(s)[None] - z[:, None, None] * A[None], np.ones((len(z), s, 1), dtype=complex))
    defect = max(defect, float(np.abs(1 + z * (k[..., 0] @ b)).max()) - 1.0)
    if prop == "L-stable":
        defect = max(defect, abs(_stability(A, b, -1e9)) - 1e-6)
    return max(defect, 0.0) if prop in ("A-stable", "L-stable") else math.inf


def _t(name, order, a, b, c, props, ref) -> ImplicitTableau:
    return ImplicitTableau(
        name=name,
        order=order,
        a=tuple(tuple(float(x) for x in r) for r in a),
        b=tuple(float(x) for x in b),
        c=tuple(float(x) for x in c),
        properties=frozenset(props),
        reference=ref,
    )


_S3, _S6, _S15, _S2 = math.sqrt(3), math.sqrt(6), math.sqrt(15), math.sqrt(2)
_GL = ("symplectic", "symmetric", "A-stable")
_G_SD = 1 - 1 / _S2  # SDIRK2's diagonal
_G_TR = 2 - _S2  # TR-BDF2's intermediate time
_D_TR, _W_TR = _G_TR / 2, _S2 / 4

IMPLICIT_TABLEAUX: dict[str, ImplicitTableau] = {
    t.name: t
    for t in (
        _t(
            "implicit_euler",
            1,
            [[1.0]],
            [1.0],
            [1.0],
            ("A-stable", "L-stable", "stiffly accurate"),
            "backward Euler",
        ),
        _t("implicit_midpoint", 2, [[0.5]], [1.0], [0.5], _GL, "Gauss-Legendre, 1 stage"),
        _t(
            "trapezoid",
            2,
            [[0.0, 0.0], [0.5, 0.5]],
            [0.5, 0.5],
            [0.0, 1.0],
            ("symmetric", "A-stable", "stiffly accurate"),
            "Lobatto IIIA, 2 stages (Crank-Nicolson)",
        ),
        _t(
            "gl4",
            4,
            [[1 / 4, 1 / 4 - _S3 / 6], [1 / 4 + _S3 / 6, 1 / 4]],
            [1 / 2, 1 / 2],
            [1 / 2 - _S3 / 6, 1 / 2 + _S3 / 6],
            _GL,
            "Gauss-Legendre, 2 stages (Butcher 1964)",
        ),
        _t(
            "gl6",
            6,
            [
                [5 / 36, 2 / 9 - _S15 / 15, 5 / 36 - _S15 / 30],
                [5 / 36 + _S15 / 24, 2 / 9, 5 / 36 - _S15 / 24],
                [5 / 36 + _S15 / 30, 2 / 9 + _S15 / 15, 5 / 36],
            ],
            [5 / 18, 4 / 9, 5 / 18],
            [1 / 2 - _S15 / 10, 1 / 2, 1 / 2 + _S15 / 10],
            _GL,
            "Gauss-Legendre, 3 stages (Butcher 1964)",
        ),
        _t(
            "radauIIA3",
            3,
            [[5 / 12, -1 / 12], [3 / 4, 1 / 4]],
            [3 / 4, 1 / 4],
            [1 / 3, 1.0],
            ("A-stable", "L-stable", "stiffly accurate"),
            "Radau IIA, 2 stages (Ehle 1969)",
        ),
        _t(
            "radauIIA5",
            5,
            [
                [(88 - 7 * _S6) / 360, (296 - 169 * _S6) / 1800, (-2 + 3 * _S6) / 225],
                [(296 + 169 * _S6) / 1800, (88 + 7 * _S6) / 360, (-2 - 3 * _S6) / 225],
                [(16 - _S6) / 36, (16 + _S6) / 36, 1 / 9],
            ],
            [(16 - _S6) / 36, (16 + _S6) / 36, 1 / 9],
            [(4 - _S6) / 10, (4 + _S6) / 10, 1.0],
            ("A-stable", "L-stable", "stiffly accurate"),
            "Radau IIA, 3 stages (Ehle 1969)",
        ),
        _t(
            "sdirk2",
            2,
            [[_G_SD, 0.0], [1 - _G_SD, _G_SD]],
            [1 - _G_SD, _G_SD],
            [_G_SD, 1.0],
            ("A-stable", "L-stable", "stiffly accurate"),
            "SDIRK, 2 stages (Alexander 1977)",
        ),
        _t(
            "trbdf2",
            2,
            [[0.0, 0.0, 0.0], [_D_TR, _D_TR, 0.0], [_W_TR, _W_TR, _D_TR]],
            [_W_TR, _W_TR, _D_TR],
            [0.0, _G_TR, 1.0],
            ("A-stable", "L-stable", "stiffly accurate"),
            "TR-BDF2 as an ESDIRK (Hosea & Shampine 1996)",
        ),
    )
}
