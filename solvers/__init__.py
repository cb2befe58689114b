"""The numerical layer: torchdiffeq adapter, discrete schemes, stopping rules. Imports nothing from cde_nets."""

from .adapter import ADAPTIVE_METHODS, FIXED_METHODS, SolverStats, integrate
from .errors import SolverError

__all__ = ["ADAPTIVE_METHODS", "FIXED_METHODS", "SolverStats", "integrate", "SolverError"]
