"""cde_nets: continuous-depth neural networks in continuous (torchdiffeq) and discrete (solver = layer) mode."""

from . import diagnostics, fields
from .discrete import DiscreteNet, discretize
from .ode_block import ODEBlock
from .sde_block import SDEBlock
from .pieces import Pieces, TimeGrid, smoothness

__all__ = ["diagnostics", "fields", "ODEBlock", "SDEBlock", "discretize", "DiscreteNet", "Pieces", "TimeGrid", "smoothness"]
__version__ = "0.1.0"
