"""Parameters that are constant on pieces of time (:class:`PiecewiseParam`) and their gradients, accumulated
piece by piece: what the piecewise adjoint (:mod:`solvers.gradients.piecewise_adjoint`), the step replay
(:mod:`solvers.gradients.replay`) and the reversible integrator (:mod:`solvers.steppers.alf`) share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Grads", "LazyPieces", "PiecewiseParam", "piece_slots"]


class PiecewiseParam(NamedTuple):
    """A parameter tensor that is constant on pieces of time, as the piecewise adjoint sees it.

    - ``data``: ``(L, *shape)``, piece ``l`` is ``data[l]``.
    - ``boundaries``: the ``L + 1`` times ``τ_0 < ... < τ_L``; piece ``l`` holds on ``[τ_l, τ_{l+1})``.
    - ``piece_at(t)``: the piece in force at ``t`` (the field's own lookup, clamped to ``[0, L − 1]``).
    - ``set_views(views)``: make the field read piece ``l`` as ``views[l]`` from now on; ``None`` restores its
      own ``data[l]``.
    """

    data: torch.Tensor
    boundaries: Sequence[float]
    piece_at: Callable[[Any], int]
    set_views: Callable[[Sequence[torch.Tensor] | None], None]


def piece_slots(params, pieces) -> tuple[tuple, list[int], list[int | None]]:
    """The parameters that require grad, the indices of the ``pieces`` among them (in order), and for each
    parameter its slot among those pieces (``None`` for a parameter that is not piecewise)."""
    params = tuple(p for p in params if p.requires_grad)
    pos = {id(p.data): j for j, p in enumerate(pieces)}
    used = sorted({pos[id(p)] for p in params if id(p) in pos})
    renum = {j: k for k, j in enumerate(used)}
    slot = [renum[pos[id(p)]] if id(p) in pos else None for p in params]
    return params, used, slot


class LazyPieces(Sequence):
    """Handed to a piecewise tensor as its views during the backward pass: a fresh leaf for each piece the
    field reads, so a vector-Jacobian product is taken with respect to the pieces in force only."""

    def __init__(self, p: PiecewiseParam):
        self.p = p
        self.detached = p.data.detach()
        self.leaves: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.detached.shape[0]

    def __getitem__(self, l):
        leaf = self.leaves.get(l)
        if leaf is None:
            leaf = self.leaves[l] = self.detached[l].requires_grad_()
        return leaf


class Grads:
    """The parameter gradients being accumulated: full tensors and piece by piece."""

    def __init__(self, others: Sequence[torch.Tensor], lazies: Sequence[LazyPieces]):
        self.others = tuple(others)
        self.lazies = list(lazies)
        self.g_others = [torch.zeros_like(p) for p in others]
        self.g_pieces = [torch.zeros_like(v.detached) for v in lazies]

    def fresh(self) -> None:
        for v in self.lazies:
            v.leaves = {}

    def inputs(self) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        keys = [(j, l) for j, v in enumerate(self.lazies) for l in v.leaves]
        return [*self.others, *(self.lazies[j].leaves[l] for j, l in keys)], keys

    def add(self, grads: Sequence[torch.Tensor | None], keys: list[tuple[int, int]]) -> None:
        k = len(self.others)
        for i, g in enumerate(grads[:k]):
            if g is not None:
                self.g_others[i] += g
        for (j, l), g in zip(keys, grads[k:]):
            if g is not None:
                self.g_pieces[j][l] += g

    def result(self, lam: torch.Tensor, slot: Sequence[int | None], gradient: str, nfe: int) -> tuple:
        """The gradients a replay's backward returns for ``(·, y0, ·, *params)``: ``lam`` for ``y0``, then each
        parameter's, whole or assembled from its pieces. A non-finite ``lam`` is named, not passed on."""
        from ..errors import Reason, SolverError

        if not bool(torch.isfinite(lam).all()):
            raise SolverError(
                f"the gradient became non-finite (NaN/inf) in the {gradient} backward pass after {nfe} field "
                "evaluations; lower the learning rate or check the loss.",
                nfe=nfe,
                reason=Reason.NONFINITE_GRADIENT,
            )
        g_o = iter(self.g_others)
        return (None, lam, None, *(next(g_o) if j is None else self.g_pieces[j] for j in slot))
