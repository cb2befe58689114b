"""Split schemes on a ``(p, q)`` pair: semi-implicit (symplectic) Euler, both orders, and Störmer-Verlet."""

from __future__ import annotations

import copy

import torch

from .base import Scheme, axpy

__all__ = ["SymplecticEuler", "SymplecticEulerQP", "Verlet"]


class _Split(Scheme):
    """A scheme on a ``(p, q)`` split. Symplectic (a composition of shears) and of its declared order only on
    *separable* fields (``p'`` from ``q`` alone, ``q'`` from ``p`` alone: H2-DNN, MS1, MS3); elsewhere it runs as the
    explicit semi-implicit variant, ``variant = "non-separable"``, with no ``"symplectic"`` property and the order
    that holds there (:attr:`order_non_separable`)."""

    state = "split"
    order_non_separable = 1
    n_p: int | None = None
    mode: str = ""  # "half" (separable), "part" (declared split), "full" (split= on any field)

    def for_field(self, field, split=None):
        declared = getattr(field, "split", None)
        if split is None and declared is None:
            shape = tuple(getattr(field, "state_shape", ()) or ())
            n = shape[0] if len(shape) == 1 else None
            raise ValueError(
                f"scheme {self.name!r} needs a (p, q) split, but {type(field).__name__} declares none; use a split "
                "field (Hamiltonian(K='blockdiag'), MS1, MS3) or pass `split=(n_p, n_q)`"
                + (f" (n = {n} is odd: pad the state with a zero feature)." if n is not None and n % 2 else ".")
            )
        if split is not None:
            shape = tuple(getattr(field, "state_shape", ()) or ())
            bad = (
                not isinstance(split, tuple) or len(split) != 2 or not all(isinstance(s, int) and s > 0 for s in split)
            )
            if bad or (len(shape) == 1 and shape[0] is not None and sum(split) != shape[0]):
                n = shape[0] if len(shape) == 1 else "?"
                raise ValueError(f"`split`={split} must add up to the state size {n} (two positive sizes (n_p, n_q)).")
        s = copy.copy(self)
        s.n_p = (split or declared)[0]
        separable = split is None and bool(getattr(field, "separable", False))
        s.mode = "half" if separable else ("part" if split is None else "full")
        if separable:
            s.properties = frozenset({"symplectic"})
        else:
            s.properties, s.variant, s.order = frozenset(), "non-separable", self.order_non_separable
        return s

    def _resolve_quiet(self, field):
        try:
            return self.for_field(field)
        except ValueError:  # no declared split: the label is the one `split=` would give
            s = copy.copy(self)
            s.properties, s.variant, s.order = frozenset(), "non-separable", self.order_non_separable
            return s

    def init(self, y0):
        if self.mode == "full" and y0.dim() >= 2 and self.n_p >= y0.shape[1]:
            raise ValueError(
                f"`split` puts {self.n_p} features in p but the state has {y0.shape[1]}; pass a split "
                "that adds up to the state size."
            )
        return (y0[:, : self.n_p], y0[:, self.n_p :])

    def readout(self, state):
        return torch.cat(state, 1)

    def derivative(self, f, l: int, p: torch.Tensor, q: torch.Tensor, part: int, t: float) -> torch.Tensor:
        """``p'`` (``part=0``) or ``q'`` (``part=1``) at ``(p, q)``: from the other half alone on separable fields."""
        if self.mode == "half":
            return f.evaluate_half(l, q if part == 0 else p, part)
        if self.mode == "part":
            return f.evaluate_part(l, torch.cat([p, q], 1), part)
        out = f.evaluate(l, torch.cat([p, q], 1), t=t)
        return out[:, : self.n_p] if part == 0 else out[:, self.n_p :]


class SymplecticEuler(_Split):
    """Semi-implicit Euler, ``p`` first: ``p' = p + h F_p(p, q)``, ``q' = q + h F_q(p', q)`` — H2-DNN (Galimberti et
    al. 2023, eqs. 12-13), MS3 (app. I, eq. 40)."""

    name, order, equation = "symplectic_euler", 1, "H12-13"
    description = "semi-implicit Euler, p first: p' = p + h F_p(p, q), q' = q + h F_q(p', q)"
    part_order: tuple[int, int] = (0, 1)

    def evaluations(self, l):
        return 2

    def step(self, f, l, state, h, coef=None, t=None):
        p, q = state
        t = l * h if t is None else t
        for part in self.part_order:
            if part == 0:
                p = axpy(p, h, self.derivative(f, l, p, q, 0, t))
            else:
                q = axpy(q, h, self.derivative(f, l, p, q, 1, t))
        return (p, q)


class SymplecticEulerQP(SymplecticEuler):
    """Semi-implicit Euler, ``q`` first: ``q' = q + h F_q(p, q)``, ``p' = p + h F_p(p, q')`` — MS1 (Galimberti et al.
    2023, app. I, eq. 38); on a second-order field ``(x, v)``, velocity first, the blog's block (B §8)."""

    name, equation = "symplectic_euler_qp", "H-App. I (MS1)"
    description = "semi-implicit Euler, q first: q' = q + h F_q(p, q), p' = p + h F_p(p, q')"
    part_order = (1, 0)


class Verlet(_Split):
    """Störmer-Verlet (leapfrog): ``p`` half step, ``q`` step, ``p`` half step. Order 2 and symplectic on separable
    fields; on others the explicit half steps make it first order (:attr:`order_non_separable`)."""

    name, order, description = "verlet", 2, "Störmer-Verlet / leapfrog (p half step, q step, p half step)"

    def evaluations(self, l):
        return 3

    def step(self, f, l, state, h, coef=None, t=None):
        p, q = state
        t = l * h if t is None else t
        p = axpy(p, 0.5 * h, self.derivative(f, l, p, q, 0, t))
        q = axpy(q, h, self.derivative(f, l, p, q, 1, t + 0.5 * h))
        p = axpy(p, 0.5 * h, self.derivative(f, l, p, q, 0, t + h))
        return (p, q)
