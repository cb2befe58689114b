"""Activations by name, with their antiderivatives (the Hamiltonian's ``σ̃`` with ``σ̃' = σ``, Galimberti et al. eq.
H5)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "ANTIDERIVATIVES", "DERIVATIVES", "resolve_activation"]

_LOG2 = math.log(2.0)


def _log_cosh(z: torch.Tensor) -> torch.Tensor:
    # log cosh z = |z| + log(1 + e^{-2|z|}) - log 2, stable for large |z|.
    a = z.abs()
    return a + torch.log1p(torch.exp(-2.0 * a)) - _LOG2


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "softplus": F.softplus,
    "identity": lambda z: z,
}

ANTIDERIVATIVES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": _log_cosh,
    "sigmoid": F.softplus,
    "relu": lambda z: 0.5 * torch.relu(z) ** 2,
    "identity": lambda z: 0.5 * z * z,
}

DERIVATIVES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": lambda z: 1.0 - torch.tanh(z) ** 2,
    "sigmoid": lambda z: torch.sigmoid(z) * (1.0 - torch.sigmoid(z)),
    "relu": lambda z: (z > 0).to(z.dtype),
    "softplus": torch.sigmoid,
    "identity": torch.ones_like,
}


def resolve_activation(activation: str | Callable[[torch.Tensor], torch.Tensor]) -> tuple[str, Callable]:
    """``(name, function)`` for a name in :data:`ACTIVATIONS` or a callable (name ``"custom"``)."""
    if callable(activation):
        return getattr(activation, "__name__", "custom"), activation
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"`activation` {activation!r} is unknown; use one of {sorted(ACTIVATIONS)} or pass a callable."
        )
    return activation, ACTIVATIONS[activation]
