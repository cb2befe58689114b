r"""Backward sensitivity matrices (BSMs) and their symplectic structure (Galimberti et al., sections III-IV).

- Discrete (H eq. 20): ``Φ_ℓ = ∂y_N/∂y_{N−ℓ}`` for every ``ℓ = 1..N`` of a net ``y_{l+1} = Ψ_l(y_l)``. Vanishing
  gradients are ``‖Φ_ℓ‖₂ → 0`` as ``ℓ`` grows; H2-DNN layers are symplectic (Lemma H4, eq. H33), so
  ``‖Φ_ℓ‖₂ ≥ 1`` at every depth.
- Continuous (Galimberti et al., Lemma 2 and Theorem 1): ``Φ(t) = ∂y(T)/∂y(T−t)`` of ``y' = J ∇H`` preserves
  ``J``: with ``Φ`` the ordinary Jacobian (rows: outputs), ``Φ J Φᵀ = J`` for every skew ``J``; the form
  ``Φᵀ J Φ = J`` is the same statement only when ``J⁻¹ = −J`` (``J² = −I``, e.g. the canonical ``J``).
  ``‖Φ‖₂ ≥ 1``.
- A matrix that is symplectic w.r.t. the canonical ``J = [[0, −I], [I, 0]]`` (which is orthogonal) has singular
  values in reciprocal pairs: sorted decreasingly, ``σ_i σ_{2n+1−i} = 1``.

All Jacobians are per sample, by ``n`` backward passes through a graph of the whole net (the layers must act
on each batch row independently). Matrices are ``(…, batch, n, n)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from .flow import merge_times, solve_segments

if TYPE_CHECKING:
    from cde_nets.blocks.ode import ODEBlock

__all__ = ["discrete_bsm", "continuous_bsm", "symplecticity_defect", "singular_value_pairing"]

Step = Callable[[int, torch.Tensor], torch.Tensor]


def _rows(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``∂out/∂inputs[k]`` per sample for all ``k``: ``(K, batch, n_out, n_in)`` by ``n_out`` backward passes."""
    n = out.shape[1]
    rows = []
    for i in range(n):
        gs = torch.autograd.grad(out[:, i].sum(), list(inputs), retain_graph=i + 1 < n, allow_unused=True)
        rows.append(torch.stack([torch.zeros_like(inputs[0]) if g is None else g for g in gs]))
    return torch.stack(rows, 2).detach()


def _summary(norms: torch.Tensor) -> dict:
    return {"norms": norms, "min": norms.min(1).values, "mean": norms.mean(1), "max": norms.max(1).values}


def _layer(step: Step, l: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Layer ``l`` of ``step(l, y)`` as a callable ``y -> y_{l+1}``."""
    return lambda y: step(l, y)


def discrete_bsm(
    step: Step | Sequence[Callable[[torch.Tensor], torch.Tensor]],
    y0: torch.Tensor,
    layers: int | None = None,
    matrices: bool = False,
) -> dict:
    """``‖∂y_N/∂y_{N−ℓ}‖₂`` for ``ℓ = 1..N`` (H eq. 20).

    Args:
        step: ``step(l, y) -> y_{l+1}`` (give ``layers``), or a sequence of ``N`` layer callables ``y -> y``.
        y0: ``(batch, n)``.
        matrices: also return the matrices ``Phi`` ``(N, batch, n, n)`` (``Phi[ℓ−1] = ∂y_N/∂y_{N−ℓ}``).
    Returns:
        ``ell`` (``1..N``), ``norms`` ``(N, batch)`` and their ``min``/``mean``/``max`` over the batch ``(N,)``.
    """
    fns: list[Callable[[torch.Tensor], torch.Tensor]]
    if callable(step) and not isinstance(step, (nn.ModuleList, list, tuple)):
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"`layers` must be a positive integer when `step` is step(l, y), got {layers!r}.")
        fns = [_layer(step, l) for l in range(layers)]
    else:
        fns = list(step)
        if not fns:
            raise ValueError("`step` is an empty sequence of layers; give at least one layer.")
    if y0.dim() != 2:
        raise ValueError(f"`y0` must be (batch, n), got shape {tuple(y0.shape)}; flatten the state first.")
    with torch.enable_grad():
        states = [y0.detach().requires_grad_(True)]
        for fn in fns:
            states.append(fn(states[-1]))
        Phi = _rows(states[-1], states[:-1]).flip(0)  # Phi[ℓ−1] = ∂y_N/∂y_{N−ℓ}
    out = {"ell": list(range(1, len(fns) + 1)), **_summary(torch.linalg.matrix_norm(Phi, ord=2))}
    if matrices:
        out["Phi"] = Phi
    return out


def continuous_bsm(
    block: ODEBlock,
    y0: torch.Tensor,
    t: torch.Tensor | Sequence[float],
    J: torch.Tensor | None = None,
    matrices: bool = False,
) -> dict:
    """``Φ(t) = ∂y(T)/∂y(T − t)`` for each ``t`` in ``(0, T]`` (Lemma H2), through the block's solver.

    Args:
        block: :class:`~cde_nets.ODEBlock` (method and tolerances are used; tight tolerances approach the
            exact flow's Jacobian).
        y0: ``(batch, n)``; ``t``: backward horizons in ``(0, T]``.
        J: if given, adds ``symplecticity_defect`` ``(K, batch)`` = ``‖Φ J Φᵀ − J‖_F`` (any skew ``J``).
    Returns:
        ``t``, ``norms`` ``(K, batch)`` with ``min``/``mean``/``max`` ``(K,)``, optional ``Phi`` ``(K, batch, n, n)``.
    """
    T = block.T
    t = torch.as_tensor(t, dtype=torch.float64).flatten()
    if len(t) == 0 or bool((t <= 0).any()) or bool((t > T * (1 + 1e-12)).any()):
        raise ValueError(f"`t` must hold horizons in (0, T={T}], got {t.tolist()}.")
    starts = sorted({max(0.0, T - float(s)) for s in t})
    merged, index = merge_times(block.field, sorted(set([0.0, *starts, T])), T)
    pos = {s: index[i] for i, s in enumerate(sorted(set([0.0, *starts, T])))}
    with torch.enable_grad():
        states = solve_segments(block, y0.detach().requires_grad_(True), merged, graph=True)
        want = [pos[max(0.0, T - float(s))] for s in t]
        Phi = _rows(states[-1], [states[k] for k in want])
    out = {"t": t.tolist(), **_summary(torch.linalg.matrix_norm(Phi, ord=2))}
    if J is not None:
        out["symplecticity_defect"] = symplecticity_defect(Phi, J)
    if matrices:
        out["Phi"] = Phi
    return out


def symplecticity_defect(Phi: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
    """``‖Φ J Φᵀ − J‖_F`` for each Jacobian in ``Phi`` ``(…, n, n)`` (rows: outputs); zero iff ``Φ`` preserves the
    Poisson structure ``J`` of ``y' = J ∇H`` (Galimberti et al., Lemma 2). For the canonical ``J`` this equals
    ``‖Φᵀ J Φ − J‖_F``, the usual symplecticity condition."""
    if J.shape[-2:] != Phi.shape[-2:]:
        raise ValueError(f"`J` has shape {tuple(J.shape)}, but Phi's matrices are {tuple(Phi.shape[-2:])}.")
    J = J.to(Phi)
    return torch.linalg.matrix_norm(Phi @ J @ Phi.transpose(-1, -2) - J)


def singular_value_pairing(Phi: torch.Tensor) -> torch.Tensor:
    """``max_i |σ_i σ_{2n+1−i} − 1|`` for each matrix in ``Phi`` ``(…, 2n, 2n)`` (σ sorted decreasingly).

    Zero for matrices symplectic w.r.t. the canonical ``J`` (singular values come in pairs ``σ, 1/σ``).
    """
    m = Phi.shape[-1]
    if m % 2 or Phi.shape[-2] != m:
        raise ValueError(f"`Phi` must hold square matrices of even size, got {tuple(Phi.shape[-2:])}.")
    s = torch.linalg.svdvals(Phi)
    prod = s[..., : m // 2] * s[..., m // 2 :].flip(-1)
    return (prod - 1).abs().amax(-1)
