"""The numerical layer: torchdiffeq adapter, discrete schemes, stopping rules. Imports nothing from cde_nets."""

from .adapter import ADAPTIVE_METHODS, FIXED_METHODS, SolverStats, integrate
from .architectures import ARCHITECTURES, architecture
from .errors import SolverError
from .schemes import SCHEMES, Scheme, Tableau, get_scheme

__all__ = [
    "ADAPTIVE_METHODS",
    "FIXED_METHODS",
    "SolverStats",
    "integrate",
    "SolverError",
    "ARCHITECTURES",
    "architecture",
    "SCHEMES",
    "Scheme",
    "Tableau",
    "get_scheme",
]
