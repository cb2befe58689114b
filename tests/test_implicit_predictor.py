"""Starting stages from the previous step's collocation polynomial (float64), and the Newton state a chain of
steps carries: the continuous solve's steps and the discrete layers."""

from __future__ import annotations

import copy

import pytest
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.fields import Hamiltonian
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.implicit import Newton, get_tableau, implicit_step, solve_stages
from cde_nets.solvers.implicit_predictor import StagePredictor, extrapolation_matrix
from cde_nets.solvers.schemes import get_scheme

D = torch.float64
PREDICTED = ["implicit_euler", "implicit_midpoint", "gl4", "gl6", "radauIIA3", "radauIIA5"]


@pytest.mark.parametrize("method", PREDICTED)
@pytest.mark.parametrize("ratio", [1.0, 0.5, -1.0])
def test_prediction_is_exact_where_the_collocation_polynomial_is(method, ratio):
    """For ``y' = p(t)`` with ``p`` of degree ``s − 1`` the collocation polynomial of an ``s``-stage collocation
    method is the exact solution, so the extrapolated stages are the next step's converged ones to rounding,
    for a next step of any size and direction."""
    tab = get_tableau(method)
    s = tab.stages
    coef = torch.tensor([0.7, -1.3, 2.1][:s], dtype=D)

    def fun(t, y):
        return sum(ck * t**k for k, ck in enumerate(coef.tolist())) * torch.ones_like(y)

    y0, h = torch.tensor([[0.3, -0.2]], dtype=D), 0.4
    pred, info = StagePredictor(), {}
    y1, _ = implicit_step(fun, 0.2, y0, h, tab, info=info)
    pred.record(y1, h, info["stages"], info["kind"])
    guess = pred.guess(tab, y1, ratio * h)
    times = [0.2 + h + ci * ratio * h for ci in tab.c]
    Z, _, _ = solve_stages(fun, 0.2 + h, times, y1, ratio * h, tab, Newton("simplified"))
    assert guess is not None and float((guess - Z).abs().max()) <= 1e-14


def test_no_prediction_without_the_chain_or_an_invertible_a():
    """A step from another tensor, a tableau with an explicit first stage, or a step more than twice the last one
    starts from the default stages; a copied predictor forgets its chain."""
    assert extrapolation_matrix(get_tableau("trapezoid"), 1.0) is None
    assert extrapolation_matrix(get_tableau("trbdf2"), 1.0) is None
    tab, pred, info = get_tableau("gl4"), StagePredictor(), {}
    y1, _ = implicit_step(lambda t, y: -y, 0.0, torch.ones(2, 3, dtype=D), 0.1, tab, info=info)
    pred.record(y1, 0.1, info["stages"], info["kind"])
    assert pred.guess(tab, y1, 0.1) is not None
    assert pred.guess(tab, y1.clone(), 0.1) is None
    assert pred.guess(tab, y1, 0.3) is None
    assert copy.deepcopy(pred).guess(tab, y1, 0.1) is None


def _h1(dim: int = 4) -> Hamiltonian:
    return Hamiltonian(dim, T=1.0, generator=torch.Generator().manual_seed(0)).double()


def test_chained_layers_take_fewer_iterations_to_the_same_stages():
    """gl4 layers on the H1 field (h = 0.1, batch 256): each layer after the first starts from the extrapolated
    stages, needs no start evaluation and no more fixed-point iterations (the field is fast at this step: the
    guess is only ~6 times closer than ``h c_i F(y_0)``), and lands on the default start's layer output within
    the stopping rule's tolerance (4 ε |y|, 1e-14 here)."""
    f, y0 = _h1(), torch.randn(256, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    chained, fresh = get_scheme("gl4").for_field(f), get_scheme("gl4").for_field(f)
    bound, state = BoundField(f), (y0,)
    with torch.no_grad():
        for layer in range(5):
            ref = fresh.step(bound, 0, (state[0].clone(),), 0.1, None, 0.0)
            state = chained.step(bound, 0, state, 0.1, None, 0.0)
            assert float((state[0] - ref[0]).abs().max()) <= 1e-14
            if layer:
                assert chained.evaluations(0) % 2 == 0  # two stages per iteration, no F(y_0)
                assert chained.evaluations(0) <= fresh.evaluations(0) - 1


def test_auto_stays_on_the_fixed_point_when_samples_reach_the_rounding_floor():
    """Newton("auto") leaves the fixed point for a sample contracting slower than 1/4; a sample whose increment is
    already rounding noise (an exact zero, then 1e-17) has no rate to judge. Chained gl4 steps on the non-stiff
    H1 field (observed θ ≈ 0.03) reach that floor in some samples and must stay on the fixed point (they switched
    to simplified Newton, a Jacobian and a factorisation per step, before)."""
    f, y = _h1(), torch.randn(256, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    pred, tab, bound = StagePredictor(), get_tableau("gl4"), BoundField(f)
    with torch.no_grad():
        for _ in range(6):
            info: dict = {}
            y1, _ = implicit_step(
                lambda t, x: bound.evaluate(0, x, t=t), 0.0, y, 0.1, tab, info=info, guess=pred.guess(tab, y, 0.1)
            )
            assert info["kind"] == "fixed_point"
            pred.record(y1, 0.1, info["stages"], info["kind"])
            y = y1


def test_continuous_solve_and_deep_copy_after_a_call():
    """The continuous solve predicts its steps too (no start evaluation after the first, same output within
    the stopping rule), and a block keeps no chain through ``copy.deepcopy``."""
    f, y0 = _h1(), torch.randn(64, 4, dtype=D, generator=torch.Generator().manual_seed(2))
    block = ODEBlock(f, T=1.0, method="gl4", step_size=0.1)
    with torch.no_grad():
        sol = block.solve(y0)
    y, lone, x = sol.y, 0, y0
    with torch.no_grad():
        for k in range(10):
            fun = _counted(f)
            x, _ = implicit_step(fun, 0.1 * k, x, 0.1, get_tableau("gl4"), batched=True)
            lone += fun.n
    assert float((y - x).abs().max()) <= 1e-13
    assert sol.stats["nfe_forward"] <= lone - 9  # no F(y_0) after the first step
    net = discretize(Hamiltonian(4, layers=3, generator=torch.Generator().manual_seed(0)).double(), scheme="gl4")
    net(y0)
    assert torch.equal(copy.deepcopy(net)(y0), net(y0))


class _counted:
    def __init__(self, f):
        self.f, self.n = BoundField(f), 0

    def __call__(self, t, y):
        self.n += 1
        return self.f.evaluate(0, y, t=t)

    def count(self, k):
        self.n += k


def test_stiff_layers_carry_simplified_newton_down_the_stack():
    """Eight gl4 layers with h = 0.5 on an H1 field (the fixed point contracts slower than 1/4): the first layer
    probes the fixed point and restarts with simplified Newton; the later layers of the same forward pass start
    with simplified Newton, as the steps of a continuous solve do, and so skip the probe (fewer evaluations than
    the same layers taken from fresh copies of their inputs) with the same output to 1e-13."""
    f = Hamiltonian(8, layers=8, T=4.0, generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(32, 8, dtype=D, generator=torch.Generator().manual_seed(1))
    net = discretize(f, "gl4")
    bound = BoundField(f)
    chained, fresh, state = net.scheme, get_scheme("gl4").for_field(f), (y0,)
    with torch.no_grad():
        for layer in range(8):
            ref = fresh.step(bound, layer, (state[0].clone(),), 0.5)
            state = chained.step(bound, layer, state, 0.5)
            assert float((state[0] - ref[0]).abs().max()) <= 1e-13
            assert chained._chain.kind == "simplified"
            if layer:
                assert chained.evaluations(layer) < fresh.evaluations(layer), layer


def test_a_call_does_not_continue_the_previous_calls_chain():
    """The chain lives within one pass through the layers: feeding a net its own output starts the first layer
    afresh, so the result is the same bits as a fresh copy's on an equal tensor (the last layer's stages once
    predicted the next call's first layer, whose output then depended on the call history)."""
    f = Hamiltonian(4, layers=3, generator=torch.Generator().manual_seed(0)).double()
    net, y0 = discretize(f, scheme="gl4"), torch.randn(64, 4, dtype=D, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y1 = net(y0)
        again, fresh = net(y1), copy.deepcopy(net)(y1.clone())
    assert torch.equal(again, fresh)
