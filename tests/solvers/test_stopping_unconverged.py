"""A stopping net tells samples that converged from samples that ran out of layers, and says why they did."""

import warnings

import pytest
import torch

from cde_nets import Stop, discretize
from cde_nets.fields import NAIS
from cde_nets.solvers.stopping import unroll


def test_unroll_tells_convergence_at_the_last_step_from_running_out(f64):
    """``x ← x/2`` changes by ``x_0 2^(−i)`` at step ``i``: below 0.3 at step 2 for ``x_0 = 1``, step 9 for
    100, step 12 for 1000. With ``max_depth = 9`` the second converges on the last step, the third does not;
    both have depth 9."""
    x0 = torch.tensor([[1.0], [100.0], [1000.0]])
    converged = torch.zeros(3, dtype=torch.bool)
    _, depths = unroll(lambda i, x, idx: x / 2, x0, eps=0.3, max_depth=9, converged=converged)
    assert depths.tolist() == [2, 9, 9]
    assert converged.tolist() == [True, True, False]


def _net(project: bool):
    g = torch.Generator().manual_seed(0)
    field = NAIS(8, 3, T=1.0, eps=0.1, init_std=3.0, generator=g).double()
    if project:
        field.project_()
    x0 = torch.zeros(16, 8, dtype=torch.float64)
    u = torch.randn(16, 3, dtype=torch.float64, generator=g)
    return field, discretize(field, "euler", stop=Stop(eps=1e-3, max_depth=200)), x0, u


def test_nais_outside_its_stability_condition_is_reported():
    """Unprojected weights (``init_std = 3``): the Euler block's Jacobian has spectral radius ~128 (Condition N1
    needs < 1), no sample converges, each takes all 200 layers; the solve says so and counts them."""
    field, net, x0, u = _net(project=False)
    assert field.stability_margin(x0, u, h=field.grid.h) > 100
    with pytest.warns(UserWarning, match=r"stability_margin.*>= 1.*project_\(\)"):
        sol = net.solve(x0, u=u)
    assert sol.depths is not None and sol.depths.tolist() == [200] * 16
    assert sol.unconverged == 16


def test_projected_nais_converges_silently():
    """After Alg. N1 the margin is below 1 and every sample stops on its own, well before 200 layers."""
    field, net, x0, u = _net(project=True)
    assert field.stability_margin(x0, u, h=field.grid.h) < 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sol = net.solve(x0, u=u)
    assert sol.unconverged == 0
    assert sol.depths is not None and int(sol.depths.max()) < 200
