r"""Continuous normalizing flows: the density law of a field (Ruseckas eq. R28) as a model (FFJORD).

A field ``F`` carries data ``x = z(0)`` to ``z(T)``, compared with a standard normal base density. Along the
flow ``d log p(z(t))/dt = −Tr ∂F/∂z`` (Ruseckas eq. R28; Chen et al. 2018, Theorem 1; Grathwohl et al. 2019,
eq. 4), so with ``ℓ(t) = ∫₀ᵗ Tr ∂F/∂z ds``

    log p(x) = log N(z(T); 0, I) + ℓ(T),

the change-of-variables formula ``log p(x) = log N(φ(x)) + log |det ∂φ/∂x|`` for the flow map ``φ`` (Liouville:
``log det ∂φ/∂x = ∫ Tr ∂F/∂z``). The trace is exact (``dim`` reverse passes) or Hutchinson's unbiased estimate
``εᵀ (∂F/∂z) ε`` with one Gaussian or Rademacher probe drawn per solve (FFJORD §3.1). Sampling solves the field
backwards from ``z(T) ~ N(0, I)``. The regularisers of :mod:`cde_nets.regularisers` (kinetic energy, Jacobian
Frobenius norm, TayNODE's second derivative) are integrated in the same solve (RNODE, Finlay et al. 2020).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from cde_nets.blocks.collected_terms import report
from cde_nets.blocks.compile_boundary import eager_under_compile
from cde_nets.blocks.solution import Solution
from cde_nets.functional import odeint
from cde_nets.regularisers import AugmentedField, check_flow_settings, draw_probe, integrate_augmented, steer_time

from .solvers.counting import SolverStats
from .solvers.errors import check_finite
from .solvers.gradients import Backprop, GradientMethod, as_gradient
from .solvers.transforms import under_vmap

__all__ = ["ContinuousFlow", "standard_normal_log_prob", "bits_per_dim"]


def standard_normal_log_prob(z: torch.Tensor) -> torch.Tensor:
    """``log N(z; 0, I)`` per sample: ``−½‖z‖² − (d/2) log 2π``, ``z`` of shape ``(batch, *dims)``."""
    d = z[0].numel()
    return -0.5 * z.square().flatten(1).sum(1) - 0.5 * d * math.log(2 * math.pi)


def bits_per_dim(log_prob: torch.Tensor, dim: int, levels: int) -> torch.Tensor:
    """Bits per dimension of dequantised data ``y = (k + u)/L`` in ``[0, 1)^d`` (:func:`cde_nets.datasets.dequantize`):
    ``(−log p(y)/d + log L)/log 2``, an upper bound on the discrete model's (Theis et al. 2016, eq. 10)."""
    return (-log_prob / dim + math.log(levels)) / math.log(2)


class ContinuousFlow(nn.Module):
    """A continuous normalizing flow over ``field(t, z)`` (any module with that signature), data of shape
    ``(batch, dim)`` (or ``(batch, *dims)`` with ``trace="hutchinson"``).

    Args:
        field: the vector field ``F(t, z)``; samples must not interact through it.
        T: end time of the flow.
        trace: ``"exact"`` (small dimensions) or ``"hutchinson"``.
        noise: Hutchinson's probe, ``"gaussian"`` or ``"rademacher"``, drawn once per solve.
        regularisers: names from ``("kinetic", "jacobian", "taylor2")`` integrated with the flow: :meth:`transform`
            returns them per sample, and every :meth:`log_prob` reports their batch means (in the graph) into the
            open :func:`~cde_nets.integrated_terms` collections, as the blocks do.
        steer: ``b`` of STEER's random end time ``U(T − b, T + b)`` in training mode (0: off).
        method, rtol, atol, options: the solver, as in :func:`cde_nets.odeint`.
        gradient: ``"backprop"``, ``"adjoint"``, ``"checkpoint"``, ``"symplectic"`` or a gradient-method object.

    ``forward(x)`` is :meth:`log_prob`. The flow keeps nothing between calls: a call's forward field evaluations
    and regularisers reach the caller through ``with integrated_terms() as terms:`` (``terms.nfe_forward``,
    ``terms["kinetic"]``).
    """

    def __init__(
        self,
        field: nn.Module,
        T: float = 1.0,
        *,
        trace: str = "exact",
        noise: str = "gaussian",
        regularisers: Sequence[str] = (),
        steer: float = 0.0,
        method: str = "dopri5",
        rtol: float = 1e-5,
        atol: float = 1e-5,
        options: dict | None = None,
        gradient: str | GradientMethod = "backprop",
    ):
        super().__init__()
        if trace not in ("exact", "hutchinson"):
            raise ValueError(f"`trace` must be 'exact' or 'hutchinson', got {trace!r}.")
        check_flow_settings(T, noise, steer)
        self.aug = AugmentedField(field, trace, regularisers)
        self.T, self.noise, self.steer = float(T), noise, float(steer)
        self.method, self.rtol, self.atol, self.options, self.gradient = method, rtol, atol, options, gradient

    @property
    def field(self) -> nn.Module:
        """The vector field ``F(t, z)`` (held once, inside :attr:`aug`)."""
        return self.aug.field

    @property
    def regularisers(self) -> tuple[str, ...]:
        return self.aug.regularisers

    def _params(self) -> tuple[torch.Tensor, ...]:
        return tuple(p for p in self.field.parameters() if p.requires_grad)

    def transform(
        self, x: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(z(T), ℓ(T), regularisers)`` per sample: the flow map, ``log |det ∂φ/∂x|`` and the integrals."""
        z, logdet, regs, _ = self._transform(x, generator)
        return z, logdet, regs

    # the adaptive loop is data-dependent control flow: under torch.compile the solve runs eagerly (one graph
    # break) and the model around it is compiled, as for the blocks
    @eager_under_compile
    def _transform(
        self, x: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int]:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
            raise ValueError("`x` must be a floating-point tensor of shape (batch, dim).")
        if under_vmap():
            raise ValueError(
                "ContinuousFlow under torch.vmap: its trace estimator differentiates the field inside the solve "
                "with torch.autograd, which torch.func refuses. Pass the instances as one batch `(batch, dim)`."
            )
        check_finite("x", x.detach())
        zero = x.new_zeros(x.shape[0])
        call = self.aug.bind(draw_probe(x, self.noise, generator) if self.aug.needs_probe else None)
        t = torch.stack([zero.new_zeros(()), steer_time(self.T, self.steer, self.training, x)])
        state = (x, zero, *[zero] * len(self.regularisers))
        out, nfe = integrate_augmented(
            call, state, t, method=self.method, rtol=self.rtol, atol=self.atol, options=self.options,
            gradient=self.gradient, params=self._params(),
        )  # fmt: skip
        return out[0], out[1], dict(zip(self.regularisers, out[2:])), nfe

    def log_prob(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``log p(x) = log N(z(T)) + ∫₀ᵀ Tr ∂F/∂z dt`` per sample ``(batch,)``; ``generator`` draws the probe."""
        z, logdet, regs, nfe = self._transform(x, generator)
        means = {k: v.mean() for k, v in regs.items()}
        report(Solution(y=z, stats=SolverStats(nfe_forward=nfe), regularisation=means))
        return standard_normal_log_prob(z) + logdet

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log_prob(x)

    @eager_under_compile
    def sample(
        self,
        n: int,
        *,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shape: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """``n`` samples ``x = φ⁻¹(z)``, ``z ~ N(0, I)``: the field solved from ``T`` back to 0.

        ``dtype``/``device`` default to the field's parameters'; ``shape`` (one sample's) defaults to the field's
        ``state_shape`` where it declares one (a plain module declares none: pass ``shape``).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"`n` must be a positive int, got {n!r}.")
        ref = next(iter(self.field.parameters()), None)
        dtype = dtype or (ref.dtype if ref is not None else torch.get_default_dtype())
        device = device or (ref.device if ref is not None else None)
        shape = tuple(shape) if shape is not None else getattr(self.field, "state_shape", None)
        if not shape or not all(isinstance(d, int) for d in shape):
            raise ValueError(
                f"pass `shape`, one sample's shape (e.g. shape=(2,)): {type(self.field).__name__} declares no "
                "`state_shape` to sample in."
            )
        z = torch.randn((n, *shape), dtype=dtype, device=device, generator=generator)
        t = torch.tensor([self.T, 0.0], dtype=dtype, device=device)
        kw: dict = dict(rtol=self.rtol, atol=self.atol, method=self.method, options=self.options)
        if not isinstance(as_gradient(self.gradient), Backprop):
            kw.update(gradient=self.gradient, adjoint_params=self._params())
        return odeint(self.field, z, t, **kw)[-1]
