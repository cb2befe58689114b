"""Discrete schemes: one step per parameter piece; each scheme *is* a layer architecture (SPEC §6).

A scheme acts on a field through ``field.evaluate(l, y)`` (``F`` with the parameters of piece ``l``) and, for
split schemes, ``field.evaluate_part(l, y, part)`` (the ``p``-block, ``part=0``, or ``q``-block, ``part=1``).
A scheme's state is a tuple of tensors: ``(y,)``, split schemes' ``(p, q)``, momentum's ``(x, v)``, the ``k``
differences of C^k and dense nets, the two-step method's ``(x_l, x_{l−1})``; no packing per layer. Separable
fields (``field.separable``) give one half's derivative from the other half alone (``evaluate_half``).
This module never imports ``cde_nets``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .architectures import architecture

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

    def architecture(self, field_kind="any") -> tuple[str, str]:
        """``(name, paper equation)`` of the network this scheme makes on a field of ``field_kind`` (SPEC §6)."""
        return architecture(self.name, field_kind)

    def for_field(self, order: int) -> Scheme:
        """The scheme as it runs on a field of ``order``: momentum on an order-2 field ``(x, v)`` uses the field's
        own velocity instead of adding one.

        Such a field (``x' = v``, ``v' = −γ v + η f(x)``, SPEC §3) already carries the heavy ball's state, so the
        step is velocity first, then position: ``v_{l+1} = v_l + h(−γ v_l + η f_l(x_l))``,
        ``x_{l+1} = x_l + h v_{l+1}``. With ``ṽ = h v`` this is exactly the momentum update
        ``ṽ_{l+1} = m ṽ_l + η_B h f_l(x_l)``, ``x_{l+1} = x_l + ṽ_{l+1}`` with ``m = 1 − hγ``, ``η_B = hη`` (B §8):
        the field's ``γ, η`` play the scheme's ``m, η``, so no extra coefficients are created.
        """
        if self.needs == "velocity" and order == 2:
            return replace(self, needs="split", part_order=(1, 0), params=())
        return self

    # -- state layout ---------------------------------------------------------------------------------
    def components(self, k: int | None = None) -> int:
        """How many tensors of the field's state shape the scheme's state holds."""
        if self.needs == "velocity":
            return 2
        if self.needs == "lags":
            return k or self.lags
        return 1

    def init_state(self, y0: torch.Tensor, k: int | None = None, n_p: int | None = None) -> tuple[torch.Tensor, ...]:
        """The scheme state for input ``y0``: ``(y,)``, ``(p, q)`` (split at ``n_p``), ``(x, v = 0)``,
        ``(q_1 = x, 0, ..)`` or ``(x, x_{-1} = x)``."""
        if self.needs == "split":
            return (y0[:, :n_p], y0[:, n_p:])
        if self.name == "lm2":  # x_{-1} = x_0: the first step is forward Euler
            return (y0, y0)
        return (y0,) + tuple(torch.zeros_like(y0) for _ in range(self.components(k) - 1))

    def readout(self, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The field-shaped state ``y`` of a scheme state."""
        return torch.cat(state, 1) if self.needs == "split" else state[0]

    # -- one step ---------------------------------------------------------------------------------------
    def step(self, f, l: int, state: tuple[torch.Tensor, ...], h: float, coef: dict | None = None,
             k: int | None = None, split: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """Advance the scheme state by one layer using piece ``l`` of field ``f`` with step ``h``.

        ``coef`` holds the per-layer coefficients of trainable schemes, gathered once per call by the caller
        (momentum: ``m``, ``eta`` of shape ``(L, C)``; two-step: ``k`` of shape ``(L,)``).
        """
        return _STEPS[self.name](self, f, l, state, h, coef or {}, k or self.lags, split)


def _rk(scheme, f, l, state, h, coef, k, split):
    (y,) = state
    ks: list[torch.Tensor] = []
    for row in scheme.tableau.a:
        yi = y
        for aij, kj in zip(row, ks):
            if aij:
                yi = torch.add(yi, kj, alpha=h * aij)
        ks.append(f.evaluate(l, yi))
    for bi, ki in zip(scheme.tableau.b, ks):
        if bi:
            y = torch.add(y, ki, alpha=h * bi)
    return (y,)


# torch.add(y, F, alpha=h): one kernel for y + h F, where the written-out form takes two.
def _euler(scheme, f, l, state, h, coef, k, split):
    return (torch.add(state[0], f.evaluate(l, state[0]), alpha=h),)


def _halves(f, split):
    """``(n_p, d(l, p, q, part))``: the derivative of one half, using only the other half when separable."""
    if split is None and getattr(f, "separable", False):
        return f.split[0], lambda l, p, q, part: f.evaluate_half(l, q if part == 0 else p, part)
    n_p = (split or f.split)[0]
    if split is None:
        return n_p, lambda l, p, q, part: f.evaluate_part(l, torch.cat([p, q], 1), part)

    def full(l, p, q, part):
        out = f.evaluate(l, torch.cat([p, q], 1))
        return out[:, :n_p] if part == 0 else out[:, n_p:]

    return n_p, full


def _semi_implicit(scheme, f, l, state, h, coef, k, split):
    _, d = _halves(f, split)
    p, q = state
    for part in scheme.part_order:
        if part == 0:
            p = torch.add(p, d(l, p, q, 0), alpha=h)
        else:
            q = torch.add(q, d(l, p, q, 1), alpha=h)
    return (p, q)


def _verlet(scheme, f, l, state, h, coef, k, split):
    _, d = _halves(f, split)
    p, q = state
    p = torch.add(p, d(l, p, q, 0), alpha=0.5 * h)
    q = torch.add(q, d(l, p, q, 1), alpha=h)
    p = torch.add(p, d(l, p, q, 0), alpha=0.5 * h)
    return (p, q)


def _momentum(scheme, f, l, state, h, coef, k, split):
    if scheme.needs == "split":  # on an order-2 field: its own (x, v), see Scheme.for_field
        return _semi_implicit(scheme, f, l, state, h, coef, k, split)
    x, v = state
    v = coef["m"][l] * v + coef["eta_h"][l] * f.evaluate(l, x)
    return (x + v, v)


def _ck(scheme, f, l, state, h, coef, k, split):
    drive = f.evaluate(l, state[0]) * h**k
    tails = [state[-1]]
    for q in reversed(state[:-1]):  # suffix sums: q_n' = Σ_{n' >= n} q_{n'} + σ(q_1) h^k
        tails.append(tails[-1] + q)
    return tuple(t + drive for t in reversed(tails))


def _dense(scheme, f, l, state, h, coef, k, split):
    M = dense_matrix(k).tolist()
    s = []
    for i in range(k):  # s_i = σ^{(l−i)}(x^{(l−i)}), x^{(l−i)} = Σ_j M[i][j] q_{j+1}; absent before layer 0
        if l - i < 0:
            s.append(None)
            continue
        x_lag = state[0]
        for j in range(1, i + 1):
            x_lag = x_lag + M[i][j] * state[j]
        s.append(f.evaluate(l - i, x_lag) * h)
    out = []
    for n in range(k):
        upd = state[n]
        for i in range(n + 1):
            if s[i] is not None and M[n][i]:
                upd = upd + M[n][i] * s[i]
        out.append(upd)
    return tuple(out)


def _lm2(scheme, f, l, state, h, coef, k, split):
    x, x_prev = state
    if l == 0:  # no x_{-1} before the first layer: forward Euler
        return (torch.add(x, f.evaluate(l, x), alpha=h), x)
    kl = coef["k"][l]
    return (torch.add((1 - kl) * x + kl * x_prev, f.evaluate(l, x), alpha=h), x)


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
           "heavy ball: v' = m v + η h F(x), x' = x + v' (m = sigmoid(a_l), η = softplus(b_l))", params=("m", "eta_h")),
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
