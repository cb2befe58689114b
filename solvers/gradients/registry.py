"""The gradient methods by short name: one line each. ``gradient="adjoint"`` means ``Adjoint()``."""

from __future__ import annotations

from .adjoint import Adjoint
from .backprop import Backprop
from .base import GradientMethod
from .checkpoint import Checkpoint
from .forward import Forward
from .reversible import Reversible
from .symplectic import Symplectic

__all__ = ["GRADIENTS", "as_gradient", "default_gradient", "gradient_names"]

GRADIENTS: dict[str, type[GradientMethod]] = {
    "adjoint": Adjoint,
    "backprop": Backprop,
    "checkpoint": Checkpoint,
    "symplectic": Symplectic,
    "reversible": Reversible,
    "forward": Forward,
}


def gradient_names(sde: bool = False) -> tuple[str, ...]:
    """The registered short names (those the SDE block serves, with ``sde``)."""
    return tuple(n for n, cls in GRADIENTS.items() if cls.sde or not sde)


def as_gradient(gradient: str | GradientMethod, sde: bool = False) -> GradientMethod:
    """The gradient method for a short name or an instance; a clear error for anything else."""
    names = gradient_names(sde)
    if isinstance(gradient, GradientMethod):
        if sde and not gradient.sde:
            raise ValueError(f"the SDE block's `gradient` must be one of {names}, got {gradient!r}.")
        return gradient
    if isinstance(gradient, str) and gradient in names:
        return GRADIENTS[gradient]()
    raise ValueError(
        f"`gradient` must be one of {names} or a gradient method object (e.g. Adjoint(rtol=1e-8)), got {gradient!r}."
    )


def default_gradient(method: str) -> GradientMethod:
    """The gradient a block uses when none is named: the exact gradient of the solver's steps by checkpointed
    replay where ``method`` can be replayed (every explicit Runge-Kutta method, the implicit and composition
    methods), the reversible one for ``alf``, else the continuous adjoint. On the ode_demo spiral the adjoint
    trained 4.9x slower than checkpointing to the same loss (docs/guides/from_torchdiffeq.md)."""
    for candidate in (Checkpoint(), Reversible()):
        if candidate.supports(method):
            return candidate
    return Adjoint()
