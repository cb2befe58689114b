"""Vector fields ``F(t, y)`` of the seeds (SPEC §1-4)."""

from .base import Field
from .cubic_friction import CubicFriction, CubicFrictionConv
from .hamiltonian import Hamiltonian, canonical_J

__all__ = ["Field", "CubicFriction", "CubicFrictionConv", "Hamiltonian", "canonical_J"]
