"""Starting stages from the previous step's collocation polynomial (float64), and the Newton state a chain of
steps carries: the continuous solve's steps and the discrete layers."""

from __future__ import annotations

import copy

import pytest
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.fields import Hamiltonian
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.schemes import get_scheme
from cde_nets.solvers.steppers.implicit import Newton, get_tableau, implicit_step, solve_stages
from cde_nets.solvers.steppers.implicit_predictor import StagePredictor, extrapolation_matrix

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


@pytest.mark.parametrize("method", PREDICTED)
@pytest.mark.parametrize("extra", [0, 1, 2])
def test_error_history_makes_the_prediction_exact_one_degree_per_error(method, extra):
    """For ``y' = p(t)`` with ``p`` of degree ``s + extra`` the extrapolation's error is a polynomial of degree
    ``extra`` in the step's start time, so along equal steps the polynomial through the last ``extra + 1`` errors
    predicts it and the corrected start is the converged stages to rounding; the extrapolation alone is off."""
    tab = get_tableau(method)
    s, h = tab.stages, 0.3
    coef = [0.7, -1.3, 2.1, 0.4, -0.9, 1.1][: s + extra + 1]

    def fun(t, y):
        return sum(ck * t**k for k, ck in enumerate(coef)) * torch.ones_like(y)

    y, t = torch.tensor([[0.3, -0.2]], dtype=D), 0.1
    exact, plain = StagePredictor(history=extra + 1), StagePredictor(history=0)
    for step in range(extra + 4):
        guesses = exact.guess(tab, y, h), plain.guess(tab, y, h)
        Z, _, kind = solve_stages(fun, t, [t + ci * h for ci in tab.c], y, h, tab, Newton("simplified"))
        if step >= extra + 2:  # the prediction of the step after the last extra + 1 errors
            assert float((guesses[0] - Z).abs().max()) <= 1e-13 * max(1.0, float(Z.abs().max()))
            assert float((guesses[1] - Z).abs().max()) >= 1e-6
        y1 = y + torch.einsum("i,ibn->bn", torch.tensor(_output(tab), dtype=D), Z)
        exact.record(y1, h, Z, kind)
        plain.record(y1, h, Z, kind)
        y, t = y1, t + h


def _output(tab) -> list[float]:
    import numpy as np

    return np.linalg.solve(tab.A.T, np.array(tab.b)).tolist()


def test_error_history_restarts_where_the_chain_changes():
    """Another step size or another parameter piece drops the error history: the next prediction is the
    extrapolation alone (the same bits as a predictor that keeps no history); steps that differ in the last bits,
    as a grid's do, are equal steps."""
    f, tab = _h1(), get_tableau("gl4")
    bound = BoundField(f)

    def fun(t, x):
        return bound.evaluate(0, x, t=t)

    y0 = torch.randn(32, 4, dtype=D, generator=torch.Generator().manual_seed(4))
    plans = {
        "size": [(0.1, 0)] * 4 + [(0.05, 0)],
        "piece": [(0.1, 0)] * 4 + [(0.1, 1)],
        "equal": [(0.1, 0)] * 5,
        "grid": [(0.1, 0), (0.1 + 1.4e-17, 0)] * 2 + [(0.1 - 1.4e-17, 0)],  # a grid's steps: equal but for the ulp
    }
    for name, plan in plans.items():
        kept, plain, y = StagePredictor(), StagePredictor(history=0), y0
        with torch.no_grad():
            for h, piece in plan:
                g, g0 = kept.guess(tab, y, h, piece), plain.guess(tab, y, h, piece)
                info: dict = {}
                y1, _ = implicit_step(fun, 0.0, y, h, tab, info=info, guess=g)
                for p in (kept, plain):
                    p.record(y1, h, info["stages"], info["kind"])
                y = y1
        assert (g is None) == (g0 is None)
        assert torch.equal(g, g0) == (name in ("size", "piece")), name


def test_error_history_saves_iterations_on_equal_steps():
    """gl4 on the H1 field, h = 0.05, batch 256: from the fifth step on (three past errors), the corrected start
    (error ~1e-6 against ~1e-4) takes at least one fixed-point iteration (two evaluations) fewer per step than
    the extrapolation alone, to the same output within the stopping rule."""
    f, y0 = _h1(), torch.randn(256, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    kept, plain = get_scheme("gl4").for_field(f), get_scheme("gl4").for_field(f)
    plain._chain = StagePredictor(history=0)
    bound, a, b = BoundField(f), (y0,), (y0,)
    with torch.no_grad():
        for step in range(10):
            a, b = kept.step(bound, 0, a, 0.05, None, 0.0), plain.step(bound, 0, b, 0.05, None, 0.0)
            assert float((a[0] - b[0]).abs().max()) <= 1e-14
            if step >= 4:
                assert kept.evaluations(0) <= plain.evaluations(0) - 2, step


def test_continuous_solve_keeps_the_error_history_within_a_piece(monkeypatch):
    """A piecewise H1 field (5 pieces over [0, 2], 40 steps of 0.05: 8 per piece): the solve corrects its starts
    within each piece (fewer evaluations, same output within the stopping rule), and a discrete gl4 net, whose
    layers are all different pieces, never does (the same bits as without a history)."""
    import cde_nets.solvers.schemes.implicit as layers
    import cde_nets.solvers.steppers.implicit_ode as ode

    f = Hamiltonian(4, layers=5, T=2.0, generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(256, 4, dtype=D, generator=torch.Generator().manual_seed(1))

    def run():
        with torch.no_grad():
            sol = ODEBlock(f, T=2.0, method="gl4", step_size=0.05).solve(y0)
            return sol.y, sol.stats["nfe_forward"], discretize(f, scheme="gl4")(y0)

    kept = run()
    for module in (ode, layers):
        monkeypatch.setattr(module, "StagePredictor", lambda: StagePredictor(history=0))
    plain = run()
    assert float((kept[0] - plain[0]).abs().max()) <= 1e-13
    assert kept[1] <= 0.9 * plain[1]
    assert torch.equal(kept[2], plain[2])
