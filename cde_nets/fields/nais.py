"""The non-autonomous NAIS field ``x' = σ(A x + B u + b)``, ``A = −RᵀR − εI`` (Ciccone et al., eqs. N3, N13)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cde_nets.fields.pieces import Pieces
from cde_nets.solvers.errors import check_init_std, check_odd_kernel_size, check_positive, check_positive_int

from .activations import DERIVATIVES, resolve_activation
from .base import Field

__all__ = ["NAIS", "NAISConv"]


class _Input(Field):
    """A field driven by a per-sample block input ``u``, passed with every call: ``forward(t, x, u)``,
    ``evaluate(l, x, u)``. Nothing is stored on the module, so gradients reach ``u`` in every mode."""

    needs_input = True
    kind = "nais"

    def _check_batch(self, x: torch.Tensor, u: torch.Tensor) -> None:
        if u.shape[0] != x.shape[0]:
            raise ValueError(
                f"`u` has batch {u.shape[0]} but the state has batch {x.shape[0]}; pass the input of this batch."
            )


class NAIS(_Input):
    r"""``x' = σ(A x + B u + b)`` with ``A = −RᵀR − εI`` (eq. N13); its forward-Euler step is the NAIS-Net
    block (eq. N3) ``x(k+1) = x(k) + h σ(A x(k) + B u + b)``. ``u`` is ``(batch, input_dim)``; ``x`` is
    ``(batch, dim)``.

    The block input travels with each call: ``field(t, x, u)``; blocks pass it on (``block(x0, u=u)``).
    ``R``, ``B``, ``b`` are :class:`~cde_nets.fields.pieces.Pieces` (``layers = 1``: the
    time-invariant block of the paper).

    ``delta`` is Alg. N1's bound on ``‖RᵀR‖_F``: default ``1 − 2ε`` (Theorem N2: Condition N1 for ``h <= 1``
    and a critically damped, oscillation-free Jacobian); any value up to ``2(1 − ε)`` still keeps the spectral
    radius of ``I + h σ' A`` below 1 for ``h <= 1``, since ``σ' ∈ (0, 1]`` and ``A``'s eigenvalues lie in
    ``[−δ − ε, −ε]``. Call :meth:`project_` after every optimiser step.
    """

    eye: torch.Tensor  # buffer: the identity, for −εI − RᵀR in one kernel

    def __init__(
        self,
        dim: int,
        input_dim: int,
        layers: int = 1,
        T: float = 1.0,
        eps: float = 0.01,
        activation: str = "tanh",
        delta: float | None = None,
        init_std: float | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(T=T, layers=layers)
        for name, v in (("dim", dim), ("input_dim", input_dim)):
            check_positive_int(name, v)
        if not 0 < eps < 0.5:
            raise ValueError(f"`eps` must lie in (0, 0.5) (Alg. N1: δ = 1 − 2ε), got {eps!r}.")
        delta = 1.0 - 2.0 * eps if delta is None else float(delta)
        if not 0 < delta <= 2.0 * (1.0 - eps):
            raise ValueError(
                f"`delta` must lie in (0, 2(1 − eps)] = (0, {2 * (1 - eps):g}] for Condition N1 with "
                f"h <= 1, got {delta!r}; leave it None for the critically damped 1 − 2 eps."
            )
        self.dim, self.input_dim, self.eps, self.delta = dim, input_dim, float(eps), delta
        self.state_shape, self.input_shape = (dim,), (input_dim,)
        self.activation_name, self.sigma = resolve_activation(activation)
        init_std = check_init_std(init_std)
        std = 1.0 / math.sqrt(dim) if init_std is None else init_std
        normal = lambda w: w.normal_(0, std, generator=generator)  # noqa: E731
        self.R = Pieces(self.grid, (dim, dim), init=normal)
        self.B = Pieces(
            self.grid,
            (dim, input_dim),
            init=lambda w: w.normal_(0, 1 / math.sqrt(input_dim), generator=generator),
        )
        self.b = Pieces(self.grid, (dim,))
        self.register_buffer("eye", torch.eye(dim), persistent=False)

    def piece_constants(self, l: int | None) -> tuple[torch.Tensor, ...]:
        """``(Aᵀ, Bᵀ, b)`` with ``A = −RᵀR − εI`` (eq. N13), built once per call of a block."""
        R, B, b = (self.R.data, self.B.data, self.b.data) if l is None else (self.R[l], self.B[l], self.b[l])
        # −ε I − RᵀR in one kernel: beta scales the identity (exact in every dtype)
        if l is None:  # the batched product may round differently from the one-piece one (last bit)
            A = torch.baddbmm(self.eye.expand(R.shape), R.mT, R, beta=-self.eps, alpha=-1.0)
        else:
            A = torch.addmm(self.eye, R.T, R, beta=-self.eps, alpha=-1.0)
        return (A.mT, B.mT, b)

    def A(self, l: int) -> torch.Tensor:
        """``A_l = −R_lᵀR_l − εI`` (eq. N13)."""
        return self.constants(l)[0].mT

    def preactivation(self, l: int, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        self._check_batch(x, u)
        AT, BT, b = self.constants(l)
        # B u + b is constant over the block's steps (for the rows in play): once per call and compaction
        drive = self.memo(("Bu+b", l, u), lambda: torch.addmm(b, u, BT))
        return torch.addmm(drive, x, AT)

    def evaluate(self, l: int, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.sigma(self.preactivation(l, x, u))

    @torch.no_grad()
    def project_(self) -> NAIS:
        """Alg. N1: if ``‖RᵀR‖_F > δ`` then ``R ← √δ R / √‖RᵀR‖_F``, per piece, in place (no autograd).

        Idempotent (a projected ``R`` is left bitwise unchanged), so it is safe to call after every optimiser
        step. Returns the field.
        """
        delta = self.delta
        # a projected R must not be rescaled again by rounding
        slack = 1.0 + 16 * torch.finfo(self.R.data.dtype).eps
        for l in range(self.layers):
            R = self.R.data[l]
            norm = torch.linalg.matrix_norm(R.T @ R)
            if norm > delta * slack:
                R.mul_(math.sqrt(delta) / torch.sqrt(norm))
        return self

    @torch.no_grad()
    def contracts_everywhere(self, h: float | None = None) -> bool:
        """Whether Condition N1 holds at every state and input, by the weights alone: ``h (‖R_lᵀR_l‖_F + ε) < 2``
        for every piece ``l``. For ``σ' ∈ (0, 1]`` the eigenvalues of ``σ' A`` (similar to the symmetric
        ``σ'^½ A σ'^½``) lie in ``[−‖RᵀR‖₂ − ε, 0)``, so those of ``I + h σ' A`` lie in ``(−1, 1)`` (eq. N8). A
        sufficient bound, one small product per piece; :meth:`stability_margin` measures the condition on a
        batch."""
        h = self.grid.h if h is None else check_positive("h", h, "It is the step of the Euler block.")
        R = self.R.data
        largest = float(torch.linalg.matrix_norm(R.mT @ R).max())
        return h * (largest + self.eps) < 2.0

    @torch.no_grad()
    def stability_margin(self, x: torch.Tensor, u: torch.Tensor, h: float | None = None, l: int = 0) -> float:
        """Condition N1 (eq. N8) checked on a batch: ``max_x ρ(I + h σ'(A x + B u + b) A)``.

        ``x``: ``(batch, dim)``; ``u``: ``(batch, input_dim)``; ``h``: the step (default the grid's
        ``T / layers``); ``l``: the piece. The eigenvalues of the batch of Jacobians (eq. N6) come from one batched
        ``torch.linalg.eigvals``. Below 1
        the forward-Euler block contracts towards its input-dependent equilibrium at every ``x`` of the batch.
        """
        if self.activation_name not in DERIVATIVES:
            raise NotImplementedError(f"no derivative known for activation {self.activation_name!r}.")
        h = self.grid.h if h is None else check_positive("h", h, "It is the step of the Euler block.")
        self.check_state(x, "x")
        D = DERIVATIVES[self.activation_name](self.preactivation(l, x, u))
        M = torch.eye(self.dim, dtype=x.dtype, device=x.device) + h * D[:, :, None] * self.A(l)[None]
        return float(torch.linalg.eigvals(M).abs().max())


class NAISConv(_Input):
    r"""Convolutional NAIS: ``x' = σ(C ⋆ x + D ⋆ u + b)`` with a same-size, zero-padded ``C`` kept stable by
    Alg. N2.

    ``x`` and ``u`` are ``(batch, channels, H, W)`` (same size). The centre tap of each channel's own filter
    is ``C^c_centre = −1 − δ_c`` with ``δ_c`` trainable (``|δ_c| <= 1 − η``): the kernel is assembled from
    ``δ`` at every evaluation, so ``δ`` receives gradients and the stored centre taps of ``C`` are unused.
    Alg. N2 (:meth:`project_`) clamps ``δ_c`` and scales the channel's other taps (all input channels) so that
    their absolute sum is at most ``1 − ε − |δ_c|``: by Gershgorin every eigenvalue of the Jacobian
    ``I + h σ'(·) A`` (Lemma N1) then lies in the unit disc for ``h <= 1`` (Condition N1, Theorem N3).
    """

    centre: torch.Tensor  # buffer: 1 at each channel's own centre tap

    def __init__(
        self,
        channels: int,
        layers: int = 1,
        T: float = 1.0,
        kernel_size: int = 3,
        eps: float = 0.01,
        eta: float = 0.05,
        activation: str = "tanh",
        generator: torch.Generator | None = None,
    ):
        super().__init__(T=T, layers=layers)
        check_positive_int("channels", channels)
        if not 0 < eps < eta < 1:
            raise ValueError(f"Alg. N2 needs 0 < eps < eta < 1, got eps={eps!r}, eta={eta!r}.")
        check_odd_kernel_size(kernel_size)
        self.channels, self.k, self.eps, self.eta = channels, kernel_size, float(eps), float(eta)
        self.state_shape = self.input_shape = (channels, None, None)
        self.activation_name, self.sigma = resolve_activation(activation)
        std = 1.0 / math.sqrt(channels * kernel_size**2)
        normal = lambda w: w.normal_(0, std, generator=generator)  # noqa: E731
        self.C = Pieces(self.grid, (channels, channels, kernel_size, kernel_size), init=normal)
        self.D = Pieces(self.grid, (channels, channels, kernel_size, kernel_size), init=normal)
        self.delta = Pieces(self.grid, (channels,))
        self.b = Pieces(self.grid, (channels,))
        centre = torch.zeros(channels, channels, kernel_size, kernel_size)
        centre[range(channels), range(channels), kernel_size // 2, kernel_size // 2] = 1.0
        self.register_buffer("centre", centre, persistent=False)
        self.project_()

    def piece_constants(self, l: int | None) -> tuple[torch.Tensor, ...]:
        """``(C, D, b)`` with ``C``'s centre taps ``−1 − δ_c``, built once per call of a block."""
        C, D, b, delta = (
            (self.C.data, self.D.data, self.b.data, self.delta.data)
            if l is None
            else (self.C[l], self.D[l], self.b[l], self.delta[l])
        )
        c = self.centre.to(C.dtype)
        return (C * (1 - c) - c * (1 + delta)[..., None, None, None], D, b)

    def kernel(self, l: int) -> torch.Tensor:
        """``C`` of piece ``l`` with the centre taps ``−1 − δ_c``: ``(channels, channels, k, k)``."""
        return self.constants(l)[0]

    def evaluate(self, l: int, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        self._check_batch(x, u)
        if u.shape[2:] != x.shape[2:]:
            raise ValueError(
                f"`u` has spatial size {tuple(u.shape[2:])} but the state has "
                f"{tuple(x.shape[2:])}; pass an input of the state's size."
            )
        pad = self.k // 2
        C, D, b = self.constants(l)
        drive = self.memo(("D*u+b", l, u), lambda: F.conv2d(u, D, b, padding=pad))
        return self.sigma(F.conv2d(x, C, padding=pad) + drive)

    @torch.no_grad()
    def project_(self) -> NAISConv:
        """Alg. N2 per piece and output channel, in place: ``δ_c ← clamp(δ_c, −1 + η, 1 − η)``, centre tap
        ``−1 − δ_c``, other taps scaled to an absolute sum ``<= 1 − ε − |δ_c|``. Idempotent; returns the
        field."""
        m = self.k // 2
        # a projected kernel must not be rescaled again by rounding
        slack = 1.0 + 16 * torch.finfo(self.C.data.dtype).eps
        off = (1 - self.centre).bool()
        for l in range(self.layers):
            C, d = self.C.data[l], self.delta.data[l]
            d.clamp_(-1 + self.eta, 1 - self.eta)
            for c in range(self.channels):
                C[c, c, m, m] = -1 - d[c]
                total = C[c][off[c]].abs().sum()
                budget = 1 - self.eps - d[c].abs()
                if total > budget * slack:
                    C[c][off[c]] = C[c][off[c]] * (budget / total)
        return self
