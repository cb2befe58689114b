r"""Binomial checkpointing: which states of a chain of ``n`` steps to keep in ``k`` slots, and how to reverse the
chain from them (the schedule only: indices, no tensors).

Reversal. The backward pass needs the start states ``x_{n-1}, …, x_1, x_0`` of the steps in that order. A state
kept in a slot is read back; any other is recomputed by advancing from a kept state before it. Griewank's binomial
schedule (Griewank 1992, "Achieving logarithmic growth of temporal and spatial complexity in reverse automatic
differentiation", Optim. Methods Softw. 1; Griewank & Walther 2000, "Algorithm 799: revolve", ACM TOMS 26) reverses
``l`` steps whose first state sits in one of ``s`` slots with the fewest advances,

    ``t(l, s) = r l − β(s + 1, r − 1)``,   ``β(s, r) = (s + r)! / (s! r!)``,   ``β(s, r − 1) < l ≤ β(s, r)``,

(``r``: the repetition number, the most times one step is advanced), by the recursion
``t(l, s) = min_j [j + t(l − j, s − 1) + t(j, s)]``: advance ``j`` steps, keep that state in a fresh slot,
reverse the ``l − j`` steps after it with the other ``s − 1`` slots, free the slot, reverse the first ``j``.

Forward pass. Here the forward solve has already run to ``x_n`` (a free sweep) and placed the kept states, so
the backward pass only recomputes: segment ``i`` (from the ``i``-th kept state to the next) is reversed last to
first with the ``k − i`` slots the earlier kept states leave free, ``Σ_i t(l_i, k − i)`` advances. With ``n``
known (offline), the best placement costs ``t(n + 1, k) − n`` (the revolve sweep over ``n + 1`` steps whose last
is the loss, less the ``n`` steps the forward solve took anyway): :func:`offline_recomputations`.

An adaptive solve does not know ``n`` before it stops, so its placement is online (Stumm & Walther 2010, "New
algorithms for optimal online checkpointing", SIAM J. Sci. Comput. 32(2)): each new state is kept or not, and a
kept one may replace an earlier one, without knowing whether more steps follow. :class:`OnlineSchedule` keeps
the placement that reverses with the fewest advances were the solve to stop after the new state's step (ties:
the new state kept in place of the earliest dispensable one). Stumm and Walther show that an online placement
can match the offline optimum while ``n ≤ β(k, 2)``; this one does, for every such ``n`` (checked for
``k ≤ 8``). Beyond it, no online placement can be optimal for every ``n``; this one was measured within 15% of
the offline count up to ``β(k, 3)`` (``k ≤ 5``), and for ``n = 1000`` at 1.9%, 1.1%, 3.3% and 0.1% above it
for ``k = 4, 8, 16, 32``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from math import comb
from typing import TypeVar

__all__ = [
    "OnlineSchedule",
    "beta",
    "check_budget",
    "offline_recomputations",
    "repetition_number",
    "reversal",
    "revolve_advances",
    "walk_back",
]

S = TypeVar("S")


def check_budget(budget: object) -> None:
    """Refuse a slot count that is not a positive ``int``, naming the argument."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            f"`budget` is the number of states checkpointing may keep: a positive int (or None to keep every "
            f"step's), got {budget!r}."
        )


def beta(s: int, r: int) -> int:
    """``β(s, r) = C(s + r, s)``: the most steps ``s`` slots reverse with repetition number ``r``."""
    return comb(s + r, s) if r >= 0 else 0


@cache
def repetition_number(steps: int, slots: int) -> int:
    """The least ``r`` with ``steps ≤ β(slots, r)``."""
    r = 0
    while beta(slots, r) < steps:
        r += 1
    return r


@cache
def revolve_advances(steps: int, slots: int) -> int:
    """Griewank's ``t(l, s) = r l − β(s + 1, r − 1)``: the fewest advances that reverse ``l`` steps (their first
    state in one of ``s`` slots, the state being advanced held apart, as in revolve)."""
    if steps <= 1:
        return 0
    r = repetition_number(steps, slots)
    return r * steps - beta(slots + 1, r - 1)


def offline_recomputations(n: int, k: int) -> int:
    """The fewest steps a backward pass recomputes for ``n`` steps and ``k`` slots, the placement chosen knowing
    ``n``: ``t(n + 1, k) − n``."""
    return revolve_advances(n + 1, k) - n if n > 0 else 0


def segment_cost(positions: list[int], n: int, k: int) -> int:
    """The advances that reverse ``n`` steps from the kept states ``positions`` (increasing, from 0)."""
    ends = [*positions[1:], n]
    return sum(revolve_advances(b - a, k - i) for i, (a, b) in enumerate(zip(positions, ends)))


@cache
def _split(steps: int, slots: int) -> int:
    """Where the optimal reversal of ``steps`` steps with ``slots`` slots keeps its next state."""
    return min(
        range(1, steps),
        key=lambda j: (j + revolve_advances(steps - j, slots - 1) + revolve_advances(j, slots), -j),
    )


class OnlineSchedule:
    """The kept states of a forward solve whose length is not known in advance (see the module).

    Call :meth:`admit` with each new step start ``i = 0, 1, …`` in order; it answers whether to keep the state
    and which kept one (by index) to drop for it. :attr:`positions` are the kept indices."""

    def __init__(self, slots: int) -> None:
        check_budget(slots)
        self.slots = slots
        self.positions: list[int] = []
        self.peak = 0  # the most states the forward solve's recorder held at once (it reports them here)

    def admit(self, i: int) -> tuple[bool, int | None]:
        """``(keep, drop)`` for step start ``i``: keep it (dropping the kept index ``drop``, if not ``None``)."""
        p = self.positions
        if len(p) < self.slots:
            p.append(i)
            return True, None
        k, n = self.slots, i + 1
        # (advances were the solve to stop after step i, not kept, which kept index is dropped): the fewest
        # advances; on a tie the new state kept in place of the earliest dispensable one
        best, choice = (segment_cost(p, n, k), 1, 0), None
        for j in range(1, len(p)):
            trial = (segment_cost([*p[:j], *p[j + 1 :], i], n, k), 0, j)
            if trial < best:
                best, choice = trial, j
        if choice is None:
            return False, None
        dropped = p.pop(choice)
        p.append(i)
        return True, dropped

    def recomputations(self, n: int) -> int:
        """The advances :func:`reversal` will make for a solve that stopped after ``n`` steps."""
        return segment_cost(self.positions, n, self.slots)


def reversal(positions: list[int], n: int, slots: int) -> Iterator[tuple[str, int]]:
    """The backward pass's actions over ``n`` steps from the kept states ``positions``, with at most ``slots``
    kept at once:

    - ``("load", i)``: the working state becomes the kept ``x_i``;
    - ``("advance", i)``: the working state ``x_i`` becomes ``x_{i+1}`` (one recomputed step);
    - ``("keep", i)``: keep the working state ``x_i`` in a free slot;
    - ``("visit", i)``: differentiate step ``i`` from the working state ``x_i``;
    - ``("drop", i)``: free the slot of ``x_i``.

    Steps are visited ``n − 1, …, 0``."""
    ends = [*positions[1:], n]
    for idx in range(len(positions) - 1, -1, -1):
        a = positions[idx]
        yield from _reverse(a, ends[idx] - a, slots - idx)
        yield ("drop", a)


def walk_back(
    kept: dict[int, S], n: int, slots: int, advance: Callable[[int, S], S], counts: dict[str, int]
) -> Iterator[tuple[int, S]]:
    """``(i, x_i)`` for ``i = n − 1, …, 0``, from the kept states ``kept`` (index → state, ``kept[0]`` among
    them), recomputing the others with ``advance(i, x_i) = x_{i+1}`` by :func:`reversal`. ``kept`` is emptied as
    the pass goes. ``counts``: ``"advances"`` (steps recomputed) and ``"peak"`` (the most states kept at once)
    are added to."""
    work: S | None = None
    counts["peak"] = max(counts.get("peak", 0), len(kept))
    for action, i in reversal(sorted(kept), n, slots):
        if action == "load":
            work = kept[i]
        elif action == "advance":
            assert work is not None
            work = advance(i, work)
            counts["advances"] = counts.get("advances", 0) + 1
        elif action == "keep":
            assert work is not None
            kept[i] = work
            counts["peak"] = max(counts["peak"], len(kept))
        elif action == "drop":
            del kept[i]
        else:
            assert work is not None
            yield i, work


def _reverse(a: int, steps: int, slots: int) -> Iterator[tuple[str, int]]:
    if steps == 1:
        yield ("load", a)
        yield ("visit", a)
        return
    if slots == 1:
        for i in range(steps - 1, -1, -1):
            yield ("load", a)
            for m in range(a, a + i):
                yield ("advance", m)
            yield ("visit", a + i)
        return
    j = _split(steps, slots)
    yield ("load", a)
    for m in range(a, a + j):
        yield ("advance", m)
    yield ("keep", a + j)
    yield from _reverse(a + j, steps - j, slots - 1)
    yield ("drop", a + j)
    yield from _reverse(a, j, slots)
