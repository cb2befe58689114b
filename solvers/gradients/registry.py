"""The gradient methods by short name: one line each. ``gradient="adjoint"`` means ``Adjoint()``."""

from __future__ import annotations

from ..options import OWN_FIXED_METHODS
from ..steppers.tableaux import TABLEAUX
from .adjoint import Adjoint
from .backprop import Backprop
from .base import GradientMethod
from .checkpoint import Checkpoint
from .forward import Forward
from .interpolating import Interpolating
from .quadrature import Gauss
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
    "interpolating": Interpolating,
    "gauss": Gauss,
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


# Backprop's graph, in the units of the rule of default_gradient: bytes of the state times the field evaluations,
# fixed steps counted, adaptive ones assumed (a solve cannot know them before it steps).
GRAPH_BUDGET = 64 * 2**20
ASSUMED_ADAPTIVE_STEPS = 100


def default_gradient(method: str, state_bytes: int | None = None, steps: int | None = None) -> GradientMethod:
    """The gradient a block uses when none is named, chosen per call from the solve's size.

    Every candidate is exact for the solver's steps; they differ in time and memory. Backpropagation through the
    steps (:class:`Backprop`) keeps each field evaluation's graph, about ``k · E · S`` bytes for ``E``
    evaluations of a state of ``S`` bytes, ``k`` the field's saved tensors per evaluation in units of the state
    (measured 2 for a convolution to 39 for a 2-64-2 MLP); checkpointed replay (:class:`Checkpoint`, Zhuang et
    al. 2020, "Adaptive checkpoint adjoint method") keeps one state per step and recomputes each step in the
    backward pass. For an explicit Runge-Kutta method of ``s`` stages the rule is

        ``Backprop()`` if ``S · s · n <= 64 MiB``, else ``Checkpoint()``,

    with ``n`` the steps: ``steps`` for fixed-step methods, 100 for adaptive ones (a solve does not know its
    steps before it takes them; a longer adaptive solve keeps a proportionally larger graph). Measured (one
    thread, CPU time, benchmarks/default_gradient.py): backprop is 1.2-1.9x faster than checkpointing from the
    ode_demo spiral to an MLP of 64 x 256 per batch of 256, where its graph is at most 14 MiB; for a
    convolutional field on 16 x 28 x 28 maps, batch 64, checkpointing took 0.98x backprop's time at dopri5 and
    1.40x at rk4 with a fifth of its memory (98 against 493 MiB). Without ``state_bytes`` (the size unknown),
    and for the implicit and composition methods, the checkpointed replay as before; the reversible gradient
    for ``alf``; else the continuous adjoint. The rule reads shapes only: no solve, no synchronisation, the
    same choice for every call of the same shapes. A block asks for it only where backprop would run on the
    library's own stepper, which differentiates every step size (increasing times, a float32/float64 state);
    elsewhere torchdiffeq's backprop would hold the sizes fixed, and the block keeps the replay."""
    tab = TABLEAUX.get(method)
    if state_bytes is not None and tab is not None and tab.continuous and method not in OWN_FIXED_METHODS:
        n = ASSUMED_ADAPTIVE_STEPS if steps is None else steps
        if state_bytes * len(tab.tableau.b) * n <= GRAPH_BUDGET:
            return Backprop()
    for candidate in (Checkpoint(), Reversible()):
        if candidate.supports(method):
            return candidate
    return Adjoint()
