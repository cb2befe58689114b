"""Vector fields ``F(t, y)`` of the seeds (the seed papers: see the bibliography)."""

from .base import Field, Shared
from .baselines import MS1, MS2, MS3
from .cubic_friction import CubicFriction, CubicFrictionConv
from .hamiltonian import Hamiltonian, canonical_J
from .kepler import Kepler, kepler_orbit
from .nais import NAIS, NAISConv
from .second_order import PiecewiseMLP, SecondOrder

__all__ = [
    "Field",
    "Shared",
    "MS1",
    "MS2",
    "MS3",
    "CubicFriction",
    "CubicFrictionConv",
    "Hamiltonian",
    "canonical_J",
    "Kepler",
    "kepler_orbit",
    "NAIS",
    "NAISConv",
    "SecondOrder",
    "PiecewiseMLP",
]
