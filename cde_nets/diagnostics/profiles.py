r"""Depth profiles of a net's states (blog B §8, Hauser S §4.3).

Given layer states ``x_0 .. x_L`` (each ``(batch, …)``, flattened per sample):

- ``‖x_l‖`` per layer (batch mean);
- ``cossim(v_l, v_{l+1})`` of successive updates ``v_{l+1} = x_{l+1} − x_l`` (a second-order model's velocity),
  to set against ``cossim(u_l, u_{l+1})`` of a first-order model's updates: momentum makes successive updates
  align (B §8);
- per-layer gradient norms ``‖∂L/∂x_l‖`` (through the states) and ``‖∂L/∂θ_l‖`` (per parameter piece);
- the perturbation ratio ``mean_{l, b} ‖x_{l+1} − x_l‖ / ‖x_l‖`` (S §4.3: 0.0389 for a C^k net, 1.31 for a
  20-layer C⁰ net).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from cde_nets.fields.pieces import piece_modules

__all__ = [
    "norm_profile",
    "cosine_profile",
    "perturbation_ratio",
    "state_gradient_norms",
    "piece_gradient_norms",
    "depth_profile",
]


def _flat(states: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    states = list(states)
    if len(states) < 2:
        raise ValueError(f"`states` must hold at least two layer states, got {len(states)}.")
    return torch.stack([s.detach().flatten(1) for s in states])


def norm_profile(states: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Batch mean of ``‖x_l‖`` for each layer: ``(L + 1,)``."""
    return _flat(states).norm(dim=-1).mean(-1)


def cosine_profile(seq: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Batch mean of ``cossim(s_l, s_{l+1})`` for a sequence ``s_0 .. s_K`` (velocities or updates): ``(K,)``."""
    s = _flat(seq)
    return torch.nn.functional.cosine_similarity(s[:-1], s[1:], dim=-1).mean(-1)


def perturbation_ratio(states: Sequence[torch.Tensor] | torch.Tensor) -> float:
    """``mean_{l, b} ‖x_{l+1} − x_l‖ / ‖x_l‖`` (Hauser S §4.3)."""
    x = _flat(states)
    return float(((x[1:] - x[:-1]).norm(dim=-1) / x[:-1].norm(dim=-1).clamp_min(1e-300)).mean())


def state_gradient_norms(loss: torch.Tensor, states: Sequence[torch.Tensor]) -> torch.Tensor:
    """Batch mean of ``‖∂loss/∂x_l‖`` per layer; ``states`` must be in ``loss``'s graph: ``(L + 1,)``."""
    grads = torch.autograd.grad(loss, list(states), retain_graph=True, allow_unused=True)
    like = states[0]
    return torch.stack([like.new_zeros(()) if g is None else g.detach().flatten(1).norm(dim=-1).mean() for g in grads])


def piece_gradient_norms(module: nn.Module) -> torch.Tensor:
    """``‖∂L/∂θ_l‖`` over all trainable :class:`~cde_nets.fields.pieces.Pieces` of ``module`` per piece ``l``: ``(L,)``.

    Call after ``loss.backward()``; pieces without a gradient count as zero.
    """
    sq = None
    for p in piece_modules(module):
        g = p.data.grad
        if g is None:
            continue
        v = g.detach().flatten(1).pow(2).sum(1)
        sq = v if sq is None else sq + v
    if sq is None:
        raise ValueError("no Pieces parameter of `module` has a gradient; call loss.backward() first.")
    return sq.sqrt()


def depth_profile(states: Sequence[torch.Tensor], loss: torch.Tensor | None = None) -> dict:
    """All state profiles in one dict: ``norms``, ``update_cosine`` (of ``x_{l+1} − x_l``),
    ``perturbation_ratio`` and, if ``loss`` is given (states in its graph), ``grad_norms``."""
    x = _flat(states)
    out = {
        "norms": norm_profile(x),
        "update_cosine": cosine_profile(x[1:] - x[:-1]) if len(x) > 2 else None,
        "perturbation_ratio": perturbation_ratio(x),
    }
    if loss is not None:
        out["grad_norms"] = state_gradient_norms(loss, states)
    return out
