"""The MS1, MS2, MS3 baselines of the H-DNN seed (Galimberti et al.; H, appendix I, eqs. 38-40).

Their layers are the discretisations of these fields: MS1 by semi-implicit Euler with q first
(``symplectic_euler_qp``), MS2 by forward Euler, MS3 by semi-implicit Euler with p first (``symplectic_euler``).
MS1 and MS3 layers are symplectic: MS3 with respect to ``[[0, I], [−I, 0]]``, MS1 with respect to its layer's
``J_j = K_jᵀ`` (``K = [[0, K0], [−K0ᵀ, 0]]``), see :meth:`MS1.J_at`.
"""

from __future__ import annotations

import math

import torch

from cde_nets.fields.pieces import Pieces
from cde_nets.solvers.errors import check_init_std

from .activations import resolve_activation
from .base import Field

__all__ = ["MS1", "MS2", "MS3"]


def _even(dim: int, name: str) -> int:
    if not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"{name} splits y = (p, q) and needs an even `dim`, got {dim!r}; pad with a zero feature.")
    return dim // 2


class _Split(Field):
    separable = True

    def __init__(self, dim, layers, T, activation, init_std, generator):
        super().__init__(T=T, layers=layers)
        self.half_dim = _even(dim, type(self).__name__)
        self.dim = dim
        self.state_shape = (dim,)
        self.split = (self.half_dim, self.half_dim)
        self.activation_name, self.sigma = resolve_activation(activation)
        init_std = check_init_std(init_std)
        std = 1.0 / math.sqrt(self.half_dim) if init_std is None else init_std
        self._init = lambda w: w.normal_(0.0, std, generator=generator)

    def evaluate(self, l: int, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.evaluate_part(l, y, 0), self.evaluate_part(l, y, 1)], -1)

    def evaluate_part(self, l, y, part):
        return self.evaluate_half(l, y[..., self.half_dim :] if part == 0 else y[..., : self.half_dim], part)


class MS1(_Split):
    """``p' = σ(K0 q + b2)``, ``q' = −σ(K0ᵀ p + b1)`` (eq. 38 of H App. I; 8 parameters per layer in R⁴)."""

    kind = "ms1"

    def __init__(self, dim: int, layers: int = 1, T: float = 1.0, activation="tanh", init_std=None, generator=None):
        super().__init__(dim, layers, T, activation, init_std, generator)
        n = self.half_dim
        self.K0 = Pieces(self.grid, (n, n), init=self._init)
        self.b1 = Pieces(self.grid, (n,))
        self.b2 = Pieces(self.grid, (n,))

    def evaluate_half(self, l, z, part):
        if part == 0:  # z = q
            return self.sigma(z @ self.K0[l].T + self.b2[l])
        return -self.sigma(z @ self.K0[l] + self.b1[l])  # z = p

    def J_at(self, l: int) -> torch.Tensor:
        """``J_l = K_lᵀ = [[0, −K0], [K0ᵀ, 0]]``, with respect to which layer ``l`` is symplectic.

        Each half step is a shear whose Jacobian block (``−h D₁ K0ᵀ``, then ``h D₂ K0``, ``D`` diagonal) makes
        ``K0 D K0ᵀ``-type products with this ``J``, which are symmetric. The reading ``J K ᵀ = I`` of H App. I
        (``J = K_lᵀ⁻¹``) gives the right vector field but not the form the layers preserve (tested).
        """
        n = self.half_dim
        Z = torch.zeros(n, n, dtype=self.K0.data.dtype)
        K = torch.cat([torch.cat([Z, self.K0[l]], 1), torch.cat([-self.K0[l].T, Z], 1)], 0)
        return K.T


class MS2(Field):
    """``y' = σ(K y + b)`` with ``K`` skew-symmetric (eq. 39 of H App. I; ``n(n−1)/2 + n`` parameters per layer)."""

    kind = "ms2"

    def __init__(self, dim: int, layers: int = 1, T: float = 1.0, activation="tanh", init_std=None, generator=None):
        super().__init__(T=T, layers=layers)
        if not isinstance(dim, int) or dim < 2:
            raise ValueError(f"`dim` must be an integer >= 2, got {dim!r}.")
        self.dim = dim
        self.state_shape = (dim,)
        self.activation_name, self.sigma = resolve_activation(activation)
        init_std = check_init_std(init_std)
        std = 1.0 / math.sqrt(dim) if init_std is None else init_std
        self.register_buffer("_iu", torch.triu_indices(dim, dim, 1))
        self.S = Pieces(self.grid, (dim * (dim - 1) // 2,), init=lambda w: w.normal_(0.0, std, generator=generator))
        self.b = Pieces(self.grid, (dim,))

    _iu: torch.Tensor  # buffer: the strict upper triangle's indices

    def K_at(self, l: int) -> torch.Tensor:
        K = self.S[l].new_zeros(self.dim, self.dim)
        K = K.index_put((self._iu[0], self._iu[1]), self.S[l])
        return K - K.T

    def evaluate(self, l, y):
        return self.sigma(y @ self.K_at(l).T + self.b[l])


class MS3(_Split):
    """``p' = K1ᵀ σ(K1 q + b1)``, ``q' = −K2ᵀ σ(K2 p + b2)`` (eq. 40 of H App. I; 12 parameters per layer in R⁴)."""

    kind = "ms3"

    def __init__(self, dim: int, layers: int = 1, T: float = 1.0, activation="tanh", init_std=None, generator=None):
        super().__init__(dim, layers, T, activation, init_std, generator)
        n = self.half_dim
        self.K1 = Pieces(self.grid, (n, n), init=self._init)
        self.K2 = Pieces(self.grid, (n, n), init=self._init)
        self.b1 = Pieces(self.grid, (n,))
        self.b2 = Pieces(self.grid, (n,))

    def evaluate_half(self, l, z, part):
        if part == 0:  # z = q
            return self.sigma(z @ self.K1[l].T + self.b1[l]) @ self.K1[l]
        return -(self.sigma(z @ self.K2[l].T + self.b2[l]) @ self.K2[l])  # z = p
