r"""Image densities with a flow: dequantised pixels, the preprocessing before the flow, bits per dimension.

Pixels take ``L`` levels ``k ∈ {0, …, L − 1}``; uniform dequantisation ``y = (k + u)/L``, ``u ~ U[0, 1)^d``
(:func:`cde_nets.datasets.dequantize`; Theis et al. 2016) gives data on ``[0, 1)^d``, and a density ``p(y)`` there
bounds the discrete model's ``−log₂ P(k)/d`` by ``(−log p(y)/d + log L)/log 2`` bits per dimension (Theis et al.
2016, eq. 10; :func:`cde_nets.flows.bits_per_dim`). The flow models ``x = g(y)`` after a preprocessing ``g``, so
by the change of variables

    log p(y) = log p_flow(g(y)) + log |det ∂g/∂y|,

with ``g`` one of (FFJORD, Grathwohl et al. 2019, §5, after RealNVP, Dinh et al. 2017, §4.1):

- :class:`Logit`: ``x = logit(α + (1 − 2α) y)``, ``log |det ∂g/∂y| = Σ_i [log(1 − 2α) − log s_i − log(1 − s_i)]``
  with ``s = α + (1 − 2α) y``;
- :class:`Affine`: ``x = a (y − ½)``, ``log |det ∂g/∂y| = d log a``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cde_nets.flows import bits_per_dim

__all__ = ["Logit", "Affine", "image_bits_per_dim"]


@dataclass(frozen=True)
class Logit:
    """``x = logit(α + (1 − 2α) y)`` on ``y ∈ [0, 1)^d``: ``α`` keeps the pixels at 0 off ``−∞``."""

    alpha: float = 0.05

    def __post_init__(self) -> None:
        if not 0 <= self.alpha < 0.5:
            raise ValueError(f"`alpha` must lie in [0, 0.5) (FFJORD: 1e-6, RealNVP: 0.05), got {self.alpha!r}.")

    def __call__(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, log |det ∂x/∂y|)``: ``x`` shaped like ``y``, the log-determinant per sample ``(batch,)``."""
        s = self.alpha + (1 - 2 * self.alpha) * y
        log_s, log_1ms = torch.log(s), torch.log1p(-s)
        logdet = (math.log1p(-2 * self.alpha) - log_s - log_1ms).flatten(1).sum(1)
        return log_s - log_1ms, logdet


@dataclass(frozen=True)
class Affine:
    """``x = a (y − ½)``: centred pixels, scaled by ``a``."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"`scale` must be a positive number, got {self.scale!r}.")

    def __call__(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.scale * (y - 0.5)
        return x, x.new_full((x.shape[0],), y[0].numel() * math.log(self.scale))


def image_bits_per_dim(log_prob_x: torch.Tensor, logdet: torch.Tensor, dim: int, levels: int) -> torch.Tensor:
    """Bits per dimension of the dequantised pixels per sample, from the flow's ``log p(x)`` and the
    preprocessing's ``log |det ∂x/∂y|``: ``(−(log p(x) + logdet)/d + log L)/log 2``."""
    return bits_per_dim(log_prob_x + logdet, dim, levels)
