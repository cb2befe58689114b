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

A Runge-Kutta-Nyström method for ``q'' = f(q, q')`` (:func:`nystrom_defects`) is checked on the Nyström trees
(Hairer, Nørsett & Wanner 1993, §II.14): fat vertices are evaluations of ``f``; a meagre vertex (``q' = v``, linear)
has no child (``v_0``) or one fat child; a fat vertex's children are meagre (``∂f/∂q``) or, when ``f`` depends on
``q'``, fat (``∂f/∂q'``).

Plain Python floats for the Butcher tableaux: they are checked at import; each subtree's elementary weights are
computed once per check, so the largest (dopri8's order 8, 200 trees over 14 stages) takes a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np

__all__ = ["nystrom_defects", "nystrom_trees", "order_defects", "splitting_defects", "trees"]

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


NystromTree = tuple  # a fat-rooted Nyström tree: the sorted children, each (0,) meagre leaf, (1, τ) meagre with fat
# child τ, or (2, τ) fat child τ (an f that depends on q')


@cache
def nystrom_trees(order: int, velocity: bool) -> tuple[NystromTree, ...]:
    """Every fat-rooted Nyström tree with ``order`` vertices (1, 1, 2, 3, 6, 10, 20, 36 for ``q'' = f(q)``;
    1, 2, 6, 18, 60, 204, 730 with ``velocity``, ``f(q, q')``)."""
    if order == 1:
        return ((),)
    items: list[tuple[tuple, int]] = [((0,), 1)]
    for m in range(1, order - 1):
        for tree in nystrom_trees(m, velocity):
            items.append(((1, tree), m + 1))
    if velocity:
        items += [((2, tree), m) for m in range(1, order) for tree in nystrom_trees(m, velocity)]
    out: set[NystromTree] = set()

    def pick(start: int, left: int, chosen: tuple) -> None:
        if left == 0:
            out.add(tuple(sorted(chosen, key=repr)))
        for k in range(start, len(items)):
            if items[k][1] <= left:
                pick(k, left - items[k][1], (*chosen, items[k][0]))

    pick(0, order - 1, ())
    return tuple(sorted(out, key=repr))


@cache
def _nystrom_size(tree: NystromTree) -> int:
    return 1 + sum(1 if ch[0] == 0 else _nystrom_size(ch[1]) + (ch[0] == 1) for ch in tree)


@cache
def _nystrom_density(tree: NystromTree) -> int:
    out = _nystrom_size(tree)
    for ch in tree:
        if ch[0] == 1:
            out *= (_nystrom_size(ch[1]) + 1) * _nystrom_density(ch[1])
        elif ch[0] == 2:
            out *= _nystrom_density(ch[1])
    return out


def nystrom_defects(
    c: Sequence[float],
    a: Sequence[Sequence[float]],
    b: Sequence[float],
    bp: Sequence[float],
    order: int,
    av: Sequence[Sequence[float]] | None = None,
    theta: float = 1.0,
) -> list[tuple[float, str, int, NystromTree]]:
    """``(defect, component, order, τ)`` of the conditions up to ``order`` of the Runge-Kutta-Nyström method
    ``Q_i = q_0 + c_i h v_0 + h² Σ_j a_ij k_j``, ``V_i = v_0 + h Σ_j av_ij k_j`` (only when ``av`` is given: ``f``
    depends on ``q'``), ``k_i = f(Q_i, V_i)``, ``q_1 = q_0 + h v_0 + h² Σ_i b_i k_i``, ``v_1 = v_0 + h Σ_i bp_i k_i``:
    ``Σ_i bp_i Φ_i(τ) = θ^{|τ|−1} / γ(τ)`` (``v``, ``|τ| ≤ order``) and ``Σ_i b_i Φ_i(τ) = θ^{|τ|−1} / ((|τ| + 1)
    γ(τ))`` (``q``, ``|τ| ≤ order − 1``) with ``Φ_i`` the product over the children of ``c_i`` (meagre leaf),
    ``(a Φ(σ))_i`` (meagre with fat child ``σ``) or ``(av Φ(σ))_i`` (fat child ``σ``). ``θ < 1``: the conditions
    of a dense output ``q_0 + θ h v_0 + (θh)² Σ b_i(θ) k_i``, ``v_0 + θ h Σ bp_i(θ) k_i`` whose weights at ``θ`` are
    ``b``, ``bp`` (Hairer, Nørsett & Wanner 1993, §II.14)."""
    cv = np.asarray(c, dtype=float)
    A = np.asarray(a, dtype=float)
    AV = None if av is None else np.asarray(av, dtype=float)
    memo: dict[NystromTree, np.ndarray] = {}

    def phi(tree: NystromTree) -> np.ndarray:
        if tree not in memo:
            out = np.ones(len(cv))
            for ch in tree:
                if ch[0] == 0:
                    out = out * cv
                else:
                    out = out * ((A if ch[0] == 1 else AV) @ phi(ch[1]))
            memo[tree] = out
        return memo[tree]

    out = []
    for p in range(1, order + 1):
        for tree in nystrom_trees(p, AV is not None):
            gamma = _nystrom_density(tree)
            out.append((float(np.dot(bp, phi(tree))) - theta ** (p - 1) / gamma, "v", p, tree))
            if p < order:
                out.append((float(np.dot(b, phi(tree))) - theta ** (p - 1) / ((p + 1) * gamma), "q", p + 1, tree))
    return out
