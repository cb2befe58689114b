"""Hamiltonian field ``y' = J(t) K(t)ᵀ σ(K(t) y + b(t))`` (Galimberti et al., eq. H8; Hamiltonian eq. H5)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cde_nets.fields.pieces import Pieces
from cde_nets.solvers.errors import check_init_std, check_positive_int

from .activations import ANTIDERIVATIVES, resolve_activation
from .base import Field, Shared

__all__ = ["Hamiltonian", "canonical_J"]


def canonical_J(dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[[0, −I], [I, 0]]`` of size ``dim`` (even), acting on ``y = (p, q)``."""
    if dim % 2:
        raise ValueError(f"`dim` must be even for J = [[0, -I], [I, 0]], got {dim}; pad the state with a zero feature.")
    n = dim // 2
    J = torch.zeros(dim, dim, dtype=dtype or torch.get_default_dtype())
    J[:n, n:] = -torch.eye(n)
    J[n:, :n] = torch.eye(n)
    return J


class Hamiltonian(Field):
    r"""``y' = J K(t)ᵀ σ(K(t) y + b(t))`` with ``H(y, t) = Σ σ̃(K(t) y + b(t))`` (Galimberti et al., eqs. H5, H8).

    Args:
        dim: state size ``n`` (even unless ``J`` is a user tensor of odd size).
        layers: number of parameter pieces ``L`` over ``[0, T]`` (1 = time-invariant).
        T: end time.
        J: ``"canonical"`` (fixed ``[[0, −I], [I, 0]]``), ``"structured"`` (``[[0, −Xᵀ], [X, 0]]`` with learned
            ``X``), ``"learned"`` (``S − Sᵀ`` with learned ``S``), or a fixed skew-symmetric tensor.
        K: ``"full"`` (H1-DNN, a ``width × n`` matrix per piece) or ``"blockdiag"``
            (``blockdiag(K_p, K_q)``, H2-DNN eq. H12-13): with an off-diagonal ``J`` the field is then
            separable, declares ``split = (n/2, n/2)`` and :meth:`evaluate_part` computes only one half.
        width: rows of ``K`` (``full``; default ``n``) or of each of ``K_p``, ``K_q`` (``blockdiag``; default
            ``n/2``).
        activation: name (``tanh`` default) or callable; :meth:`energy` needs a known antiderivative.
        K_mask, J_mask: fixed binary masks multiplied into ``K`` (``K_p`` and ``K_q`` for ``blockdiag``; one mask
            or one per piece) and ``J`` (symmetric; for an off-diagonal ``J`` it masks ``X``) (block sparsity of the
            distributed H-DNN, Theorem H2; build them with :func:`cde_nets.fields.locality.block_mask`).
        init_std: standard deviation of the Gaussian initialisation of ``K`` (default ``1/√n``); ``b`` starts 0.
    Shapes: ``y`` is ``(batch, n)``.
    """

    hamiltonian = True
    kind = "hamiltonian"

    # Buffers (register_buffer) and optional masks set in __init__, declared for the type checker.
    J_fixed: torch.Tensor
    K_mask: torch.Tensor | None
    J_mask: torch.Tensor | None

    def __init__(
        self,
        dim: int,
        layers: int = 1,
        T: float = 1.0,
        J: str | torch.Tensor = "canonical",
        K: str = "full",
        width: int | None = None,
        activation: str | Callable[[torch.Tensor], torch.Tensor] = "tanh",
        K_mask: torch.Tensor | None = None,
        J_mask: torch.Tensor | None = None,
        init_std: float | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(T=T, layers=layers)
        check_positive_int("dim", dim, "the state size")
        if width is not None:
            check_positive_int("width", width, "rows of K; leave it None for the default")
        init_std = check_init_std(init_std)
        self.dim = dim
        self.state_shape = (dim,)
        self.activation_name, self.sigma = resolve_activation(activation)
        std = 1.0 / math.sqrt(dim) if init_std is None else init_std
        normal = (lambda w: w.normal_(0.0, std, generator=generator)) if std > 0 else None

        self.width = self._init_K(dim, K, width, normal)
        self._init_J(dim, J, std, generator)
        self._init_masks(dim, K, layers, K_mask, J_mask)

        # Separable (p, q) structure: blockdiag K with J zero on its diagonal blocks (masking keeps them zero).
        self._separable = K == "blockdiag" and self.J_kind in ("canonical", "structured")
        if self._separable:
            self.split = (dim // 2, dim // 2)
            self.separable = True

    def _init_K(self, dim: int, K: str, width: int | None, normal: Callable | None) -> int:
        """The pieces of ``K`` and ``b`` (``"full"``: H1-DNN; ``"blockdiag"``: H2-DNN's ``K_p``, ``K_q``); returns
        the width ``m`` (rows of ``K``)."""
        if K not in ("full", "blockdiag"):
            raise ValueError(f"`K` must be 'full' (H1-DNN) or 'blockdiag' (H2-DNN), got {K!r}.")
        self.K_structure = K
        if K == "blockdiag":
            if dim % 2:
                raise ValueError(
                    f"`K='blockdiag'` splits y = (p, q) and needs an even `dim`, got {dim}; "
                    "augment the input with a zero feature."
                )
            m = width or dim // 2
            self.K_p = Pieces(self.grid, (m, dim // 2), init=normal)
            self.K_q = Pieces(self.grid, (m, dim // 2), init=normal)
            self.b_p = Pieces(self.grid, (m,))
            self.b_q = Pieces(self.grid, (m,))
        else:
            m = width or dim
            self.K = Pieces(self.grid, (m, dim), init=normal)
            self.b = Pieces(self.grid, (m,))
        return m

    def _init_J(self, dim: int, J: str | torch.Tensor, std: float, generator: torch.Generator | None) -> None:
        """``J``: a fixed skew tensor, the canonical one, or learned (``"structured"``: ``X``; ``"learned"``: ``S``)."""
        self.J_kind = J if isinstance(J, str) else "fixed"
        if isinstance(J, torch.Tensor):
            if tuple(J.shape) != (dim, dim):
                raise ValueError(f"`J` has shape {tuple(J.shape)}, expected ({dim}, {dim}).")
            if not J.is_floating_point() or not bool(torch.isfinite(J).all()):
                raise ValueError(
                    f"`J` must be a finite floating-point skew-symmetric matrix; it holds NaN/inf or is {J.dtype}."
                )
            skew = (J + J.T).abs().max().item()
            if skew > 1e-12 * max(1.0, J.abs().max().item()):
                raise ValueError(f"`J` must be skew-symmetric (J = -Jᵀ); max |J + Jᵀ| = {skew:.3g}. Use (A - A.T)/2.")
            self.register_buffer("J_fixed", J.clone().to(torch.get_default_dtype()))
        elif J == "canonical":
            self.register_buffer("J_fixed", canonical_J(dim))
        elif J == "structured":
            if dim % 2:
                raise ValueError(f"`J='structured'` needs an even `dim`, got {dim}; pad the state with a zero feature.")
            self.X = nn.Parameter(torch.eye(dim // 2))
        elif J == "learned":
            self.S = nn.Parameter(torch.zeros(dim, dim).normal_(0.0, std, generator=generator))
        else:
            raise ValueError(f"`J` must be 'canonical', 'structured', 'learned' or a skew tensor, got {J!r}.")

    def _init_masks(
        self, dim: int, K: str, layers: int, K_mask: torch.Tensor | None, J_mask: torch.Tensor | None
    ) -> None:
        """The sparsity masks of ``K`` (one for all pieces, or one per piece) and of ``J`` (symmetric)."""
        m = self.width
        if K_mask is not None:
            want = (m, dim) if K == "full" else (m, dim // 2)
            K_mask = torch.as_tensor(K_mask)
            if (
                tuple(K_mask.shape[-2:]) != want
                or K_mask.dim() not in (2, 3)
                or (K_mask.dim() == 3 and K_mask.shape[0] != layers)
            ):
                raise ValueError(
                    f"`K_mask` has shape {tuple(K_mask.shape)}, expected {want} or ({layers}, {want[0]}, {want[1]}) "
                    "(one mask per piece)"
                    + ("; with K='blockdiag' it applies to K_p and K_q alike." if K != "full" else ".")
                )
            self.register_buffer("K_mask", K_mask.to(torch.get_default_dtype()))
        else:
            self.K_mask = None
        if J_mask is not None:
            J_mask = torch.as_tensor(J_mask)
            if tuple(J_mask.shape) != (dim, dim):
                raise ValueError(f"`J_mask` has shape {tuple(J_mask.shape)}, expected ({dim}, {dim}).")
            if not torch.equal(J_mask, J_mask.T):
                raise ValueError("`J_mask` must be symmetric so that the masked J stays skew-symmetric.")
            self.register_buffer("J_mask", J_mask.to(torch.get_default_dtype()))
        else:
            self.J_mask = None

    # -- matrices ---------------------------------------------------------------------------------------
    @property
    def J(self) -> torch.Tensor:
        """The interconnection matrix (time-invariant), ``(n, n)``."""
        return self.memo("J", self._build_J)

    def _build_J(self) -> torch.Tensor:
        if self.J_kind in ("canonical", "fixed"):
            J = self.J_fixed
        elif self.J_kind == "structured":
            n = self.dim // 2
            Z = torch.zeros(n, n, dtype=self.X.dtype, device=self.X.device)
            J = torch.cat([torch.cat([Z, -self.X.T], 1), torch.cat([self.X, Z], 1)], 0)
        else:
            J = self.S - self.S.T
        return J if self.J_mask is None else J * self.J_mask

    def _mask_at(self, l: int) -> torch.Tensor | None:
        if self.K_mask is None:
            return None
        return self.K_mask[l] if self.K_mask.dim() == 3 else self.K_mask

    def K_at(self, l: int) -> torch.Tensor:
        """``K`` of piece ``l`` (block-diagonal assembled for H2, masks applied), ``(width_total, n)``."""
        return (
            torch.block_diag(self.K_half(l, 0), self.K_half(l, 1))
            if self.K_structure == "blockdiag"
            else (self.K_half(l, None))
        )

    def K_half(self, l: int, part: int | None) -> torch.Tensor:
        """Masked ``K`` (``part=None``), ``K_p`` (0) or ``K_q`` (1) of piece ``l``."""
        return self._masked(self.K if part is None else (self.K_p if part == 0 else self.K_q), l)

    def _masked(self, pieces: Pieces, l: int | None) -> torch.Tensor:
        """Piece ``l`` of ``pieces`` with ``K_mask`` applied (``l=None``: all pieces)."""
        K = pieces.data if l is None else pieces[l]
        mask = self.K_mask if l is None else self._mask_at(l)
        return K if mask is None else K * mask

    def b_at(self, l: int) -> torch.Tensor:
        return self.b[l] if self.K_structure == "full" else torch.cat([self.b_p[l], self.b_q[l]])

    def X_eff(self) -> torch.Tensor | None:
        """The (masked) ``X`` of ``J = [[0, −Xᵀ], [X, 0]]``; ``None`` when it is the identity."""
        return self.memo("X", self._build_X)

    def _build_X(self) -> torch.Tensor | None:
        n = self.dim // 2
        X = None if self.J_kind == "canonical" else self.X
        if self.J_mask is None:
            return X
        Mx = self.J_mask[n:, :n]
        return Mx * (torch.eye(n, dtype=Mx.dtype, device=Mx.device) if X is None else X)

    # -- field ------------------------------------------------------------------------------------------
    def grad_H(self, l: int, y: torch.Tensor) -> torch.Tensor:
        """``∂H/∂y = Kᵀ σ(K y + b)`` with piece ``l``; ``(batch, n)``."""
        if self.K_structure == "blockdiag":
            n = self.dim // 2
            return torch.cat([self._grad_half(l, y[..., :n], 0), self._grad_half(l, y[..., n:], 1)], -1)
        return self._dH(y, self.K_at(l), self.b[l])

    def _grad_half(self, l: int, z: torch.Tensor, part: int) -> torch.Tensor:
        return self._dH(z, self.K_half(l, part), self.b_p[l] if part == 0 else self.b_q[l])

    def _dH(self, z: torch.Tensor, K: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``Kᵀ σ(K z + b)`` for a batch of rows ``z`` (eq. H5's gradient)."""
        return self.sigma(torch.addmm(b, z, K.T)) @ K

    def piece_constants(self, l: int | None) -> tuple[Any, ...]:
        """``(K, b, Jᵀ)`` with the masks applied (H1, and block-diagonal ``K`` with a coupling ``J``); separable:
        ``(K_q, b_q, K_p, b_p, X)`` for the two halves of eqs. H12-13 (``X = None`` for the identity). Masks and
        the block-diagonal assembly only: the products keep the order of eq. H8, so values and gradients are
        those of the direct formula bit for bit."""

        def masked(pieces: Pieces) -> torch.Tensor:
            return self._masked(pieces, l)

        def piece(pieces: Pieces) -> torch.Tensor:
            return pieces.data if l is None else pieces[l]

        def shared(t: torch.Tensor | None) -> Any:
            return t if l is not None else Shared(t)

        if self._separable:
            return (masked(self.K_q), piece(self.b_q), masked(self.K_p), piece(self.b_p), shared(self.X_eff()))
        if self.K_structure == "full":
            K, b = masked(self.K), piece(self.b)
        else:  # block-diagonal K with a J that couples p and q (not separable)
            Kp, Kq = masked(self.K_p), masked(self.K_q)
            Z = Kp.new_zeros(Kp.shape)
            K = torch.cat([torch.cat([Kp, Z], -1), torch.cat([Z, Kq], -1)], -2)
            b = torch.cat([piece(self.b_p), piece(self.b_q)], -1)
        return (K, b, shared(self.memo("J.T", lambda: self.J.T)))

    def evaluate(self, l: int, y: torch.Tensor) -> torch.Tensor:
        if self._separable:
            n = self.dim // 2
            return torch.cat([self.evaluate_half(l, y[..., n:], 0), self.evaluate_half(l, y[..., :n], 1)], -1)
        K, b, JT = self.constants(l)
        return self._dH(y, K, b) @ JT

    def evaluate_part(self, l: int, y: torch.Tensor, part: int) -> torch.Tensor:
        """H2 halves (eq. H12-13): ``p' = −Xᵀ K_qᵀ σ(K_q q + b_q)`` (part 0), ``q' = X K_pᵀ σ(K_p p + b_p)``."""
        if not self._separable:
            return super().evaluate_part(l, y, part)
        n = self.dim // 2
        return self.evaluate_half(l, y[..., n:] if part == 0 else y[..., :n], part)

    def evaluate_half(self, l: int, z: torch.Tensor, part: int) -> torch.Tensor:
        """``p' = −Xᵀ K_qᵀ σ(K_q q + b_q)`` from ``z = q`` (part 0) or ``q' = X K_pᵀ σ(K_p p + b_p)`` from ``z = p``."""
        c = self.constants(l)
        K, b, X = (c[0], c[1], c[4]) if part == 0 else (c[2], c[3], c[4])
        g = self._dH(z, K, b)
        if part == 0:
            return -g if X is None else -(g @ X)
        return g if X is None else g @ X.T

    def energy(self, t: float | torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``H(y, t) = Σ_i σ̃((K(t) y + b(t))_i)`` per sample, ``(batch,)`` (eq. H5; tanh → log cosh)."""
        return self.energy_at(self.grid.index(t), y)

    def energy_at(self, l: int, y: torch.Tensor) -> torch.Tensor:
        if self.activation_name not in ANTIDERIVATIVES:
            raise NotImplementedError(
                f"energy needs an antiderivative of the activation; {self.activation_name!r} has none known. "
                f"Use one of {sorted(ANTIDERIVATIVES)}."
            )
        anti = ANTIDERIVATIVES[self.activation_name]
        z = y @ self.K_at(l).T + self.b_at(l)
        return anti(z).sum(-1)
