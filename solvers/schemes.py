"""Discrete schemes: one step per parameter piece; each scheme *is* a layer architecture (SPEC §6).

A scheme acts on a field through ``field.evaluate(l, y)`` (``F`` with the parameters of piece ``l``) and, for
split schemes, ``field.evaluate_part(l, y, part)`` (the ``p``-block, ``part=0``, or ``q``-block, ``part=1``).
Multi-component states (momentum's ``(x, v)``, the ``k`` lags of C^k and dense nets, the two-step method's
``(x_l, x_{l−1})``) are stacked along axis 1 (features or channels), so images work as well as vectors.
This module never imports ``cde_nets``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["Tableau", "Scheme", "SCHEMES", "get_scheme", "dense_matrix"]


@dataclass(frozen=True)
class Tableau:
    """An explicit Butcher tableau; checks itself (rows of ``a`` sum to ``c``, weights ``b`` sum to 1)."""

    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    c: tuple[float, ...]

    def __post_init__(self) -> None:
        s = len(self.b)
        if len(self.a) != s or len(self.c) != s:
            raise ValueError("tableau: a, b, c must describe the same number of stages")
        for i, (row, ci) in enumerate(zip(self.a, self.c)):
            if len(row) != i:
                raise ValueError(f"tableau: explicit row {i} must have {i} entries")
            if abs(sum(row) - ci) > 1e-14:
                raise ValueError(f"tableau: row {i} of a sums to {sum(row)}, not c = {ci}")
        if abs(sum(self.b) - 1.0) > 1e-14:
            raise ValueError("tableau: weights b must sum to 1")


MIDPOINT = Tableau(a=((), (0.5,)), b=(0.0, 1.0), c=(0.0, 0.5))
RK4 = Tableau(a=((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)), b=(1 / 6, 1 / 3, 1 / 3, 1 / 6), c=(0.0, 0.5, 0.5, 1.0))


def dense_matrix(k: int) -> torch.Tensor:
    """``M[n, i] = (−1)^i C(n, i)`` (0-based, ``i <= n``): backward differences ↔ lags, its own inverse (eq. S21)."""
    M = torch.zeros(k, k, dtype=torch.float64)
    for n in range(k):
        for i in range(n + 1):
            M[n, i] = (-1) ** i * math.comb(n, i)
    return M


@dataclass(frozen=True)
class Scheme:
    """A discrete scheme: its convergence ``order``, the state it ``needs`` and where it comes from.

    ``needs``: ``"plain"`` (the field's state), ``"split"`` (a ``(p, q)`` split), ``"velocity"`` (adds a velocity
    ``v``), ``"lags"`` (adds ``k − 1`` backward differences or lagged states). ``params`` names the per-layer
    trainable coefficients the scheme owns (``discretize`` creates them).
    """

    name: str
    order: int
    needs: str
    equation: str
    description: str
    tableau: Tableau | None = None
    part_order: tuple[int, ...] = ()
    params: tuple[str, ...] = ()
    lags: int = 1
    extra: dict = field(default_factory=dict, compare=False)

    # -- state layout ---------------------------------------------------------------------------------
    def components(self, k: int | None = None) -> int:
        """How many copies of the field's state the scheme's state stacks along axis 1."""
        if self.needs == "velocity":
            return 2
        if self.needs == "lags":
            return k or self.lags
        return 1

    def init_state(self, y0: torch.Tensor, k: int | None = None) -> torch.Tensor:
        n = self.components(k)
        if n == 1:
            return y0
        if self.name == "lm2":  # (x_0, x_{-1}) with x_{-1} = x_0: the first step is forward Euler
            return torch.cat([y0, y0], 1)
        return torch.cat([y0] + [torch.zeros_like(y0)] * (n - 1), 1)

    def readout(self, state: torch.Tensor, k: int | None = None) -> torch.Tensor:
        n = self.components(k)
        return state if n == 1 else state.chunk(n, 1)[0]

    # -- one step ---------------------------------------------------------------------------------------
    def step(self, f, l: int, y: torch.Tensor, h: float, coef: dict | None = None, k: int | None = None,
             split: tuple[int, int] | None = None, history: list | None = None) -> torch.Tensor:
        """Advance the scheme state ``y`` by one layer using piece ``l`` of field ``f`` with step ``h``."""
        return _STEPS[self.name](self, f, l, y, h, coef or {}, k or self.lags, split, history)


def _rk(scheme, f, l, y, h, coef, k, split, history):
    tab = scheme.tableau
    ks: list[torch.Tensor] = []
    for row in tab.a:
        yi = y
        for aij, kj in zip(row, ks):
            if aij:
                yi = yi + (h * aij) * kj
        ks.append(f.evaluate(l, yi))
    out = y
    for bi, ki in zip(tab.b, ks):
        if bi:
            out = out + (h * bi) * ki
    return out


def _euler(scheme, f, l, y, h, coef, k, split, history):
    return y + h * f.evaluate(l, y)


def _part(f, l, y, part, split):
    if split is None:
        return f.evaluate_part(l, y, part)
    full = f.evaluate(l, y)
    return full[:, : split[0]] if part == 0 else full[:, split[0]:]


def _semi_implicit(scheme, f, l, y, h, coef, k, split, history):
    n_p = (split or f.split)[0]
    p, q = y[:, :n_p], y[:, n_p:]
    for part in scheme.part_order:
        if part == 0:
            p = p + h * _part(f, l, torch.cat([p, q], 1), 0, split)
        else:
            q = q + h * _part(f, l, torch.cat([p, q], 1), 1, split)
    return torch.cat([p, q], 1)


def _verlet(scheme, f, l, y, h, coef, k, split, history):
    n_p = (split or f.split)[0]
    p, q = y[:, :n_p], y[:, n_p:]
    p = p + (0.5 * h) * _part(f, l, torch.cat([p, q], 1), 0, split)
    q = q + h * _part(f, l, torch.cat([p, q], 1), 1, split)
    p = p + (0.5 * h) * _part(f, l, torch.cat([p, q], 1), 0, split)
    return torch.cat([p, q], 1)


def _channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over axis 1 of ``like``."""
    return v.reshape(1, -1, *([1] * (like.dim() - 2)))


def _momentum(scheme, f, l, y, h, coef, k, split, history):
    x, v = y.chunk(2, 1)
    m = _channel(torch.sigmoid(coef["a"][l]), x)
    eta = _channel(1 - torch.sigmoid(coef["a"][l]) if coef.get("tie") else F.softplus(coef["b"][l]), x)
    v = m * v + eta * h * f.evaluate(l, x)
    return torch.cat([x + v, v], 1)


def _ck(scheme, f, l, y, h, coef, k, split, history):
    qs = y.chunk(k, 1)
    drive = f.evaluate(l, qs[0]) * h**k
    tails = [qs[-1]]
    for q in reversed(qs[:-1]):  # suffix sums: q_n' = Σ_{n' >= n} q_{n'} + σ(q_1) h^k
        tails.append(tails[-1] + q)
    return torch.cat([t + drive for t in reversed(tails)], 1)


def _dense(scheme, f, l, y, h, coef, k, split, history):
    qs = y.chunk(k, 1)
    M = dense_matrix(k).tolist()
    s = []
    for i in range(k):  # s_i = σ^{(l−i)}(x^{(l−i)}), x^{(l−i)} = Σ_j M[i][j] q_{j+1}; absent before layer 0
        if l - i < 0:
            s.append(None)
            continue
        x_lag = qs[0]
        for j in range(1, i + 1):
            x_lag = x_lag + M[i][j] * qs[j]
        s.append(f.evaluate(l - i, x_lag) * h)
    out = []
    for n in range(k):
        upd = qs[n]
        for i in range(n + 1):
            if s[i] is not None and M[n][i]:
                upd = upd + M[n][i] * s[i]
        out.append(upd)
    return torch.cat(out, 1)


def _lm2(scheme, f, l, y, h, coef, k, split, history):
    x, x_prev = y.chunk(2, 1)
    kl = coef["k"][l] if l > 0 else 0.0  # no x_{-1} before the first layer: forward Euler
    x_new = (1 - kl) * x + kl * x_prev + h * f.evaluate(l, x)
    return torch.cat([x_new, x], 1)


_STEPS = {
    "euler": _euler, "midpoint": _rk, "rk4": _rk, "symplectic_euler": _semi_implicit,
    "symplectic_euler_qp": _semi_implicit, "verlet": _verlet, "momentum": _momentum, "ck": _ck,
    "dense": _dense, "lm2": _lm2,
}

SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("euler", 1, "plain", "H9, R109, N3", "forward Euler: y + h F(y)"),
    Scheme("midpoint", 2, "plain", "—", "explicit midpoint (RK2)", tableau=MIDPOINT),
    Scheme("rk4", 4, "plain", "—", "classical Runge-Kutta", tableau=RK4),
    Scheme("symplectic_euler", 1, "split", "H12-13",
           "semi-implicit Euler, p first: p' = p + h F_p(p, q), q' = q + h F_q(p', q)", part_order=(0, 1)),
    Scheme("symplectic_euler_qp", 1, "split", "H-App. I (MS1)",
           "semi-implicit Euler, q first: q' = q + h F_q(p, q), p' = p + h F_p(p, q')", part_order=(1, 0)),
    Scheme("verlet", 2, "split", "—", "Störmer-Verlet / leapfrog (p half step, q step, p half step)"),
    Scheme("momentum", 1, "velocity", "B §8",
           "heavy ball: v' = m v + η h F(x), x' = x + v' (m = sigmoid(a_l), η = softplus(b_l))", params=("a", "b")),
    Scheme("ck", 1, "lags", "S7", "C^k finite differences: q_n' = Σ_{n'>=n} q_{n'} + F(q_1) h^k", lags=2),
    Scheme("dense", 1, "lags", "S22", "dense k-lag (DenseNet state space): q' = q + M s h", lags=3),
    Scheme("lm2", 1, "lags", "R111", "two-step LM: x' = (1 − k_l) x + k_l x_prev + h F(x)", params=("k",), lags=2),
)}


def get_scheme(scheme: str | Scheme) -> Scheme:
    """The scheme object for a name (or the object itself); unknown names list the valid ones."""
    if isinstance(scheme, Scheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {', '.join(SCHEMES)}.")
    return SCHEMES[scheme]
