"""Schemes that carry lags: Hauser's C^k and dense k-lag networks, the two-step LM-ResNet."""

from __future__ import annotations

import torch

from ..errors import check_positive_int
from .base import Scheme, axpy, dense_matrix

__all__ = ["CK", "Dense", "LM2"]


def _check_k(k: int | None, default: int, name: str) -> int:
    if k is None:
        return default
    check_positive_int("k", k, "the lags of {name!r}")
    return k


class CK(Scheme):
    """Hauser's C^k network (eq. S7): ``q_n' = Σ_{n' >= n} q_{n'} + F(q_1) h^k`` on ``q_n = (δ⁻)^{n−1} x``;
    ``k = 1`` is forward Euler's ResNet block."""

    name, state, equation = "ck", "lags", "S7"
    description = "C^k finite differences: q_n' = Σ_{n'>=n} q_{n'} + F(q_1) h^k"

    def __init__(self, k: int | None = None):
        self.lags = _check_k(k, 2, "ck")

    def options(self):
        return {"k": self.lags}

    def init(self, y0):
        return (y0,) + tuple(torch.zeros_like(y0) for _ in range(self.lags - 1))

    def step(self, f, l, state, h, coef=None, t=None):
        drive = f.evaluate(l, state[0], t=l * h if t is None else t) * h**self.lags
        tails = [state[-1]]
        for q in reversed(state[:-1]):  # suffix sums: q_n' = Σ_{n' >= n} q_{n'} + σ(q_1) h^k
            tails.append(tails[-1] + q)
        return tuple(s + drive for s in reversed(tails))


class Dense(CK):
    """Hauser's dense ``k``-lag network (DenseNet state space, eq. S22): ``q' = q + M s h``, ``s_i = σ^{(l−i)}`` of
    the lag ``x^{(l−i)} = Σ_j M[i, j] q_{j+1}`` (absent before layer 0), ``M`` of :func:`dense_matrix`."""

    name, equation, description = "dense", "S22", "dense k-lag (DenseNet state space): q' = q + M s h"

    def __init__(self, k: int | None = None):
        self.lags = _check_k(k, 3, "dense")
        self._M = dense_matrix(self.lags).tolist()

    def evaluations(self, l):
        return min(l + 1, self.lags)

    def step(self, f, l, state, h, coef=None, t=None):
        M, k = self._M, self.lags
        t0 = l * h if t is None else t
        s: list[torch.Tensor | None] = []
        for i in range(k):
            if l - i < 0:
                s.append(None)
                continue
            x_lag = state[0]
            for j in range(1, i + 1):
                x_lag = x_lag + M[i][j] * state[j]
            s.append(f.evaluate(l - i, x_lag, t=t0 - i * h) * h)
        out = []
        for n in range(k):
            upd = state[n]
            for i in range(n + 1):
                if s[i] is not None and M[n][i]:
                    upd = upd + M[n][i] * s[i]
            out.append(upd)
        return tuple(out)


class LM2(Scheme):
    """Two-step linear multistep with learnable ``k_l`` (Ruseckas eq. R111, LM-ResNet's structure):
    ``x_{l+1} = (1 − k_l) x_l + k_l x_{l−1} + h F_l(x_l)``, ``x_{−1} = x_0`` (the first step is forward Euler).
    ``k0``: the initial ``k_l`` (default 0: a ResNet).

    Invertible while every ``k_l ≠ 0`` (state ``(x_{l+1}, x_l)``):
    ``x_{l−1} = (x_{l+1} − (1 − k_l) x_l − h F_l(x_l)) / k_l``. Run backwards, the recurrence's parasitic root is
    ``−1/k_l`` (``−k_l`` forwards), so rounding grows like ``∏ 1/|k_l|``; ``k0=1.0`` gives
    ``x_{l+1} = x_{l−1} + h F_l(x_l)``, a leapfrog whose inverse is the same recurrence (no growth)."""

    name, state, equation, lags = "lm2", "lags", "R111", 2
    description = "two-step LM: x' = (1 − k_l) x + k_l x_prev + h F(x)"
    coefficients = ("k_lm",)
    invertible = True

    def __init__(self, k0: float = 0.0):
        self.k0 = float(k0)

    def options(self):
        return {"k0": self.k0} if self.k0 else {}

    def coefficient_init(self, L, channels):
        return {"k_lm": torch.full((L,), self.k0)}

    def coefficient_values(self, params, h, ndim):
        return {"k": params["k_lm"]}

    def init(self, y0):
        return (y0, y0)

    def step(self, f, l, state, h, coef=None, t=None):
        x, x_prev = state
        F = f.evaluate(l, x, t=l * h if t is None else t)
        if l == 0:
            return (axpy(x, h, F), x)
        kl = coef["k"][l]
        return (axpy((1 - kl) * x + kl * x_prev, h, F), x)

    def check_invertible(self, field):
        if self.k0 == 0:
            raise ValueError(
                "`memory_free=True` inverts lm2 by dividing by k_l, and k_l starts at 0 (a ResNet); pass the "
                "scheme with a non-zero start, e.g. `discretize(field, LM2(k0=1.0), memory_free=True)` (the "
                "leapfrog two-step, whose rounding does not grow), or drop `memory_free`."
            )

    def check_inverse(self, coef):
        k = coef["k"][1:]  # layer 0 is forward Euler from (x_0, x_0): its input is still in the state
        if bool((k == 0).any()):
            l = 1 + int((k == 0).nonzero()[0])
            raise ValueError(
                f"lm2 with `memory_free=True` divides by k_l, but k_{l} = 0; keep the `k_lm` coefficients away "
                "from 0 (e.g. re-initialise them at 1.0), or train this net with `memory_free=False`."
            )

    def inverse(self, f, l, state, h, coef=None, t=None):
        x1, x = state
        if l == 0:
            return (x, x)
        kl = coef["k"][l]
        F = f.evaluate(l, x, t=l * h if t is None else t)
        return (x, (x1 - (1 - kl) * x - h * F) / kl)
