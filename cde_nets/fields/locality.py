"""Block sparsity of the distributed H-DNN (Galimberti et al., Theorem H2, Prop. H2).

The state ``y`` is split into ``M`` node blocks. ``K ∈ BlkSprs(R)`` and ``J ∈ BlkSprs(T)`` (``T`` symmetric,
``T, R >= I``); forward and backward passes need only neighbours of the communication graph ``S`` when the
binary product ``T Rᵀ R + Rᵀ R T <= S`` holds entrywise (eq. H32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LocalityError", "block_mask", "locality_violations", "check_locality"]


class LocalityError(ValueError):
    """A sparsity pattern needs communication that the graph ``S`` does not allow."""


def _binary(name: str, A, M: int | None = None) -> torch.Tensor:
    A = torch.as_tensor(A)
    if A.dim() != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"`{name}` must be a square M x M 0/1 matrix, got shape {tuple(A.shape)}.")
    if M is not None and A.shape[0] != M:
        raise ValueError(f"`{name}` is {A.shape[0]} x {A.shape[0]} but the other patterns are {M} x {M}.")
    if not bool(((A == 0) | (A == 1)).all()):
        raise ValueError(f"`{name}` must hold only 0 and 1.")
    return A.to(torch.int64)


def block_mask(pattern, sizes: Sequence[int], cols: Sequence[int] | None = None) -> torch.Tensor:
    """Expand an ``M x M`` 0/1 node pattern to a dense mask with row blocks ``sizes`` and column blocks ``cols``."""
    P = torch.as_tensor(pattern).to(torch.get_default_dtype())
    cols = sizes if cols is None else cols
    if P.shape != (len(sizes), len(cols)):
        raise ValueError(f"`pattern` is {tuple(P.shape)} but {len(sizes)} x {len(cols)} node blocks were given.")
    return torch.repeat_interleave(
        torch.repeat_interleave(P, torch.tensor(list(sizes)), 0), torch.tensor(list(cols)), 1
    )


def locality_violations(R, T, S) -> list[tuple[int, int]]:
    """Node pairs ``(i, j)`` (1-based, ``i < j``) where ``T RᵀR + RᵀR T`` is non-zero but ``S`` is zero."""
    S_ = _binary("S", S)
    M = S_.shape[0]
    R_, T_ = _binary("R", R, M), _binary("T", T, M)
    if not torch.equal(T_, T_.T) or not torch.equal(S_, S_.T):
        raise ValueError("`T` and `S` must be symmetric (J is skew-symmetric; communication is two-way).")
    RtR = (R_.T @ R_) > 0
    need = ((T_ @ RtR.to(torch.int64)) > 0) | ((RtR.to(torch.int64) @ T_) > 0)
    bad = need & (S_ == 0)
    return [(i + 1, j + 1) for i, j in bad.nonzero().tolist() if i < j]


def check_locality(R, T, S, where: str = "") -> None:
    """Raise :class:`LocalityError` naming the node pairs whose exchange ``S`` forbids (condition H32)."""
    bad = locality_violations(R, T, S)
    if bad:
        pairs = ", ".join(f"({i}, {j})" for i, j in bad)
        raise LocalityError(
            f"sparsity violates T RᵀR + RᵀR T <= S{(' ' + where) if where else ''}: nodes {pairs} (1-based) "
            "would have to "
            "exchange information but are not neighbours in S; zero the K blocks that couple them (R) or the J "
            "blocks (T), or add the edges to S."
        )
