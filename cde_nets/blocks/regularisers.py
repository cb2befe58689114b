r"""Trajectory regularisers on the blocks: :class:`~cde_nets.ODEBlock` and :class:`~cde_nets.DiscreteNet` with
``regularisers=``.

Continuous mode (RNODE, Finlay et al. 2020, eqs. 4-5; TayNODE, Kelly et al. 2020, eq. 3): the block's state
``y`` (``(batch, *shape)``) is integrated with one integral per regulariser, ``r' = g(t, y)``, ``r(0) = 0``,

- ``"kinetic"``: ``g = ‖F(t, y)‖²``;
- ``"jacobian"``: ``g = ‖εᵀ ∂F/∂y‖²`` with one probe ``ε`` per solve (Hutchinson: ``E[g] = ‖∂F/∂y‖²_F``);
- ``"taylor2"``: ``g = ‖∂F/∂t + (∂F/∂y) F‖² = ‖d²y/dt²‖²``;

as one flat state ``(batch, n + k)`` through the block's own solve, so every gradient method, piecewise field
and block input works unchanged, and the adaptive steps are controlled on the ``n`` columns of ``y`` alone: the
same steps as the unregularised block.

Discrete mode: an explicit Runge-Kutta layer ``y_{l+1} = y_l + h Σ_i b_i F(Y_i)`` applied to the same augmented
state gives ``r_{l+1} = r_l + h Σ_i b_i g(Y_i)`` — for forward Euler (a ResNet block) the Riemann sums
``Σ_l h ‖F(y_l)‖²`` and ``Σ_l h ‖∂F/∂y(y_l)‖²_F`` of the continuous integrals, at no extra field evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cde_nets.regularisers import NOISES, AugmentedCall, AugmentedField, check_regularisers, draw_probe

__all__ = ["Regularisation", "TrajectoryRegularisers", "AugmentedBound", "DiscreteIntegrands"]


@dataclass(frozen=True)
class Regularisation:
    """How an :class:`~cde_nets.ODEBlock` regularises training, beside its solve: ``ODEBlock(field,
    regularisation=Regularisation(("kinetic",)))``.

    ``regularisers``: names from ``("kinetic", "jacobian", "taylor2")``, the integrals ``∫‖F‖²``,
    ``∫‖∂F/∂y‖²_F`` (Hutchinson, one probe per solve) and ``∫‖d²y/dt²‖²`` (RNODE, Finlay et al. 2020, eqs. 4-5;
    TayNODE, Kelly et al. 2020, eq. 3) integrated with the state in the same solve; ``noise``: the distribution
    of Hutchinson's probe (``"gaussian"``, the default, or ``"rademacher"``; only with ``"jacobian"``);
    ``steer``: ``b`` of STEER's random end time ``T + U(−b, b)`` in training mode (Ghosh et al. 2020, §3),
    ``0 <= b < T``. The block checks them against its field and solver when it is built."""

    regularisers: Sequence[str] = ()
    noise: str | None = None
    steer: float = 0.0


class TrajectoryRegularisers:
    """The regularisers a block integrates (names checked once) and Hutchinson's probe distribution."""

    def __init__(self, names: Sequence[str], noise: str | None):
        self.names = check_regularisers(names)
        if noise is not None and noise not in NOISES:
            raise ValueError(f"`noise` must be one of {NOISES}, got {noise!r}.")
        if noise is not None and "jacobian" not in self.names:
            raise ValueError(
                f"`noise`={noise!r} draws Hutchinson's probe of the 'jacobian' regulariser, which this block does "
                f"not integrate (regularisers={self.names!r}); drop `noise` or add 'jacobian'."
            )
        self.noise = noise or "gaussian"

    def __bool__(self) -> bool:
        return bool(self.names)

    def augment(self, bound: Any, y0: torch.Tensor) -> tuple[AugmentedBound, torch.Tensor]:
        """The bound field over the flat state ``[y.flatten(1), r]`` and its start ``[y0, 0]``."""
        aug = AugmentedField(_Call(bound), None, self.names)
        call = aug.bind(draw_probe(y0, self.noise) if aug.needs_probe else None)
        n, k = y0[0].numel(), len(self.names)
        Y0 = torch.cat([y0.reshape(y0.shape[0], n), y0.new_zeros(y0.shape[0], k)], 1)
        return AugmentedBound(bound, call, y0.shape[1:], n), Y0

    def split(self, Ys: torch.Tensor, shape: torch.Size, sign: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The states ``(len(t), *shape)`` and each integral's batch mean at the last time; ``sign = −1`` for a
        solve over decreasing times, whose integrals of the non-negative integrands come out negated."""
        n = shape[1:].numel()
        ys = Ys[..., :n].reshape(Ys.shape[:1] + shape)
        return ys, {name: sign * Ys[-1, :, n + i].mean() for i, name in enumerate(self.names)}


class AugmentedBound:
    """``(t, [y, r]) ↦ [F(t, y), g(t, y)]`` on the flat state; ``u`` is the bound field's block input (the block
    differentiates it), :meth:`norm` the RMS error norm over the columns of ``y`` alone (torchdiffeq's default
    norm, restricted: the integrals feed nothing back, and their error would only add steps)."""

    def __init__(self, bound: Any, aug: AugmentedCall, shape: torch.Size, n: int):
        self.bound, self.aug, self.shape, self.n = bound, aug, shape, n
        self.u = getattr(bound, "u", None)

    def __call__(self, t: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
        n = self.n
        out = self.aug(t, (Y[:, :n].reshape(Y.shape[:1] + self.shape), *Y[:, n:].unbind(1)))
        return torch.cat([out[0].reshape(Y.shape[0], n), torch.stack(out[1:], 1)], 1)

    def norm(self, err: torch.Tensor) -> torch.Tensor:
        return err[:, : self.n].square().mean().sqrt()


class _Call(torch.nn.Module):
    """A field bound to its call (not a module) seen as a module, so :class:`AugmentedField` can hold it."""

    _field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __init__(self, field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        object.__setattr__(self, "_field", field)  # not a submodule: the block holds the parameters

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._field(t, y)


class DiscreteIntegrands:
    """A bound field that, at each stage evaluation ``F(Y_i)`` of an explicit Runge-Kutta layer, adds
    ``h b_i g(Y_i)`` to each regulariser's per-sample sum (the layer applied to the integrals ``r' = g``).

    Schemes call ``evaluate(l, y, t=...)`` once per stage, in stage order; ``weights`` are the ``b_i``. Only
    ``"kinetic"`` and ``"jacobian"``: a layer's field is constant in time on its piece, so the second derivative
    along a layer is ``(∂F/∂y) F`` alone, which is not the discrete trajectory's.
    """

    def __init__(self, bound: Any, regs: TrajectoryRegularisers, weights: Sequence[float], h: float, y0: torch.Tensor):
        self.bound, self.weights, self.h, self.names = bound, tuple(weights), h, regs.names
        self.probe = draw_probe(y0, regs.noise) if "jacobian" in regs.names else None
        self.sums: list[torch.Tensor] = [y0.new_zeros(y0.shape[0]) for _ in regs.names]
        self.stage = 0

    def evaluate(self, l: int, y: torch.Tensor, t: float | None = None) -> torch.Tensor:
        hb = self.h * self.weights[self.stage % len(self.weights)]
        self.stage += 1
        graph = torch.is_grad_enabled()
        with torch.enable_grad():
            if self.probe is not None and (not graph or not y.requires_grad):
                y = y.detach().requires_grad_(True)
            F = self.bound.evaluate(l, y, t=t)
            for i, name in enumerate(self.names):
                if name == "kinetic":
                    g = F.square().flatten(1).sum(1)
                else:
                    (vjp,) = torch.autograd.grad(F, y, self.probe, create_graph=graph, retain_graph=True)
                    g = vjp.square().flatten(1).sum(1)
                self.sums[i] = self.sums[i] + hb * (g if graph else g.detach())
        return F if graph else F.detach()

    def means(self) -> dict[str, torch.Tensor]:
        return {name: r.mean() for name, r in zip(self.names, self.sums)}

    def __getattr__(self, name: str) -> Any:
        if name == "bound":
            raise AttributeError(name)
        return getattr(self.bound, name)
