"""Gradient methods as objects: how a solve's backward pass is computed.

``ODEBlock(field, gradient=Adjoint(rtol=1e-8))``, or a short name (``gradient="adjoint"``). Each method is one
class (:class:`GradientMethod`) registered in one line of :mod:`.registry`.
"""

from .adjoint import Adjoint
from .backprop import Backprop
from .base import GradientMethod, Run
from .checkpoint import Checkpoint
from .forward import Forward
from .registry import GRADIENTS, as_gradient, default_gradient, gradient_names
from .reversible import Reversible
from .symplectic import Symplectic

__all__ = [
    "GRADIENTS",
    "Adjoint",
    "Backprop",
    "Checkpoint",
    "Forward",
    "GradientMethod",
    "Reversible",
    "Run",
    "Symplectic",
    "as_gradient",
    "default_gradient",
    "gradient_names",
]
