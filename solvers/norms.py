r"""The error norm of an adaptive step over the engine's flat state.

The functional API flattens a tuple state ``(y_1, ..., y_k)`` into one tensor. torchdiffeq measures such a state's
scaled error ``e`` by the largest of its parts' RMS norms (its ``_mixed_norm``),

    ``‖e‖ = max_i ‖e_i‖_RMS``,    ``‖e_i‖_RMS = √(mean(e_i²))``,

and a tensor state by the RMS over all of it; the step-size control of Hairer, Nørsett & Wanner ("Solving
Ordinary Differential Equations I", §II.4) then accepts a step when ``‖e‖ ≤ 1``. :class:`StateNorm` is that norm
on the flat state, told the parts' sizes: a callable that torchdiffeq's solvers take as ``options["norm"]``, and
whose sizes the fast path (:mod:`solvers.steppers.fast_rk`) reads to compute the same norm without a graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["StateNorm", "safe_sqrt"]


class StateNorm:
    """``max_i RMS(x_i)`` over the parts of sizes ``sizes`` of a flat ``x`` (torchdiffeq's norm of a tuple state);
    with ``sizes=None``, ``RMS(x)`` (its norm of a tensor state)."""

    def __init__(self, sizes: Sequence[int] | None = None):
        self.sizes = None if sizes is None else tuple(int(n) for n in sizes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.sizes is None:
            return _rms(x)
        # the first largest part's norm itself, as Python's max over torchdiffeq's list: its gradient (the initial
        # step's, under backprop) reaches that part only
        return max(_rms(part) for part in x.reshape(-1).split(self.sizes))

    def __repr__(self) -> str:
        return f"StateNorm({'' if self.sizes is None else self.sizes})"


def _rms(x: torch.Tensor) -> torch.Tensor:
    return safe_sqrt(x.abs().pow(2).mean())


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``√x`` with the derivative 0 where ``x = 0`` (the one-sided derivative of an RMS there is infinite, and a
    backward pass that reaches it with a zero cotangent would make ``0 · ∞ = NaN``): the same values as
    ``x.sqrt()``. A zero state or a zero error estimate (a field the method integrates exactly) has an RMS of 0."""
    zero = x == 0  # only there: a NaN stays NaN, so a non-finite state is still seen as one
    return torch.where(zero, torch.zeros_like(x), torch.where(zero, torch.ones_like(x), x).sqrt())
