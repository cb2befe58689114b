"""Split schemes on a ``(p, q)`` pair: semi-implicit (symplectic) Euler, both orders, and Störmer-Verlet."""

from __future__ import annotations

import copy
from typing import cast

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
        s.n_p = cast(tuple[int, int], split or declared)[0]  # one of them was checked above
        separable = split is None and bool(getattr(field, "separable", False))
        s.mode = "half" if separable else ("part" if split is None else "full")
        # each half step is a shear by the other half alone only on separable fields: run backwards, it is exact
        s.invertible = separable
        if separable:
            s.properties = frozenset({"symplectic"})
        else:
            s.properties, s.variant, s.order = frozenset(), "non-separable", self.order_non_separable
        return s

    def check_invertible(self, field):
        if self.variant == "field velocity":
            raise ValueError(
                f"on the order-2 field {type(field).__name__}, the momentum scheme's m = 1 − hγ and "
                "η = hη come from the field's γ, η; drop `momentum`, `tie_eta` and `memory_free` (or use "
                "a first-order field)."
            )
        if not self.invertible:
            raise ValueError(
                f"`memory_free=True` undoes {self.name!r} by running its half steps backwards "
                "(q ← q − h F_q(p), p ← p − h F_p(q)), which is exact only on a separable field (p' from q alone, "
                f"q' from p alone); {type(field).__name__} is not separable here"
                + (" (`split=` evaluates the whole field)" if self.mode == "full" else "")
                + ". Use Hamiltonian(K='blockdiag'), MS1 or MS3, or drop `memory_free`."
            )

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

    def with_readout(self, state, y):
        return (y[:, : self.n_p], y[:, self.n_p :])

    def stages(self, t: float, h: float) -> tuple[tuple[int, float, float], ...]:
        """The half steps of one layer in order: ``(part, c, time)`` for ``z_part ← z_part + c h F_part``."""
        raise NotImplementedError

    def inverse_vjp(self, f, l, state, g_state, wrt, h, coef=None, t=None):
        """The reversible backward of Gomez et al. 2017 (§3, additive coupling): the half steps undone in reverse
        order, each with its one evaluation taken under autograd and reused for that half step's vector-Jacobian
        product — one evaluation per half step, as in the forward, instead of the inverse's plus a recomputed step's.
        """
        p, q = state
        gp, gq = g_state
        t = l * h if t is None else t
        g_wrt: list[torch.Tensor | None] = [None] * len(wrt)
        for part, c, ts in reversed(self.stages(t, h)):
            ch = c * h
            with torch.enable_grad():
                other = (q if part == 0 else p).detach().requires_grad_(True)
                F = self.derivative(f, l, other, other, part, ts)  # half mode: part 0 reads q, part 1 reads p
                w = ch * (gp if part == 0 else gq)
                grads = torch.autograd.grad((F * w).sum(), (other, *wrt), allow_unused=True, retain_graph=True)
            with torch.no_grad():
                if part == 0:
                    p = p - ch * F
                    gq = gq if grads[0] is None else gq + grads[0]
                else:
                    q = q - ch * F
                    gp = gp if grads[0] is None else gp + grads[0]
                for i, g in enumerate(grads[1:]):
                    if g is not None:
                        prev = g_wrt[i]
                        g_wrt[i] = g if prev is None else prev + g
        return (p.detach(), q.detach()), (gp, gq), tuple(g_wrt)

    def derivative(self, f, l: int, p: torch.Tensor, q: torch.Tensor, part: int, t: float) -> torch.Tensor:
        """``p'`` (``part=0``) or ``q'`` (``part=1``) at ``(p, q)``: from the other half alone on separable fields."""
        if self.mode == "half":
            return f.evaluate_half(l, q if part == 0 else p, part)
        if self.mode == "part":
            return f.evaluate_part(l, torch.cat([p, q], 1), part)
        out = f.evaluate(l, torch.cat([p, q], 1), t=t)
        return out[:, : self.n_p] if part == 0 else out[:, self.n_p :]


class _Substeps(_Split):
    """A method given by its substeps (:meth:`stages`): kicks ``p ← p + c h F_p(q)`` and drifts
    ``q ← q + c h F_q(p)`` in sequence, each a shear, so the step is symplectic and explicitly invertible."""

    def step(self, f, l, state, h, coef=None, t=None):
        p, q = state
        for part, c, ts in self.stages(l * h if t is None else t, h):
            if part == 0:
                p = axpy(p, c * h, self.derivative(f, l, p, q, 0, ts))
            else:
                q = axpy(q, c * h, self.derivative(f, l, p, q, 1, ts))
        return (p, q)

    def inverse(self, f, l, state, h, coef=None, t=None):
        """The substeps in reverse order, subtracted: each reads only the half it does not change."""
        p, q = state
        for part, c, ts in reversed(self.stages(l * h if t is None else t, h)):
            if part == 0:
                p = p - (c * h) * self.derivative(f, l, p, q, 0, ts)
            else:
                q = q - (c * h) * self.derivative(f, l, p, q, 1, ts)
        return (p, q)


class SymplecticEuler(_Split):
    """Semi-implicit Euler, ``p`` first: ``p' = p + h F_p(p, q)``, ``q' = q + h F_q(p', q)`` — H2-DNN (Galimberti et
    al. 2023, eqs. 12-13), MS3 (app. I, eq. 40)."""

    name, order, equation = "symplectic_euler", 1, "H12-13"
    description = "semi-implicit Euler, p first: p' = p + h F_p(p, q), q' = q + h F_q(p', q)"
    part_order: tuple[int, int] = (0, 1)

    def evaluations(self, l):
        return 2

    def stages(self, t, h):
        return tuple((part, 1.0, t) for part in self.part_order)

    def step(self, f, l, state, h, coef=None, t=None):
        p, q = state
        t = l * h if t is None else t
        for part in self.part_order:
            if part == 0:
                p = axpy(p, h, self.derivative(f, l, p, q, 0, t))
            else:
                q = axpy(q, h, self.derivative(f, l, p, q, 1, t))
        return (p, q)

    def inverse(self, f, l, state, h, coef=None, t=None):
        """The half steps in reverse order, subtracted: each reads only the half it does not change."""
        p, q = state
        t = l * h if t is None else t
        for part in reversed(self.part_order):
            if part == 0:
                p = p - h * self.derivative(f, l, p, q, 0, t)
            else:
                q = q - h * self.derivative(f, l, p, q, 1, t)
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

    def stages(self, t, h):
        return ((0, 0.5, t), (1, 1.0, t + 0.5 * h), (0, 0.5, t + h))

    def step(self, f, l, state, h, coef=None, t=None):
        p, q = state
        t = l * h if t is None else t
        p = axpy(p, 0.5 * h, self.derivative(f, l, p, q, 0, t))
        q = axpy(q, h, self.derivative(f, l, p, q, 1, t + 0.5 * h))
        p = axpy(p, 0.5 * h, self.derivative(f, l, p, q, 0, t + h))
        return (p, q)

    def inverse(self, f, l, state, h, coef=None, t=None):
        p, q = state
        t = l * h if t is None else t
        p = p - (0.5 * h) * self.derivative(f, l, p, q, 0, t + h)
        q = q - h * self.derivative(f, l, p, q, 1, t + 0.5 * h)
        p = p - (0.5 * h) * self.derivative(f, l, p, q, 0, t)
        return (p, q)
