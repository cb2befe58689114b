"""Cubic-friction fields of Ruseckas: dense eq. R56-57 and convolutional eq. R75."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cde_nets.fields.pieces import Pieces
from cde_nets.solvers.errors import check_init_std, check_odd_kernel_size, check_positive_int

from .base import Field, Shared

__all__ = ["CubicFriction", "CubicFrictionConv"]


def _softplus_inverse(x: float) -> float:
    return x + math.log(-math.expm1(-x))


class _Friction(nn.Module):
    """``γ sign(x)|x|^μ`` with ``γ >= 0`` (softplus of a raw parameter when learned) and ``μ > 1``."""

    # One of the two is set in __init__ (a parameter when learned, else a buffer).
    gamma_raw: nn.Parameter
    gamma_fixed: torch.Tensor

    def __init__(self, gamma: float, learn_gamma: bool, mu: float):
        super().__init__()
        if not math.isfinite(float(mu)) or mu <= 1:
            raise ValueError(f"`mu` must be > 1 (eq. R57), got {mu!r}.")
        if gamma < 0 or not math.isfinite(float(gamma)):
            raise ValueError(f"`gamma` must be a finite number >= 0, got {gamma!r}.")
        if learn_gamma and gamma == 0:
            raise ValueError("`gamma=0` cannot be learned through softplus; start from a small positive value.")
        self.mu = float(mu)
        self.learn_gamma = learn_gamma
        if learn_gamma:
            self.gamma_raw = nn.Parameter(torch.tensor(_softplus_inverse(float(gamma))))
        else:
            self.register_buffer("gamma_fixed", torch.tensor(float(gamma)))

    @property
    def gamma(self) -> torch.Tensor:
        return F.softplus(self.gamma_raw) if self.learn_gamma else self.gamma_fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.subtract_from(torch.zeros_like(x), x, self.gamma)

    def subtract_from(self, affine: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        """``affine − γ sign(x)|x|^μ`` in one fused ``addcmul`` (the field's hot path calls this directly)."""
        power = x * x * x if self.mu == 3.0 else torch.sign(x) * x.abs().pow(self.mu)
        return torch.addcmul(affine, gamma, power, value=-1.0)


class CubicFriction(Field):
    r"""``dx_i/dt = Σ_j w_ij(t) x_j + b_i(t) − γ sign(x_i)|x_i|^μ`` (Ruseckas, eqs. R56-57; μ = 3 default).

    Args:
        dim: state size ``d``; ``x`` is ``(batch, d)``.
        layers, T: ``L`` parameter pieces over ``[0, T]`` (discrete mode: ``w̃ = h w``, ``b̃ = h b``,
            ``γ̃ = h γ`` of eq. R109).
        gamma: initial (or fixed) friction ``γ >= 0``; ``learn_gamma`` learns it like a parametric ReLU.
        zero_init: start ``w = b = 0`` (valid, R §4.4: signals then decay as a power law); otherwise
            ``w ~ N(0, init_std²)`` with ``init_std = 1/√d`` by default.
    Parameter count: ``L (d² + d)`` plus one for a learned ``γ`` (601 for d = 2, L = 100: model 1 of R §5.1).
    """

    kind = "cubic_friction"

    def __init__(
        self,
        dim: int,
        layers: int = 1,
        T: float = 1.0,
        gamma: float = 1.0,
        learn_gamma: bool = True,
        mu: float = 3.0,
        zero_init: bool = True,
        init_std: float | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(T=T, layers=layers)
        check_positive_int("dim", dim)
        self.dim = dim
        self.state_shape = (dim,)
        init_std = check_init_std(init_std)
        std = 1.0 / math.sqrt(dim) if init_std is None else init_std
        init = None if zero_init else (lambda w: w.normal_(0.0, std, generator=generator))
        self.W = Pieces(self.grid, (dim, dim), init=init)
        self.b = Pieces(self.grid, (dim,))
        self.friction = _Friction(gamma, learn_gamma, mu)

    @property
    def gamma(self) -> torch.Tensor:
        return self.friction.gamma

    @property
    def mu(self) -> float:
        return self.friction.mu

    def piece_constants(self, l: int | None) -> tuple[Any, ...]:
        """``(w, b, γ)``: ``γ`` (a softplus when learned) once per call."""
        if l is None:
            return (self.W.data, self.b.data, Shared(self.friction.gamma))
        return (self.W[l], self.b[l], self.friction.gamma)

    def evaluate(self, l: int, x: torch.Tensor) -> torch.Tensor:
        W, b, gamma = self.constants(l)
        return self.friction.subtract_from(torch.addmm(b, x, W.T), x, gamma)

    def divergence(self, l: int, x: torch.Tensor) -> torch.Tensor:
        """``Tr ∂F/∂x = Σ_i w_ii − γ μ Σ_i |x_i|^{μ−1}`` per sample (Ruseckas, eq. R28; μ = 3: ``− 3γ Σ x_i²``)."""
        return torch.diagonal(self.W[l]).sum() - self.gamma * self.mu * x.abs().pow(self.mu - 1).sum(-1)


class CubicFrictionConv(Field):
    r"""``x' = κ(t) ⋆ x + b(t) − γ sign(x)|x|^μ`` on images (Ruseckas, eq. R75).

    ``κ`` is a same-size, zero-padded ``channels × channels × k × k`` convolution per piece; the channel count
    stays fixed (augment the input with zero channels, as in augmented ODEs). ``x`` is
    ``(batch, channels, height, width)``; any height and width are accepted.
    Parameter count: ``L (C² k² + C)`` plus a learned ``γ`` (18 201 for C = 10, k = 3, L = 20: R's MNIST model).
    """

    kind = "cubic_friction"

    def __init__(
        self,
        channels: int,
        layers: int = 1,
        T: float = 1.0,
        kernel_size: int = 3,
        gamma: float = 1.0,
        learn_gamma: bool = True,
        mu: float = 3.0,
        zero_init: bool = True,
        init_std: float | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(T=T, layers=layers)
        check_positive_int("channels", channels)
        check_odd_kernel_size(kernel_size)
        self.channels = channels
        self.state_shape = (channels, None, None)
        self.kernel_size = kernel_size
        init_std = check_init_std(init_std)
        std = 1.0 / math.sqrt(channels * kernel_size**2) if init_std is None else init_std
        init = None if zero_init else (lambda w: w.normal_(0.0, std, generator=generator))
        self.kernel = Pieces(self.grid, (channels, channels, kernel_size, kernel_size), init=init)
        self.bias = Pieces(self.grid, (channels,))
        self.friction = _Friction(gamma, learn_gamma, mu)

    @property
    def gamma(self) -> torch.Tensor:
        return self.friction.gamma

    def evaluate(self, l: int, x: torch.Tensor) -> torch.Tensor:
        affine = F.conv2d(x, self.kernel[l], self.bias[l], padding=self.kernel_size // 2)
        return self.friction.subtract_from(affine, x, self.memo("gamma", lambda: self.friction.gamma))
