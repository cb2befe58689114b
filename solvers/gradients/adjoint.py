"""The continuous adjoint (Chen et al. 2018, "Neural ordinary differential equations", §2): the adjoint ODE solved
backwards in time, memory constant in the steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import check_positive
from ..grids import adjoint_options
from ..norms import StateNorm
from ..options import ADAPTIVE_METHODS, OWN_FIXED_METHODS, check_method
from .base import GradientMethod, Run
from .piecewise_adjoint import lands_on_boundaries, piecewise_adjoint
from .rk_adjoint import odeint_adjoint_rk

__all__ = ["Adjoint"]

# False routes every adjoint through the generic one, torchdiffeq's scheme (the reference the tests compare with).
PIECEWISE = True


@dataclass(frozen=True, repr=False)
class Adjoint(GradientMethod):
    """Solve the adjoint ODE backwards (Chen et al. 2018): ``a' = −aᵀ ∂F/∂y``, parameter gradients as integrals
    along it. Its backward solve has its own settings: ``rtol``, ``atol``, ``method`` (default: the forward
    solve's), and the ``seminorm`` (Kidger, Chen & Lyons 2021, "Hey, that's not an ODE": the error norm of the
    backward solve ignores the parameter-gradient states; on by default).

    Parameters constant on pieces of time get one piece-shaped gradient state each and the backward solve
    differentiates only the piece in force, so its cost is linear in the number of pieces
    (:mod:`solvers.gradients.piecewise_adjoint`); without the seminorm, when ``t`` requires grad, or when the backward
    solver would not step on every piece boundary, the generic adjoint over whole tensors serves (torchdiffeq's
    ``odeint_adjoint``'s scheme on the library's stepper: :mod:`solvers.gradients.rk_adjoint`), whose cost grows with
    the square of the number of pieces. Serves every method but ``alf``, and the SDE block (``method`` there is
    torchsde's ``adjoint_method``; ``rtol``/``atol``/``seminorm`` are refused).
    """

    rtol: float | None = None
    atol: float | None = None
    method: str | None = None
    seminorm: bool = True

    name = "adjoint"
    # the library's fixed-grid methods: the backsolve of their steps (each step's start rebuilt by the step with
    # −h, its vector-Jacobian product there): memory flat, the gradient to the local error per step (exact for the
    # symmetric implicit methods and the compositions, whose step with −h is their inverse)
    sweep = "adjoint"
    sde = True

    def __post_init__(self) -> None:
        if self.rtol is not None:
            object.__setattr__(self, "rtol", check_positive("rtol", self.rtol))
        if self.atol is not None:
            object.__setattr__(self, "atol", check_positive("atol", self.atol))
        if not isinstance(self.seminorm, bool):
            raise TypeError(f"`seminorm` must be True or False, got {self.seminorm!r}.")

    def check_ode(self) -> None:
        """The backward method must be one of the ODE methods (the SDE block checks its own)."""
        if self.method is not None:
            check_method(self.method, "adjoint_method")

    def check(self, method: str) -> None:
        super().check(method)
        self.check_ode()
        if method in OWN_FIXED_METHODS and self != Adjoint():
            raise ValueError(
                f"method={method!r} has no backward ODE solve to set: its adjoint rebuilds each step's start by "
                f"the step with -h. Use gradient='adjoint' (not {self!r})."
            )

    def solve(self, run: Run) -> torch.Tensor:
        s, func = run.solver, run.func
        if run.backward is None:
            adj_method = s.method if self.method is None else self.method
            adj_options = adjoint_options(adj_method, run.jump_t, run.grid, self.seminorm)
            adj_rtol = s.rtol if self.rtol is None else self.rtol
            adj_atol = s.atol if self.atol is None else self.atol
            if adj_method in ADAPTIVE_METHODS and run.jump_t is not None:
                func.backward_jumps = sorted(float(j) for j in run.jump_t.tolist())
            piecewise = self._piecewise_applies(run, adj_method)
            if piecewise:
                func.scan_backward = False
        else:  # set per call, as torchdiffeq's odeint_adjoint takes it
            b = run.backward
            adj_method, adj_rtol, adj_atol, adj_options = b.method, b.rtol, b.atol, dict(b.options)
            own_norm = "norm" in run.options and not isinstance(run.options["norm"], StateNorm)
            seminorm = adj_options.get("norm", "seminorm") == "seminorm"
            piecewise = seminorm and not own_norm and s.method != "scipy_solver"
            if piecewise:
                adj_options.pop("norm", None)
        if piecewise:
            return piecewise_adjoint(
                func,
                run.y0,
                run.t,
                run.params,
                run.pieces,
                rtol=s.rtol,
                atol=s.atol,
                method=s.method,
                options=run.options,
                adjoint_rtol=adj_rtol,
                adjoint_atol=adj_atol,
                adjoint_method=adj_method,
                adjoint_options=adj_options,
                stats=run.stats,
                adjoint_adaptive=adj_method in ADAPTIVE_METHODS,
            )
        return odeint_adjoint_rk(
            func,
            run.y0,
            run.t,
            rtol=s.rtol,
            atol=s.atol,
            method=s.method,
            options=run.options,
            adjoint_params=run.params,
            adjoint_method=adj_method,
            adjoint_rtol=adj_rtol,
            adjoint_atol=adj_atol,
            adjoint_options=adj_options,
        )

    def _piecewise_applies(self, run: Run, adj_method: str) -> bool:
        if not (PIECEWISE and self.seminorm and isinstance(run.y0, torch.Tensor)) or run.t.requires_grad:
            return False
        if not run.pieces:
            return True
        stops = run.jump_t if adj_method in ADAPTIVE_METHODS else run.grid
        return lands_on_boundaries(run.pieces, run.t, None if stops is None else stops.tolist())
