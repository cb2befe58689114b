r"""The name under which torchdiffeq runs a method for cde_nets: its own, save where its numbers are wrong.

An adaptive torchdiffeq step overshoots the output times and reads them (``y(T)`` included) off a quartic dense
output through ``y_0``, a midpoint ``y_{1/2} = y_0 + h Σ_i m_i k_i`` and ``y_1``. For three methods torchdiffeq's
midpoint is a lower-order value, which caps every output below the method's order:

- ``bosh3`` (Bogacki & Shampine 1989, "A 3(2) pair of Runge-Kutta formulas", Appl. Math. Lett. 2, order 3):
  ``y_0 + h k_2 / 2``, second order. On ``y' = t/2 + 1``, which its steps integrate exactly, ``y(4)`` comes out
  12.22 instead of 8 at ``rtol = atol = 1e-8``.
- ``fehlberg2`` and ``adaptive_heun`` (order 2): an Euler-like half step, first order.

cde_nets uses instead the midpoint of the cubic Hermite interpolant through ``y_0, y_1`` with the slopes
``k_1, k_s`` every step has (:func:`solvers.tableaux.hermite_mid`), so that the quartic is that cubic and the
outputs keep the method's order (tests/test_dense_output.py fits the slopes). The library's own stepper
(:mod:`solvers.fast_rk`), which runs every forward solve it can (every adaptive method on a float32/float64
tensor), and the replays use it from :mod:`solvers.tableaux`. What still runs inside torchdiffeq gets it from
solvers with those midpoint weights, added to torchdiffeq's table of solvers under their own names, so
torchdiffeq's ``"bosh3"`` and the others stay as they are for anyone calling torchdiffeq directly:

- the continuous adjoint's backward solve (its state is a tuple: the state, its adjoint and the parameter
  gradients) and torchdiffeq's own ``odeint_adjoint`` where the piecewise adjoint does not apply;
- the event search of :func:`cde_nets.odeint_event` (torchdiffeq's root finder on its dense output);
- forward solves of inputs the stepper does not take (a complex state, torchdiffeq's ``dtype`` option), in
  every gradient mode, :func:`solvers.replay.record_steps` included.

``dopri8`` there keeps torchdiffeq's own quartic (its seventh-order extension needs stages torchdiffeq's loop
does not evaluate: :mod:`solvers.dopri8`).

torchdiffeq 0.2.5 has no ``tsit5`` (Tsitouras 2011, "Runge-Kutta pairs of order 5(4) satisfying only the first
column simplifying assumption", Comput. Math. Appl. 62): it is added to the table as ``cde_nets_tsit5`` from
:data:`solvers.tableaux.TABLEAUX`, with Tsitouras' own continuous extension as its dense output, so that the solves
that run inside torchdiffeq take the fast path's steps and read the same interpolant.

torchdiffeq has no public way to add a solver; this reads its solver table (``torchdiffeq._impl.odeint``),
which has kept its shape since 0.2.0.
"""

from __future__ import annotations

import torch

from .tableaux import TABLEAUX, hermite_mid

__all__ = ["HERMITE_METHODS", "OWN_METHODS", "torchdiffeq_method"]

HERMITE_METHODS = ("bosh3", "fehlberg2", "adaptive_heun")
OWN_METHODS = ("tsit5",)  # cde_nets' tableaux that torchdiffeq 0.2.5 lacks


def _hermite(method: str) -> str:
    from torchdiffeq._impl.odeint import SOLVERS  # here, not at import: torchdiffeq loads scipy

    base = SOLVERS[method]
    key = f"cde_nets_{method}"
    if key not in SOLVERS:
        mid = hermite_mid(tuple(base.tableau.c_sol.tolist()))
        SOLVERS[key] = type(f"Hermite{base.__name__}", (base,), {"mid": torch.tensor(mid, dtype=torch.float64)})
    return key


def _own(method: str) -> str:
    from torchdiffeq._impl.odeint import SOLVERS
    from torchdiffeq._impl.rk_common import RKAdaptiveStepsizeODESolver, _ButcherTableau

    key = f"cde_nets_{method}"
    if key in SOLVERS:
        return key
    tab = TABLEAUX[method]
    assert tab.error is not None and tab.dense is not None

    def f64(x) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float64)

    table = _ButcherTableau(
        alpha=f64(tab.tableau.c[1:]),
        beta=[f64(row) for row in tab.tableau.a[1:]],
        c_sol=f64(tab.tableau.b),
        c_error=f64(tab.error),
    )
    dense = f64(tab.dense)

    def interp_fit(self, y0, y1, k, dt):
        """The continuous extension ``y_0 + h Σ_i b_i(θ) k_i`` as torchdiffeq's polynomial in ``θ``."""
        w = dense.to(device=k.device, dtype=k.dtype) * dt.type_as(k)
        return [y0, *(torch.sum(k * w[p], dim=-1).view_as(y0) for p in range(4))]

    mid = f64([sum(row[i] * 0.5 ** (p + 1) for p, row in enumerate(tab.dense)) for i in range(tab.stages)])
    attrs = {"order": tab.order, "tableau": table, "mid": mid, "_interp_fit": interp_fit}
    SOLVERS[key] = type(f"CdeNets{method.capitalize()}", (RKAdaptiveStepsizeODESolver,), attrs)
    return key


def torchdiffeq_method(method: str) -> str:
    """The key to pass torchdiffeq as ``method`` (or ``adjoint_method``) for cde_nets' ``method``."""
    if method in OWN_METHODS:
        return _own(method)
    return _hermite(method) if method in HERMITE_METHODS else method
