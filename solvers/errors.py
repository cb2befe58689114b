"""Exceptions raised by the numerical layer. Every message names the argument at fault and a fix."""

from __future__ import annotations

import math

import torch

__all__ = ["SolverError", "check_finite", "check_positive"]


class SolverError(RuntimeError):
    """The solver could not finish: step-size underflow, max steps reached, or a non-finite state.

    ``nfe`` holds the number of field evaluations made before it gave up.
    """

    def __init__(self, message: str, nfe: int | None = None):
        super().__init__(message)
        self.nfe = nfe


def check_positive(name: str, value: float, fix: str = "") -> float:
    """Raise ``ValueError`` unless ``value`` is a finite number > 0."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` must be a positive number, got {value!r}.") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.{(' ' + fix) if fix else ''}")
    return v


def check_finite(name: str, y: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``y`` holds NaN or inf, naming how many entries and the first bad sample."""
    bad = ~torch.isfinite(y)
    if bad.any():
        n = int(bad.sum())
        first = int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0]) if y.dim() > 0 else 0
        raise ValueError(
            f"`{name}` holds {n} non-finite value(s) (NaN or inf), first in sample {first}; "
            "clean the input or lower the learning rate if it came from training."
        )
