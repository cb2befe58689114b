"""cde_nets: continuous-depth neural networks in continuous mode (its own ODE engine, matching torchdiffeq) and discrete
mode (solver = layer)."""

from . import diagnostics, fields, sensitivity
from .block import Block
from .block_regularisers import Regularisation
from .collected_terms import IntegratedTerms, integrated_terms
from .discrete import DiscreteNet, discretize
from .flows import ContinuousFlow
from .functional import odeint, odeint_adjoint, odeint_dense, odeint_event
from .ode_block import ODEBlock
from .pieces import Pieces, TimeGrid, smoothness
from .projected_solve import solve_projected
from .sde_block import SDEBlock, SDESettings
from .second_order_solve import solve_second_order
from .solution import Solution
from .solvers.gradients import Adjoint, Backprop, Checkpoint, Forward, GradientMethod, Reversible, Symplectic
from .solvers.options import SolverOptions
from .solvers.per_sample.solve import odeint_per_sample
from .solvers.steppers.projection import Projection
from .stop import Stop

__all__ = [
    "diagnostics",
    "fields",
    "sensitivity",
    "Block",
    "ODEBlock",
    "SDEBlock",
    "SDESettings",
    "discretize",
    "DiscreteNet",
    "ContinuousFlow",
    "integrated_terms",
    "IntegratedTerms",
    "Solution",
    "Stop",
    "Pieces",
    "TimeGrid",
    "smoothness",
    "SolverOptions",
    "Regularisation",
    "GradientMethod",
    "Adjoint",
    "Backprop",
    "Checkpoint",
    "Forward",
    "Symplectic",
    "Reversible",
    "odeint",
    "odeint_adjoint",
    "odeint_dense",
    "odeint_event",
    "odeint_per_sample",
    "solve_second_order",
    "solve_projected",
    "Projection",
]
__version__ = "0.1.0"
