"""The scheme base class and the Butcher tableau (see :mod:`solvers.schemes`)."""

from __future__ import annotations

import copy
import math
from typing import Any, cast

import torch

from ..architectures import architecture
from ..steppers.tableaux import Tableau


def axpy(y: torch.Tensor, h: float, F: torch.Tensor) -> torch.Tensor:
    """``y + h F``. Eagerly as one ``torch.add(y, F, alpha=h)`` kernel (one rounding; the form the recorded
    results were computed with); under ``torch.compile`` written out, because torch 2.13's inductor mis-lowers
    add-with-alpha after a matmul (answers off by 6 on an H1 net). The two agree to float rounding."""
    if torch.compiler.is_compiling():
        return y + h * F
    return torch.add(y, F, alpha=h)


__all__ = ["Tableau", "Scheme", "State", "axpy", "dense_matrix"]


State = tuple[torch.Tensor, ...]


def dense_matrix(k: int) -> torch.Tensor:
    """``M[n, i] = (−1)^i C(n, i)`` (0-based, ``i <= n``): backward differences ↔ lags, its own inverse (Hauser,
    eq. S21)."""
    M = torch.zeros(k, k, dtype=torch.float64)
    for n in range(k):
        for i in range(n + 1):
            M[n, i] = (-1) ** i * math.comb(n, i)
    return M


class Scheme:
    """Base class: declarations and the defaults of a one-stage scheme on the field's own state."""

    name: str = ""
    order: int = 1
    state: str = "plain"
    equation: str = "—"
    description: str = ""
    coefficients: tuple[str, ...] = ()  # learnable per-layer tensors the net creates (coefficient_init)
    lags: int = 1
    variant: str = ""  # row variant of the architecture map on the resolved field ("" = as declared)
    properties: frozenset[str] = frozenset()
    invertible: bool = False  # :meth:`inverse` rebuilds a layer's input from its output (memory-free backward)

    def options(self) -> dict[str, Any]:
        """The options this instance was built with (shown by ``repr``)."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"

    # -- the field ----------------------------------------------------------------------------------------
    def for_field(self, field: Any, split: tuple[int, int] | None = None) -> Scheme:
        """The scheme as it runs on ``field`` (a copy; ``order``, ``properties`` and ``variant`` are the ones that
        hold there). Raises ``ValueError`` naming the fix when it cannot run on ``field``."""
        if split is not None:
            raise ValueError(
                f"`split` applies to the split schemes (symplectic_euler, symplectic_euler_qp, "
                f"verlet), not {self.name!r}; drop `split`."
            )
        return copy.copy(self)

    def architecture(self, field: Any = None) -> tuple[str, str]:
        """``(name, paper equation)`` of the network this scheme makes on ``field`` (a field, or a kind string for
        the row as declared)."""
        if field is None or isinstance(field, str):
            return architecture(self.name, field or "any", self.variant)
        return architecture(self.name, getattr(field, "kind", "generic"), self._resolve_quiet(field).variant)

    def _resolve_quiet(self, field: Any) -> Scheme:
        try:
            return self.for_field(field)
        except ValueError:
            return self

    # -- learnable coefficients -----------------------------------------------------------------------------
    def coefficient_init(self, L: int, channels: int) -> dict[str, torch.Tensor]:
        """Initial values of the scheme's learnable tensors for ``L`` layers (names: :attr:`coefficients`)."""
        return {}

    def coefficient_values(self, params: dict[str, torch.Tensor], h: float, ndim: int) -> dict[str, torch.Tensor]:
        """Per-layer coefficients ``(L, ...)`` from the learnable tensors, shaped to broadcast over a state of
        ``ndim`` dimensions."""
        return {}

    # -- running --------------------------------------------------------------------------------------------
    def evaluations(self, l: int) -> int:
        """Field evaluations of layer ``l``."""
        return 1

    def init(self, y0: torch.Tensor) -> State:
        """The scheme state for the input ``y0``."""
        return (y0,)

    def end_pass(self) -> None:
        """A pass through the layers is over: drop what the steps of one pass share (a module holding this scheme
        keeps nothing between calls). The explicit schemes share nothing."""

    def step(self, f: Any, l: int, state: State, h: float, coef: dict | None = None, t: float | None = None) -> State:
        """Advance ``state`` by one layer with piece ``l`` of ``f`` and step ``h``; ``t``: the layer's start time
        (default ``l h``; per-sample stopping past the last piece passes its own). ``coef``: per-layer views of
        :meth:`coefficient_values` (``coef[name][l]``)."""
        raise NotImplementedError

    def readout(self, state: State) -> torch.Tensor:
        """The field-shaped state of a scheme state."""
        return state[0]

    def with_readout(self, state: State, y: torch.Tensor) -> State:
        """``state`` with its field-shaped part taken from ``y`` (a :meth:`readout` of it): the next layer then
        reads ``y``, so a loss is differentiable with respect to it."""
        return (y,) + tuple(state[1:])

    # -- inversion (memory-free backward, :mod:`cde_nets.blocks.invertible`) ---------------------------------------
    def check_invertible(self, field: Any) -> None:
        """Raise ``ValueError`` naming the fix unless :meth:`inverse` is exact on ``field`` (this scheme resolved
        for it by :meth:`for_field`)."""
        if not self.invertible:
            raise ValueError(
                f"`memory_free=True` rebuilds each layer's input from its output, which needs an explicitly "
                f"invertible scheme: symplectic_euler, symplectic_euler_qp, verlet (on a separable field), "
                f"momentum, lm2 or alf. {self.name!r} is not (undoing its step means solving a nonlinear "
                f"equation). Pick one of those, or drop `memory_free`."
            )

    def check_inverse(self, coef: dict) -> None:
        """Raise ``ValueError`` when this call's coefficients (:meth:`coefficient_values`) make :meth:`inverse`
        singular (checked once per memory-free forward)."""

    def inverse(
        self, f: Any, l: int, state: State, h: float, coef: dict | None = None, t: float | None = None
    ) -> State:
        """The state before layer ``l``: ``inverse(f, l, step(f, l, s, h, coef, t), h, coef, t) == s`` up to
        rounding (same arguments as :meth:`step`). Only when :attr:`invertible`."""
        raise NotImplementedError(f"scheme {self.name!r} has no inverse step.")

    def inverse_vjp(
        self,
        f: Any,
        l: int,
        state: State,
        g_state: State,
        wrt: tuple[torch.Tensor, ...],
        h: float,
        coef: dict | None = None,
        t: float | None = None,
    ) -> tuple[State, State, tuple[torch.Tensor | None, ...]]:
        """``(prev, g_prev, g_wrt)``: the state before layer ``l`` (:meth:`inverse`) and the vector-Jacobian product
        of the layer there, ``g_prev = (∂ step / ∂ prev)ᵀ g_state`` and the same for the tensors ``wrt``
        (``None`` where the layer does not use one). Here: the inverse without a graph, then the step recomputed
        with one; a scheme whose inverse evaluates what its step does may reuse those evaluations."""
        with torch.no_grad():
            prev = self.inverse(f, l, state, h, coef, t)
        with torch.enable_grad():
            leaves = tuple(s.detach().requires_grad_(True) for s in prev)
            out = self.step(f, l, leaves, h, coef, t)
            # a scalar ⟨out, g⟩ instead of grad_outputs: torch.autograd.grad's shape check of grad_outputs costs
            # more than a small layer's whole backward
            dot = cast(torch.Tensor, sum((o * g).sum() for o, g in zip(out, g_state) if o.requires_grad))
            grads = torch.autograd.grad(dot, (*leaves, *wrt), allow_unused=True, retain_graph=True)
        n = len(leaves)
        g_prev = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads[:n], prev))
        return prev, g_prev, grads[n:]
