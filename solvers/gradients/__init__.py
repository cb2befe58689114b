"""Gradient methods as objects: how a solve's backward pass is computed.

``ODEBlock(field, gradient=Adjoint(rtol=1e-8))``, or a short name (``gradient="adjoint"``). Each method is one
class (:class:`GradientMethod`) registered in one line of :mod:`.registry`. Beside the classes sits the backward
machinery they call: the replays of a recorded step sequence (:mod:`.replay`, :mod:`.replay_controlled`, with the
recorded step sizes of :mod:`.step_sizes`), the continuous adjoints (:mod:`.rk_adjoint`, :mod:`.piecewise_adjoint`
with its per-piece parameter gradients :mod:`.piece_grads`), the discrete adjoint of the implicit methods
(:mod:`.implicit_adjoint`) and forward-mode tangents (:mod:`.tangents`).
"""

from .adjoint import Adjoint
from .backprop import Backprop
from .base import GradientMethod, Run
from .checkpoint import Checkpoint
from .forward import Forward
from .interpolating import Interpolating
from .quadrature import Gauss
from .registry import GRADIENTS, as_gradient, default_gradient, gradient_names
from .reversible import Reversible
from .symplectic import Symplectic

__all__ = [
    "GRADIENTS",
    "Adjoint",
    "Backprop",
    "Checkpoint",
    "Forward",
    "Gauss",
    "GradientMethod",
    "Interpolating",
    "Reversible",
    "Run",
    "Symplectic",
    "as_gradient",
    "default_gradient",
    "gradient_names",
]
