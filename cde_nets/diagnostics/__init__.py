"""Diagnostics: conservation laws, backward sensitivity, depth profiles and the adjoint study (the seed papers: see the
bibliography)."""

from .adjoint_state import adjoint_state, exact_trace, hutchinson_trace, log_density_change
from .adjoint_study import adjoint_study, discrete_forward, gradient_growth, markdown_table, registered_gradients
from .energy import discrete_energy, energy_trajectory, relative_drift
from .long_run import energy_error_fit, long_run_energy, noether_drift, step_jacobians
from .memory import SavedTensorMemory
from .profiles import (
    cosine_profile,
    depth_profile,
    norm_profile,
    perturbation_ratio,
    piece_gradient_norms,
    state_gradient_norms,
)
from .sensitivity import continuous_bsm, discrete_bsm, singular_value_pairing, symplecticity_defect
from .serialize import save_json, to_jsonable

__all__ = [
    "adjoint_state",
    "exact_trace",
    "hutchinson_trace",
    "log_density_change",
    "adjoint_study",
    "gradient_growth",
    "registered_gradients",
    "discrete_forward",
    "markdown_table",
    "discrete_energy",
    "energy_trajectory",
    "relative_drift",
    "SavedTensorMemory",
    "energy_error_fit",
    "long_run_energy",
    "noether_drift",
    "step_jacobians",
    "cosine_profile",
    "depth_profile",
    "norm_profile",
    "perturbation_ratio",
    "piece_gradient_norms",
    "state_gradient_norms",
    "continuous_bsm",
    "discrete_bsm",
    "singular_value_pairing",
    "symplecticity_defect",
    "save_json",
    "to_jsonable",
]
