r"""torchdiffeq's loop running cde_nets' dense outputs: the reference the bit-equality tests compare with.

The library runs every explicit Runge-Kutta method on its own stepper (:mod:`solvers.steppers.fast_rk`,
:mod:`solvers.steppers.rk_odeint`); torchdiffeq's loop is the integrator of record it is compared with. For three
methods torchdiffeq's dense-output midpoint is a lower-order value (``bosh3``: ``y_0 + h k_2 / 2``, second order;
``fehlberg2`` and ``adaptive_heun``: first order), and cde_nets deliberately uses the midpoint of the cubic Hermite
interpolant instead (:func:`solvers.steppers.tableaux.hermite_mid`); torchdiffeq 0.2.5 has no ``tsit5`` (Tsitouras
2011).
:func:`torchdiffeq_method` names a solver added to torchdiffeq's table (a private one: tests only) that steps
as torchdiffeq does with cde_nets' interpolant, so that the comparison is of the loop, not of the interpolant.
"""

from __future__ import annotations

import torch

from cde_nets.solvers.steppers.tableaux import TABLEAUX, hermite_mid

__all__ = ["HERMITE_METHODS", "OWN_METHODS", "odeint_reference", "torchdiffeq_method"]

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


def odeint_reference(func, y0, t, *, rtol, atol, method, options, event_fn=None):
    """``torchdiffeq.odeint`` with :func:`torchdiffeq_method`'s solver for ``method``: what
    :data:`solvers.steppers.rk_odeint.REFERENCE` runs while the tests switch the stepper off."""
    import torchdiffeq

    kw = {} if event_fn is None else {"event_fn": event_fn}
    return torchdiffeq.odeint(
        func, y0, t, rtol=rtol, atol=atol, method=torchdiffeq_method(method), options=options, **kw
    )
