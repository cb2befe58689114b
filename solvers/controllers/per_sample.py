r"""Per-sample control: every sample of a batch on its own step size (the loop: :mod:`solvers.per_sample`)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Controller, Scalar

__all__ = ["PerSample"]


@dataclass(frozen=True)
class PerSample(Controller):
    r"""Each sample's step by a proportional-integral controller on its own error sequence (Gustafsson 1991,
    "Control theoretic techniques for stepsize selection in explicit Runge-Kutta methods"; the vectorised rule
    and its constants are :mod:`solvers.per_sample.control`'s), finished samples leaving the batch
    (``controller="per_sample"``; ``dopri5``, ``bosh3`` and ``tsit5``)."""

    name = "per_sample"
    per_sample = True

    def proposal(self, ratio: Scalar, order: int) -> Scalar:
        # the integral part alone; the loop applies the whole filter to every sample at once
        return self.safety / ratio ** (1.0 / order)
