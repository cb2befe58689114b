r"""Runge-Kutta order conditions from rooted trees (Butcher 2016, "Numerical methods for ordinary differential
equations", §31-32): a method ``(A, b)`` has order ``p`` when ``Σ_i b_i Φ_i(τ) = 1 / γ(τ)`` for every rooted tree
``τ`` with at most ``p`` vertices, with the elementary weights ``Φ_i(•) = 1``,
``Φ_i([τ_1, …, τ_m]) = Π_k (A Φ(τ_k))_i`` and the density ``γ(τ) = |τ| Π_k γ(τ_k)``.

A dense output ``y_0 + h Σ_i b_i(θ) k_i`` is of order ``q`` at ``θ`` when ``Σ_i b_i(θ) Φ_i(τ) = θ^{|τ|} / γ(τ)``
for ``|τ| ≤ q`` (Hairer, Nørsett & Wanner 1993, "Solving Ordinary Differential Equations I", §II.6, eq. 6.11).

Plain Python floats: the tableaux are checked at import; each subtree's elementary weights are computed once per
check, so the largest (dopri8's order 8, 200 trees over 14 stages) takes a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

__all__ = ["order_defects", "trees"]

Tree = tuple  # a rooted tree: the sorted tuple of its root's subtrees (the single vertex is ``()``)


@cache
def trees(order: int) -> tuple[Tree, ...]:
    """Every rooted tree with ``order`` vertices (1, 1, 2, 4, 9, 20 of them for orders 1 to 6)."""
    if order == 1:
        return ((),)
    out: set[Tree] = set()
    for forest in _forests(order - 1, order - 1):
        out.add(tuple(sorted(forest)))
    return tuple(sorted(out))


def _forests(n: int, largest: int) -> list[list[Tree]]:
    """Lists of trees with ``n`` vertices in all, each of at most ``largest`` vertices, largest first (a multiset
    may come more than once: :func:`trees` keeps each once)."""
    if n == 0:
        return [[]]
    out: list[list[Tree]] = []
    for size in range(min(n, largest), 0, -1):
        for tree in trees(size):
            out.extend([tree, *rest] for rest in _forests(n - size, size))
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


def _weights(a: Sequence[Sequence[float]], tree: Tree, memo: dict[Tree, list[float]]) -> list[float]:
    if tree in memo:
        return memo[tree]
    s = len(a)
    phi = [1.0] * s
    for sub in tree:
        inner = _weights(a, sub, memo)
        for i in range(s):
            phi[i] *= sum(a[i][j] * inner[j] for j in range(len(a[i])))
    memo[tree] = phi
    return phi


def order_defects(
    a: Sequence[Sequence[float]], b: Sequence[float], order: int, theta: float = 1.0
) -> list[tuple[float, Tree]]:
    """``(Σ_i b_i Φ_i(τ) − θ^{|τ|} / γ(τ), τ)`` for every tree ``τ`` of at most ``order`` vertices; ``a`` as rows
    (an explicit method's rows may be short: the missing entries are zero). ``θ = 1``: the step's own conditions;
    else those of a dense output whose weights at ``θ`` are ``b``."""
    out = []
    memo: dict[Tree, list[float]] = {}  # each subtree's elementary weights once
    for p in range(1, order + 1):
        for tree in trees(p):
            phi = _weights(a, tree, memo)
            out.append((sum(bi * f for bi, f in zip(b, phi)) - theta**p / _density(tree), tree))
    return out
