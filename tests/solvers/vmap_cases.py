"""What the torch.func test files share: the relative comparison and the ensemble member's MLP field."""

from __future__ import annotations

import torch
from torch import nn


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-7) -> None:
    """``max|a − b| ≤ rel · max|b|``."""
    err, scale = float((a - b).detach().abs().max()), float(b.detach().abs().max())
    assert err <= rel * scale, err / scale


class MLP(nn.Module):
    """A member field ``d → h → d`` (tanh), autonomous."""

    def __init__(self, d: int = 2, h: int = 8):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(y)))
