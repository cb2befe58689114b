"""cde_nets: continuous-depth neural networks in continuous mode (its own ODE engine, matching torchdiffeq) and discrete
mode (solver = layer)."""

from cde_nets import diagnostics, fields, sensitivity
from cde_nets.blocks.base import Block
from cde_nets.blocks.collected_terms import IntegratedTerms, integrated_terms
from cde_nets.blocks.discrete import DiscreteNet, discretize
from cde_nets.blocks.ode import ODEBlock
from cde_nets.blocks.projected import solve_projected
from cde_nets.blocks.regularisers import Regularisation
from cde_nets.blocks.sde import SDEBlock, SDESettings
from cde_nets.blocks.second_order import solve_second_order
from cde_nets.blocks.solution import Solution
from cde_nets.blocks.stop import Stop
from cde_nets.fields.pieces import Pieces, TimeGrid, smoothness
from cde_nets.flows import ContinuousFlow
from cde_nets.functional import odeint, odeint_adjoint, odeint_dense, odeint_event

from .solvers.gradients import (
    Adjoint,
    Backprop,
    Checkpoint,
    Forward,
    Gauss,
    GradientMethod,
    Interpolating,
    Reversible,
    Symplectic,
)
from .solvers.options import SolverOptions
from .solvers.per_sample.solve import odeint_per_sample
from .solvers.steppers.projection import Projection

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
    "Interpolating",
    "Gauss",
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
