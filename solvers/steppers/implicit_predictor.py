r"""Starting stages for an implicit step from the previous step's collocation polynomial.

After a step from ``(t_0, y_0)`` with stage increments ``Z`` (``Z = h (A ⊗ I) K``, ``K_i = F(Y_i)``), the polynomial
``u(t_0 + τ h) = y_0 + Σ_i β_i(τ) h K_i``, ``β_i(τ) = ∫_0^τ ℓ_i``, with ``ℓ_i`` the Lagrange basis on the nodes
``c``, is the method's continuous output: for a collocation method (Gauss-Legendre, Radau IIA) it passes through
``y_0`` and every stage value, ``u(t_0 + c_i h) = Y_i``, and stays within ``O(h^{s+1})`` of the exact solution.
The next step, of size ``r h`` from ``y_1``, then starts from the extrapolated stages

    ``Z'_j = u(t_0 + h + r c_j h) − u(t_0 + h) = Σ_i (β_i(1 + r c_j) − β_i(1)) (A^{−1} Z)_i``,

i.e. ``Z' = E(r) Z`` with an ``s × s`` matrix ``E`` fixed by the tableau (Hairer & Wanner 1996, "Solving ordinary
differential equations II", §IV.8, starting values for the simplified Newton iterations). Its error is
``O(h^{s+1})`` against the ``O(h²)`` of ``Z_i = h c_i F(t_0, y_0)``, and it needs no evaluation of the field; the
iteration then runs to the same stopping rule, so the converged stages do not depend on the start beyond it.

Along a chain of equal steps the extrapolation's own error is corrected too. Its error for the step from ``y_n``,
``e_n = Z_n − E Z_{n−1}``, is a smooth function of the state (``O(h^{s+1})``) sampled along the numerical
trajectory at the spacing ``h``, so the polynomial through the last ``m`` errors (``m ≤`` :data:`HISTORY`)
extrapolated one step predicts the next, and the start is ``E Z_n + Σ_j (−1)^{j+1} C(m, j) e_{n+1−j}``: each past
error gains a factor of about ``h ω`` (``ω`` the rate at which the error changes along the trajectory) at no
evaluation. A step of another size, a step on another parameter piece of the field (``piece``: a jump of the
parameters is a jump of the error), or a step that did not continue the chain starts the error history afresh.

Tableaux with a singular ``A`` (an explicit first stage: ``trapezoid``, ``trbdf2``) or repeated nodes get no
predictor.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
import torch

from .implicit_linear import Carry
from .implicit_tableaux import ImplicitTableau

__all__ = ["StagePredictor", "extrapolation_matrix", "HISTORY"]

_MAX_RATIO = 2.0  # beyond, the polynomial is extrapolated too far to beat the default start
_EQUAL = 1e-12  # step ratios this close to ±1 are taken as ±1 (the extrapolation changes by as little)
HISTORY = 3  # past prediction errors extrapolated along a chain of equal steps (0: the extrapolation alone)
_E: dict[tuple[ImplicitTableau, float], np.ndarray | None] = {}


def extrapolation_matrix(tab: ImplicitTableau, ratio: float) -> np.ndarray | None:
    """``E(r)`` ``(s, s)`` with ``Z' = E Z`` for a next step ``r`` times the last (see the module); ``None`` where
    ``A`` is singular or the nodes repeat."""
    key = (tab, ratio)
    if key in _E:
        return _E[key]
    c, A = np.array(tab.c), tab.A
    E = None
    if len(set(tab.c)) == len(c) and abs(np.linalg.det(A)) >= 1e-12:
        s = len(c)
        # ℓ_i(σ) = Σ_k W[k, i] σ^k with W = V^{-1}, V[i, k] = c_i^k; β_i(τ) = Σ_k W[k, i] τ^{k+1} / (k + 1)
        W = np.linalg.inv(np.vander(c, s, increasing=True))
        powers = np.arange(1, s + 1)

        def beta(tau: np.ndarray) -> np.ndarray:
            return (tau[:, None] ** powers / powers) @ W

        E = (beta(1.0 + ratio * c) - beta(np.array([1.0]))) @ np.linalg.inv(A)
    if ratio in (1.0, -1.0):  # equal steps, and a step undone: the only ratios kept (any other is computed anew)
        _E[key] = E
    return E


class _Errors:
    """The last ``size`` prediction errors of a chain in one ring buffer ``(size, s B n)``, made once per chain
    (no allocation per step), and the correction they predict for the next step."""

    def __init__(self, size: int) -> None:
        self.size, self.count, self.head = size, 0, 0
        self.buf: torch.Tensor | None = None
        self.corr: torch.Tensor | None = None
        self._weights: dict[tuple, torch.Tensor] = {}

    def clear(self) -> None:
        self.count = 0

    def correction(self, Z: torch.Tensor) -> torch.Tensor | None:
        """``Σ_j (−1)^{j+1} C(m, j) e_{n+1−j}`` over the ``m`` errors kept, as ``(s, B n)``; ``None`` without any."""
        buf, m = self.buf, self.count
        if m == 0 or buf is None or buf.shape[1] != Z.numel() or buf.dtype != Z.dtype or buf.device != Z.device:
            return None
        key = (m, self.head, buf.dtype, buf.device)
        if key not in self._weights:
            w = [0.0] * self.size
            for j in range(1, m + 1):  # the j-th latest error
                w[(self.head - j) % self.size] = (-1) ** (j + 1) * math.comb(m, j)
            self._weights[key] = torch.tensor([w], dtype=buf.dtype, device=buf.device)
        assert self.corr is not None
        torch.mm(self._weights[key], buf, out=self.corr)
        return self.corr.view(len(Z), -1)

    def push(self, Z: torch.Tensor, guess: torch.Tensor, corr: torch.Tensor | None) -> None:
        """The error ``Z − (guess − corr)`` of the extrapolation ``guess − corr`` against the converged ``Z``."""
        buf = self.buf
        if buf is None or buf.shape[1] != Z.numel() or buf.dtype != Z.dtype or buf.device != Z.device:
            self.buf = buf = Z.new_zeros(self.size, Z.numel())  # zeros: unwritten slots enter with weight 0
            self.corr, self.count, self.head = Z.new_empty(1, Z.numel()), 0, 0
        slot = buf[self.head].view_as(Z)
        torch.sub(Z, guess.view_as(Z), out=slot)
        if corr is not None:
            slot.add_(corr.view_as(Z))
        self.head, self.count = (self.head + 1) % self.size, min(self.count + 1, self.size)


class StagePredictor:
    """The last step of a chain of steps (its output, its stage increments, its size), to start the next step from
    when that one starts where it ended, and what else the chain carries (:meth:`carry`). Holds
    the output by weak reference, so that only a step taken from that very tensor is predicted; dropped (not
    copied) by ``copy.deepcopy`` and pickling. ``history``: how many past prediction errors of a chain of equal
    steps correct the extrapolation (see the module; 0: none)."""

    def __init__(self, history: int = HISTORY) -> None:
        self.history = history
        self._last: tuple[Any, float, torch.Tensor, str] | None = None
        self._E: tuple[tuple, torch.Tensor] | None = None
        self._carry = Carry()
        self._errors = _Errors(max(history, 1))
        self._pending: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the start handed out, its correction
        self._piece: object = None  # the parameter piece the errors were made on

    def guess(self, tab: ImplicitTableau, y: torch.Tensor, h: float, piece: object = None) -> torch.Tensor | None:
        """Starting increments ``(s, B, n)`` for the step of size ``h`` from ``y``, or ``None`` if ``y`` is not the
        last step's output (the identical tensor: a step from it continues the chain, whatever time the caller
        labels it with). ``piece``: which parameters of the field the step sees (a layer, a piece of a piecewise
        field; ``None``: one smooth field); the error history is kept within one piece."""
        self._pending, last, same_piece, self._piece = None, self._last, piece == self._piece, piece
        if last is None or last[0]() is not y or last[2].shape[1:] != y.reshape(len(y), -1).shape:
            return None
        ratio = h / last[1]
        if abs(abs(ratio) - 1.0) <= _EQUAL:  # a grid's equal steps differ in the last bits: the same step
            ratio = math.copysign(1.0, ratio)
        if abs(ratio) > _MAX_RATIO:
            return None
        E = extrapolation_matrix(tab, ratio)
        Z = last[2]
        if E is None or E.shape[0] != Z.shape[0]:
            return None
        key = (tab, ratio, Z.dtype, Z.device)
        if self._E is None or self._E[0] != key:  # one conversion per chain, not per step
            self._E = (key, torch.as_tensor(E, dtype=Z.dtype, device=Z.device))
            self._errors.clear()  # errors of another tableau or step size are another function of the state
        flat = Z.reshape(len(E), -1)
        if ratio != 1.0 or not same_piece or self.history <= 0:  # this step's error is not the sequence's
            self._errors.clear()
            return torch.mm(self._E[1], flat).view_as(Z)
        corr = self._errors.correction(Z)  # the polynomial through the last errors, one step on
        guess = torch.mm(self._E[1], flat) if corr is None else torch.addmm(corr, self._E[1], flat)
        self._pending = (guess, corr)
        return guess.view_as(Z)

    @property
    def kind(self) -> str | None:
        """The iteration that converged in the last step (``"fixed_point"`` or ``"simplified"`` for ``"auto"``)."""
        return None if self._last is None else self._last[3]

    def carries_from(self, y: torch.Tensor) -> bool:
        """Whether ``y`` is the last step's output."""
        return self._last is not None and self._last[0]() is y

    def record(self, y1: torch.Tensor, h: float, Z: torch.Tensor, kind: str) -> None:
        """The step of size ``h`` that gave ``y1`` from its converged increments ``Z`` and iteration ``kind``."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0].numel() != Z.numel():
            self._errors.clear()  # the chain broke, started, or changed its step: no error history
        else:
            self._errors.push(Z.detach(), *pending)
        self._last = (weakref.ref(y1), h, Z.detach(), kind)

    def carry(self, y: torch.Tensor) -> Carry:
        """What the chain hands on to a step from ``y`` (:class:`~solvers.steppers.implicit_linear.Carry`): the earlier
        steps', if ``y`` is the last step's output, else emptied (a step that does not continue the chain evaluates
        its own Jacobian and checks its iteration from the first)."""
        if not self.carries_from(y):
            self._carry.clear()
        return self._carry

    def clear(self) -> None:
        self._last, self._pending, self._piece = None, None, None
        self._errors.clear()
        self._carry.clear()

    def __deepcopy__(self, memo: dict) -> StagePredictor:
        return StagePredictor(self.history)

    def __getstate__(self) -> dict:
        return {
            "history": self.history,
            "_last": None,
            "_E": None,
            "_carry": Carry(),
            "_errors": _Errors(max(self.history, 1)),
            "_pending": None,
            "_piece": None,
        }
