"""The numerical layer: solver options, gradient methods, the torchdiffeq adapter, discrete schemes, stopping
rules. Imports nothing from cde_nets."""

from .adapter import integrate
from .architectures import ARCHITECTURES
from .counting import SolverStats
from .errors import Reason, SolverError
from .gradients import (
    GRADIENTS,
    Adjoint,
    Backprop,
    Checkpoint,
    Forward,
    GradientMethod,
    Reversible,
    Symplectic,
    as_gradient,
)
from .options import ADAPTIVE_METHODS, FIXED_METHODS, REVERSIBLE_METHODS, SolverOptions
from .schemes import SCHEMES, Scheme, Tableau, get_scheme
from .schemes.registry import architecture

__all__ = [
    "ADAPTIVE_METHODS",
    "FIXED_METHODS",
    "REVERSIBLE_METHODS",
    "SolverOptions",
    "SolverStats",
    "integrate",
    "GRADIENTS",
    "GradientMethod",
    "Adjoint",
    "Backprop",
    "Checkpoint",
    "Forward",
    "Symplectic",
    "Reversible",
    "as_gradient",
    "Reason",
    "SolverError",
    "ARCHITECTURES",
    "architecture",
    "SCHEMES",
    "Scheme",
    "Tableau",
    "get_scheme",
]
