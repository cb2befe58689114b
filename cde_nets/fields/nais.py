"""The non-autonomous NAIS field ``x' = σ(A x + B u + b)``, ``A = −RᵀR − εI`` (SPEC §4, eqs. N3, N13)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..pieces import Pieces
from .activations import DERIVATIVES, resolve_activation
from .base import Field

__all__ = ["NAIS", "NAISConv"]


class _Input(Field):
    """Holds the block input ``u`` bound per batch; restricts it to compacted rows for per-sample stopping."""

    needs_input = True
    kind = "nais"
    input_shape: tuple[int | None, ...] = ()

    def bind(self, u: torch.Tensor) -> _Input:
        """Bind the block input ``u`` (``(batch, *input_shape)``) for the next solves; returns the field."""
        if not isinstance(u, torch.Tensor):
            raise TypeError(f"`u` must be a torch.Tensor, got {type(u).__name__}.")
        want = self.input_shape
        if u.dim() != len(want) + 1 or any(w is not None and w != s for w, s in zip(want, u.shape[1:])):
            sizes = ", ".join("*" if w is None else str(w) for w in want)
            raise ValueError(f"`u` has shape {tuple(u.shape)}, but {type(self).__name__} expects (batch, {sizes}).")
        self.u = u
        return self

    @contextmanager
    def rows(self, idx: torch.Tensor) -> Iterator[Field]:
        u = self._u_for(None)
        self.u = u[idx]
        try:
            yield self
        finally:
            self.u = u

    def _u_for(self, x: torch.Tensor | None) -> torch.Tensor:
        u = getattr(self, "u", None)
        if u is None:
            raise ValueError(f"{type(self).__name__} needs its block input: call `field.bind(u)` (or pass `u=` to "
                             "the block) before integrating.")
        if x is not None and u.shape[0] != x.shape[0]:
            raise ValueError(f"the bound `u` has batch {u.shape[0]} but the state has batch {x.shape[0]}; bind the "
                             "input of this batch.")
        return u


class NAIS(_Input):
    r"""``x' = σ(A x + B u + b)`` with ``A = −RᵀR − εI`` (eq. N13); its forward-Euler step is the NAIS-Net block
    (eq. N3) ``x(k+1) = x(k) + h σ(A x(k) + B u + b)``. ``u`` is ``(batch, input_dim)``; ``x`` is ``(batch, dim)``.
    """

    def __init__(self, dim: int, input_dim: int, layers: int = 1, T: float = 1.0, eps: float = 0.01,
                 activation: str = "tanh", init_std: float | None = None, generator: torch.Generator | None = None):
        super().__init__(T=T, layers=layers)
        if not 0 < eps < 0.5:
            raise ValueError(f"`eps` must lie in (0, 0.5) (Alg. N1: δ = 1 − 2ε), got {eps!r}.")
        self.dim, self.input_dim, self.eps = dim, input_dim, float(eps)
        self.state_shape, self.input_shape = (dim,), (input_dim,)
        self.activation_name, self.sigma = resolve_activation(activation)
        std = 1.0 / math.sqrt(dim) if init_std is None else float(init_std)
        normal = lambda w: w.normal_(0, std, generator=generator)  # noqa: E731
        self.R = Pieces(self.grid, (dim, dim), init=normal)
        self.B = Pieces(self.grid, (dim, input_dim), init=lambda w: w.normal_(0, 1 / math.sqrt(input_dim),
                                                                                generator=generator))
        self.b = Pieces(self.grid, (dim,))
        self.u = None

    def A(self, l: int) -> torch.Tensor:
        R = self.R[l]
        return -(R.T @ R) - self.eps * torch.eye(self.dim, dtype=R.dtype, device=R.device)

    def preactivation(self, l: int, x: torch.Tensor) -> torch.Tensor:
        return x @ self.A(l).T + self._u_for(x) @ self.B[l].T + self.b[l]

    def evaluate(self, l: int, x: torch.Tensor) -> torch.Tensor:
        return self.sigma(self.preactivation(l, x))

    @torch.no_grad()
    def project_(self) -> NAIS:
        """Alg. N1: if ``‖RᵀR‖_F > δ = 1 − 2ε`` then ``R ← √δ R / √‖RᵀR‖_F``, per piece. Idempotent."""
        delta = 1.0 - 2.0 * self.eps
        slack = 1.0 + 16 * torch.finfo(self.R.data.dtype).eps  # a projected R must not be rescaled by rounding
        for l in range(self.layers):
            R = self.R.data[l]
            norm = torch.linalg.matrix_norm(R.T @ R)
            if norm > delta * slack:
                R.mul_(math.sqrt(delta) / torch.sqrt(norm))
        return self

    @torch.no_grad()
    def stability_margin(self, x: torch.Tensor, h: float | None = None, l: int = 0) -> float:
        """Condition N1: the largest spectral radius of ``I + h σ'(A x + B u + b) A`` over the batch ``x``."""
        if self.activation_name not in DERIVATIVES:
            raise NotImplementedError(f"no derivative known for activation {self.activation_name!r}.")
        h = self.grid.h if h is None else h
        D = DERIVATIVES[self.activation_name](self.preactivation(l, x))
        M = torch.eye(self.dim, dtype=x.dtype) + h * D[:, :, None] * self.A(l)[None]
        return float(torch.linalg.eigvals(M).abs().max())


class NAISConv(_Input):
    r"""Convolutional NAIS: ``x' = σ(C ⋆ x + D ⋆ u + b)`` with a same-size ``C`` made stable by Alg. N2.

    ``x`` and ``u`` are ``(batch, channels, H, W)``. Alg. N2 sets each channel's centre tap to ``−1 − δ_c``
    (``|δ_c| <= 1 − η``) and scales the channel's other taps so their absolute sum is at most ``1 − ε − |δ_c|``.
    """

    def __init__(self, channels: int, layers: int = 1, T: float = 1.0, kernel_size: int = 3, eps: float = 0.01,
                 eta: float = 0.05, activation: str = "tanh", generator: torch.Generator | None = None):
        super().__init__(T=T, layers=layers)
        if not 0 < eps < eta < 1:
            raise ValueError(f"Alg. N2 needs 0 < eps < eta < 1, got eps={eps!r}, eta={eta!r}.")
        if kernel_size % 2 == 0:
            raise ValueError(f"`kernel_size` must be odd (same-size padding), got {kernel_size}.")
        self.channels, self.k, self.eps, self.eta = channels, kernel_size, float(eps), float(eta)
        self.state_shape = self.input_shape = (channels, None, None)
        self.activation_name, self.sigma = resolve_activation(activation)
        std = 1.0 / math.sqrt(channels * kernel_size**2)
        normal = lambda w: w.normal_(0, std, generator=generator)  # noqa: E731
        self.C = Pieces(self.grid, (channels, channels, kernel_size, kernel_size), init=normal)
        self.D = Pieces(self.grid, (channels, channels, kernel_size, kernel_size), init=normal)
        self.delta = Pieces(self.grid, (channels,))
        self.b = Pieces(self.grid, (channels,))
        self.u = None
        self.project_()

    def evaluate(self, l: int, x: torch.Tensor) -> torch.Tensor:
        u = self._u_for(x)
        pad = self.k // 2
        return self.sigma(F.conv2d(x, self.C[l], self.b[l], padding=pad) + F.conv2d(u, self.D[l], padding=pad))

    @torch.no_grad()
    def project_(self) -> NAISConv:
        """Alg. N2, per piece and output channel (idempotent)."""
        m = self.k // 2
        for l in range(self.layers):
            C, d = self.C.data[l], self.delta.data[l]
            d.clamp_(-1 + self.eta, 1 - self.eta)
            for c in range(self.channels):
                C[c, c, m, m] = -1 - d[c]
                mask = torch.ones_like(C[c], dtype=torch.bool)
                mask[c, m, m] = False
                total = C[c][mask].abs().sum()
                budget = 1 - self.eps - d[c].abs()
                if total > budget:
                    C[c][mask] = C[c][mask] * (budget / total)
        return self
