r"""The Kepler problem, a reference field for conservation studies: ``q'' = −q / |q|³`` in the plane.

``H(p, q) = |p|² / 2 − 1 / |q|`` on ``y = (p, q)`` (momenta first, as the Hamiltonian fields hold them), so
``p' = −q / |q|³`` (from ``q`` alone) and ``q' = p`` (from ``p`` alone): separable, and the splitting methods apply.
Its rotation symmetry gives, by Noether's theorem, the angular momentum ``L = q_1 p_2 − q_2 p_1`` as a second
invariant; a quadratic one, so the Gauss methods keep it to rounding (Hairer, Lubich & Wanner 2006, §I.2.3, §IV.2).
The orbit from ``q = (1 − e, 0)``, ``p = (0, √((1 + e)/(1 − e)))`` has period ``2π`` and a closed form
(:func:`kepler_orbit`; HLW §I.2.3).
"""

from __future__ import annotations

import math

import torch

from .base import Field

__all__ = ["Kepler", "kepler_orbit"]


class Kepler(Field):
    """``p' = −q / |q|³``, ``q' = p`` on ``y = (p_1, p_2, q_1, q_2)``; no parameters. ``T`` defaults to one period
    (``2π``)."""

    hamiltonian = True
    separable = True
    kind = "kepler"

    def __init__(self, T: float = 2 * math.pi):
        super().__init__(T=T, layers=1)
        self.state_shape = (4,)
        self.split = (2, 2)

    def evaluate(self, l: int, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.evaluate_half(l, y[..., 2:], 0), y[..., :2]], -1)

    def evaluate_part(self, l: int, y: torch.Tensor, part: int) -> torch.Tensor:
        return self.evaluate_half(l, y[..., 2:] if part == 0 else y[..., :2], part)

    def evaluate_half(self, l: int, z: torch.Tensor, part: int) -> torch.Tensor:
        if part == 1:
            return z
        r2 = (z * z).sum(-1, keepdim=True)
        return -z / (r2 * r2.sqrt())

    def energy(self, t: float | torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``H = |p|²/2 − 1/|q|`` per sample, ``(batch,)``."""
        p, q = y[..., :2], y[..., 2:]
        return 0.5 * (p * p).sum(-1) - 1.0 / q.norm(dim=-1)

    def angular_momentum(self, t: float | torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``L = q_1 p_2 − q_2 p_1`` per sample, ``(batch,)``."""
        return y[..., 2] * y[..., 1] - y[..., 3] * y[..., 0]


def kepler_orbit(t: float, e: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The exact state ``(p, q)`` at ``t`` of the orbit of eccentricity ``e`` from ``q = (1 − e, 0)`` (HLW §I.2.3):
    the eccentric anomaly ``E`` solves Kepler's equation ``E − e sin E = t`` (Newton, to rounding), then
    ``q = (cos E − e, √(1 − e²) sin E)``, ``p = (−sin E, √(1 − e²) cos E) / (1 − e cos E)``."""
    if not 0 <= e < 1:
        raise ValueError(f"`e` must be an eccentricity in [0, 1) (a bound orbit), got {e!r}.")
    E = t if e < 0.8 else math.pi
    for _ in range(100):
        step = (E - e * math.sin(E) - t) / (1 - e * math.cos(E))
        E -= step
        if abs(step) < 1e-16 * max(1.0, abs(E)):
            break
    s, c, w = math.sin(E), math.cos(E), math.sqrt(1 - e * e)
    d = 1 - e * c
    return torch.tensor([-s / d, w * c / d, c - e, w * s], dtype=dtype)
