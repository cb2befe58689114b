"""Second- and higher-order depth (blog §8, Hauser §2.2): ``x' = v``, ``v' = −γ v + η f(x)``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cde_nets.fields.pieces import Pieces, TimeGrid
from cde_nets.solvers.errors import check_init_std, check_positive_int

from .base import Field

__all__ = ["SecondOrder", "PiecewiseMLP"]


def _softplus_inverse(x: float) -> float:
    return x + math.log(-math.expm1(-x))


class PiecewiseMLP(nn.Module):
    """``f_l(x) = W2_l tanh(W1_l LN(x) + c1_l) + c2_l``: the blog's time-varying one-hidden-layer update."""

    def __init__(
        self,
        grid: TimeGrid,
        dim: int,
        hidden: int,
        layer_norm: bool = False,
        init_std: float = 1.0,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        std = check_init_std(init_std)
        std = 1.0 if std is None else std
        s1, s2 = std / math.sqrt(dim), std / math.sqrt(hidden)
        self.W1 = Pieces(grid, (hidden, dim), init=lambda w: w.normal_(0, s1, generator=generator))
        self.c1 = Pieces(grid, (hidden,))
        self.W2 = Pieces(grid, (dim, hidden), init=lambda w: w.normal_(0, s2, generator=generator))
        self.c2 = Pieces(grid, (dim,))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False) if layer_norm else None

    def evaluate(self, l: int, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(x) if self.norm is not None else x
        return torch.addmm(self.c2[l], torch.tanh(torch.addmm(self.c1[l], z, self.W1[l].T)), self.W2[l].T)


class SecondOrder(Field):
    r"""Order-``k`` depth (B §8, S §2.2): state ``(x, x', ..., x^{(k−1)})`` held as one tensor
    ``(batch, k·dim)``, blocks of ``dim`` features in that order, and

    - ``k = 2`` (default): ``x' = v``, ``v' = −γ v + η f(x)``, the damped driven oscillator of the blog;
      ``split = (dim, dim)`` declares the ``(x, v)`` halves;
    - ``k >= 3``: ``q_1' = q_2, ..., q_{k−1}' = q_k``, ``q_k' = −γ q_k + η f(q_1)`` — the same damping on the
      last derivative (``damping=False`` drops it: Hauser's C^k chain ``q_k' = η f(q_1)``);
    - ``k = 1``: the plain first-order field ``x' = η f(x)`` (no damping).

    ``γ`` (damping) and ``η`` (drive) are per channel ``(dim,)``, time-invariant, and positive through a
    softplus of trained raw values; :attr:`gamma` and :attr:`eta` return the positive values.

    ``f``: any ``nn.Module`` mapping ``(batch, dim) -> (batch, dim)``. It is called as ``f.evaluate(l, x)``
    with the piece index ``l`` when it has an ``evaluate`` method (piece-aware, like the default), otherwise
    as ``f(x)``. Default: :class:`PiecewiseMLP`, the blog's time-varying one-hidden-layer update
    ``f_l(x) = W2_l tanh(W1_l LN(x) + c1_l) + c2_l`` of width ``hidden`` (default ``2·dim``), optional layer
    norm.

    Bridge to discrete mode (momentum / semi-implicit Euler, velocity first, on the velocity scaled by ``h``):
    with ``ṽ = h v``, ``ṽ_{l+1} = (1 − hγ) ṽ_l + h² η f_l(x_l)`` and ``x_{l+1} = x_l + ṽ_{l+1}`` — the blog's
    second-order residual block with ``m = 1 − hγ`` and ``η_blog = h² η`` (``0 < m < 1`` needs ``hγ < 1``).
    """

    kind = "second_order"

    # Parameters when learned, else buffers (register_buffer); gamma_raw is None without damping.
    gamma_raw: torch.Tensor | None
    eta_raw: torch.Tensor

    def __init__(
        self,
        dim: int,
        layers: int = 1,
        T: float = 1.0,
        f: nn.Module | None = None,
        order: int = 2,
        hidden: int | None = None,
        layer_norm: bool = False,
        gamma: float = 0.5,
        eta: float = 1.0,
        damping: bool = True,
        learn: bool = True,
        generator: torch.Generator | None = None,
    ):
        super().__init__(T=T, layers=layers)
        check_positive_int("dim", dim)
        check_positive_int("order", order, "1 = first order")
        if hidden is not None:
            check_positive_int("hidden", hidden, "width of the default f")
        for name, v in (("gamma", gamma), ("eta", eta)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"`{name}` must be a finite number > 0 (kept positive by a softplus), got {v!r}.")
        self.dim, self.k = dim, order
        self.order = order
        self.state_shape = (order * dim,)
        if order == 2:
            self.split = (dim, dim)
        self.f = (
            f if f is not None else PiecewiseMLP(self.grid, dim, hidden or 2 * dim, layer_norm, generator=generator)
        )
        self.damping = damping and order >= 2
        raw = lambda v: torch.full((dim,), _softplus_inverse(float(v)))  # noqa: E731
        if learn:
            self.gamma_raw = nn.Parameter(raw(gamma)) if self.damping else None
            self.eta_raw = nn.Parameter(raw(eta))
        else:
            self.register_buffer("gamma_raw", raw(gamma) if self.damping else None)
            self.register_buffer("eta_raw", raw(eta))

    @property
    def gamma(self) -> torch.Tensor:
        """Per-channel damping ``γ = softplus(γ_raw) > 0``, ``(dim,)`` (zeros without damping)."""
        if not self.damping:
            return torch.zeros_like(self.eta_raw)
        assert self.gamma_raw is not None  # built whenever damping is on
        return F.softplus(self.gamma_raw)

    @property
    def eta(self) -> torch.Tensor:
        """Per-channel drive ``η = softplus(η_raw) > 0``, ``(dim,)``."""
        return F.softplus(self.eta_raw)

    def drive(self, l: int, x: torch.Tensor) -> torch.Tensor:
        """``η f_l(x)``."""
        evaluate = getattr(self.f, "evaluate", None)  # a PiecewiseMLP, or any module with evaluate(l, x)
        fx = evaluate(l, x) if evaluate is not None else self.f(x)
        return self.eta * fx

    def _top(self, l: int, x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        out = self.drive(l, x)
        return out - self.gamma * last if self.damping else out

    def _check_width(self, y: torch.Tensor) -> None:
        if y.dim() != 2 or y.shape[1] != self.k * self.dim:
            raise ValueError(
                f"the state has shape {tuple(y.shape)}, but SecondOrder(dim={self.dim}, order={self.k}) "
                f"splits it into {self.k} blocks of {self.dim}: expected (batch, {self.k * self.dim}); "
                "concatenate (x, x', ...) along the features or build the field with matching dim/order."
            )

    def evaluate(self, l: int, y: torch.Tensor) -> torch.Tensor:
        """``F(y)`` for piece ``l``; ``y``: ``(batch, order·dim)``."""
        self._check_width(y)
        d = self.dim
        if self.k == 1:
            return self.drive(l, y)
        parts = [y[:, i * d : (i + 1) * d] for i in range(self.k)]
        return torch.cat(parts[1:] + [self._top(l, parts[0], parts[-1])], 1)

    def evaluate_part(self, l: int, y: torch.Tensor, part: int) -> torch.Tensor:
        """``x' = v`` (part 0) or ``v' = −γ v + η f(x)`` (part 1), each computed alone (order 2)."""
        if self.k != 2:
            return super().evaluate_part(l, y, part)
        self._check_width(y)
        x, v = y[:, : self.dim], y[:, self.dim :]
        return v if part == 0 else self._top(l, x, v)
