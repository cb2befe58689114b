r"""The integral controller of torchdiffeq's adaptive solvers (the shared step, one size for the whole batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Controller, Scalar

__all__ = ["Integral"]


@dataclass(frozen=True)
class Integral(Controller):
    r"""``φ(r) = safety · r^(−1/p)`` for a method of order ``p`` (Hairer, Nørsett & Wanner, "Solving Ordinary
    Differential Equations I", §II.4, eq. 4.13), one step size for the whole batch: torchdiffeq 0.2.5's steps, bit
    for bit (``controller="batch"``)."""

    name = "batch"

    def proposal(self, ratio: Scalar, order: int) -> Scalar:
        return self.safety / ratio ** (1.0 / order)

    def proposal_graph(self, ratio: torch.Tensor, order: int) -> torch.Tensor:
        return self.safety * ratio ** (-1.0 / order)
