r"""Runge-Kutta order conditions from rooted trees (Butcher 2016, "Numerical methods for ordinary differential
equations", §31-32): a method ``(A, b)`` has order ``p`` when ``Σ_i b_i Φ_i(τ) = 1 / γ(τ)`` for every rooted tree
``τ`` with at most ``p`` vertices, with the elementary weights ``Φ_i(•) = 1``,
``Φ_i([τ_1, …, τ_m]) = Π_k (A Φ(τ_k))_i`` and the density ``γ(τ) = |τ| Π_k γ(τ_k)``.

A dense output ``y_0 + h Σ_i b_i(θ) k_i`` is of order ``q`` at ``θ`` when ``Σ_i b_i(θ) Φ_i(τ) = θ^{|τ|} / γ(τ)``
for ``|τ| ≤ q`` (Hairer, Nørsett & Wanner 1993, "Solving Ordinary Differential Equations I", §II.6, eq. 6.11).

A splitting method for a separable field ``p' = F_p(q)``, ``q' = F_q(p)`` (:func:`splitting_defects`) is a
partitioned Runge-Kutta method; its conditions are those of the bi-coloured trees (Hairer, Lubich & Wanner 2006,
"Geometric numerical integration", §III.2.1-III.2.2) whose adjacent vertices differ in colour, the others' elementary
differentials vanishing on a separable field (a ``p`` vertex's children are derivatives of ``F_p``, which depends on
``q`` alone).

Plain Python floats for the Butcher tableaux: they are checked at import, and the largest (order 5, 17 trees) takes
well under a millisecond.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np

__all__ = ["order_defects", "splitting_defects", "trees"]

Tree = tuple  # a rooted tree: the sorted tuple of its root's subtrees (the single vertex is ``()``)


@cache
def trees(order: int) -> tuple[Tree, ...]:
    """Every rooted tree with ``order`` vertices (1, 1, 2, 4, 9, 20, 48, 115, 286, 719 of them for orders 1 to 10)."""
    if order == 1:
        return ((),)
    return tuple(sorted(set(_forests(order - 1, order - 1, None))))


def _forests(n: int, size: int, largest: Tree | None) -> list[Tree]:
    """The multisets of trees with ``n`` vertices in all, each of at most ``size`` vertices and, among those of
    exactly ``size``, none after ``largest``: each multiset once, as a sorted tuple (the subtrees of one root)."""
    if n == 0:
        return [()]
    out: list[Tree] = []
    for s in range(min(n, size), 0, -1):
        for tree in trees(s):
            if s == size and largest is not None and tree > largest:
                continue
            out.extend(tuple(sorted((tree, *rest))) for rest in _forests(n - s, s, tree))
    return out


@cache
def _size(tree: Tree) -> int:
    return 1 + sum(_size(sub) for sub in tree)


@cache
def _density(tree: Tree) -> int:
    out = _size(tree)
    for sub in tree:
        out *= _density(sub)
    return out


def _weights(a: Sequence[Sequence[float]], tree: Tree) -> list[float]:
    s = len(a)
    phi = [1.0] * s
    for sub in tree:
        inner = _weights(a, sub)
        for i in range(s):
            phi[i] *= sum(a[i][j] * inner[j] for j in range(len(a[i])))
    return phi


def order_defects(
    a: Sequence[Sequence[float]], b: Sequence[float], order: int, theta: float = 1.0
) -> list[tuple[float, Tree]]:
    """``(Σ_i b_i Φ_i(τ) − θ^{|τ|} / γ(τ), τ)`` for every tree ``τ`` of at most ``order`` vertices; ``a`` as rows
    (an explicit method's rows may be short: the missing entries are zero). ``θ = 1``: the step's own conditions;
    else those of a dense output whose weights at ``θ`` are ``b``."""
    out = []
    for p in range(1, order + 1):
        for tree in trees(p):
            phi = _weights(a, tree)
            out.append((sum(bi * f for bi, f in zip(b, phi)) - theta**p / _density(tree), tree))
    return out


def splitting_defects(
    sequence: Sequence[tuple[int, float]], order: int, linear_drift: bool = False
) -> list[tuple[float, int, Tree]]:
    """``(defect, part, τ)`` of every order condition up to ``order`` of the splitting method whose substeps are
    ``sequence``: ``(0, c)`` is the kick ``p ← p + c h F_p(q)``, ``(1, c)`` the drift ``q ← q + c h F_q(p)``, in
    the order they run. For a tree ``τ`` whose root is a ``part`` vertex, the defect is
    ``Σ_{i: part_i = part} c_i Φ_i(τ) − 1 / γ(τ)`` with ``Φ_i([τ_1, …, τ_m]) = Π_k Σ_{j < i, part_j ≠ part}
    c_j Φ_j(τ_k)``: a substep sees the other half as the substeps before it left it.

    ``linear_drift``: only the conditions that remain when ``F_q`` is linear in ``p`` (a quadratic kinetic energy,
    ``q'' = f(q)``: the Runge-Kutta-Nyström case), i.e. the trees whose drift vertices have at most one child.
    """
    parts = np.array([part for part, _ in sequence])
    coef = np.array([c for _, c in sequence], dtype=float)
    masks = (parts == 0, parts == 1)
    memo: dict[tuple[Tree, int], np.ndarray] = {}

    def phi(tree: Tree, part: int) -> np.ndarray:
        key = (tree, part)
        if key not in memo:
            out = np.ones(len(coef))
            for sub in tree:
                seen = np.where(masks[1 - part], coef * phi(sub, 1 - part), 0.0)
                out = out * (np.cumsum(seen) - seen)  # Σ over the substeps j < i
            memo[key] = out
        return memo[key]

    def kept(tree: Tree, part: int) -> bool:
        if linear_drift and part == 1 and len(tree) > 1:
            return False
        return all(kept(sub, 1 - part) for sub in tree)

    out = []
    for p in range(1, order + 1):
        for tree in trees(p):
            for part in (0, 1):
                if kept(tree, part):
                    value = float(np.sum(np.where(masks[part], coef * phi(tree, part), 0.0)))
                    out.append((value - 1.0 / _density(tree), part, tree))
    return out
