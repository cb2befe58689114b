"""SDEBlock: zero-noise limit, Ornstein-Uhlenbeck moments, adjoint vs backprop, seeds, validation."""

import math

import pytest
import torch
import torchsde

from cde_nets.blocks.ode import ODEBlock
from cde_nets.blocks.sde import SDEBlock, SDESettings
from cde_nets.fields import CubicFriction
from cde_nets.fields.base import Field


class Linear(Field):
    """``y' = −θ y`` on ``(batch, dim)``: the Ornstein-Uhlenbeck drift."""

    def __init__(self, theta: float, dim: int = 1, T: float = 1.0):
        super().__init__(T=T, layers=1)
        self.state_shape = (dim,)
        self.theta = theta

    def evaluate(self, l, y):
        return -self.theta * y


def _friction(seed=0):
    torch.manual_seed(seed)
    return CubicFriction(3, layers=4, T=1.0, zero_init=False)


@pytest.mark.parametrize("method, ode_method", [("euler", "euler"), ("midpoint", "midpoint"), ("heun", "heun2")])
def test_zero_noise_equals_ode_block(f64, method, ode_method):
    field = _friction()
    y0 = torch.randn(6, 3)
    ode = ODEBlock(field, method=ode_method, step_size=0.05, gradient="backprop")(y0)
    sde = SDEBlock(field, noise=None, method=method, step_size=0.05)(y0)
    assert (sde - ode).abs().max().item() < 1e-6
    # Eval mode with noise_at_eval=False integrates the same drift ODE although the block has noise.
    noisy = SDEBlock(field, noise="diagonal", sigma=0.5, method=method, step_size=0.05).eval()
    assert (noisy(y0) - ode).abs().max().item() < 1e-6
    # Default grid: one step per parameter piece, as ODEBlock's fixed-step default.
    assert (SDEBlock(field, noise=None)(y0) - ODEBlock(field, method="euler")(y0)).abs().max().item() < 1e-6


def test_ornstein_uhlenbeck_moments(f64):
    # dy = −θ y dt + σ dW: y(T) ~ N(y0 e^{−θT}, σ²(1 − e^{−2θT}) / (2θ)). Euler-Maruyama bias at dt = 0.02 is
    # ~θ² dt T e^{−θT} / 2 ≈ 0.004 on the mean, below one standard error (≈ 0.005 for 4000 paths).
    theta, sigma, y0, T, n = 1.0, 0.5, 1.0, 1.0, 4000
    block = SDEBlock(Linear(theta), noise="additive", sigma=sigma, method="euler", step_size=0.02, seed=11)
    with torch.no_grad():
        yT = block(torch.full((n, 1), y0))[:, 0]
    mean, var = y0 * math.exp(-theta * T), sigma**2 * (1 - math.exp(-2 * theta * T)) / (2 * theta)
    se_mean, se_var = math.sqrt(var / n), var * math.sqrt(2 / (n - 1))
    assert abs(yT.mean().item() - mean) < 3 * se_mean
    assert abs(yT.var().item() - var) < 3 * se_var


def _grads(field, y0, dt, gradient):
    block = SDEBlock(field, noise="diagonal", sigma=0.3, method="midpoint", step_size=dt, seed=7, gradient=gradient)
    field.zero_grad()
    sol = block.solve(y0)
    sol.y.pow(2).sum().backward()
    return torch.cat([block.rho.grad] + [p.grad.flatten() for p in field.parameters()]), sol.stats


def test_adjoint_matches_backprop_on_a_fixed_path(f64):
    # On one Brownian path the adjoint SDE (solved backwards) and the discrete gradient differ by the solver's
    # error, O(dt) for Stratonovich midpoint with multiplicative noise: measured 2.3e-2, 1.4e-2, 4.5e-3, 2.1e-3 at
    # dt = 0.1, 0.05, 0.025, 0.0125 (relative to the largest gradient entry). The bound 0.02 at dt = 0.025 leaves
    # 4x headroom, and the gap must at least halve when dt quarters (first order, with slack).
    torch.manual_seed(1)
    field = CubicFriction(2, layers=2, T=1.0, zero_init=False)
    y0 = torch.randn(4, 2)
    gaps = []
    for dt in (0.1, 0.025):
        g_bp, st_bp = _grads(field, y0, dt, "backprop")
        g_adj, st_adj = _grads(field, y0, dt, "adjoint")
        gaps.append(((g_bp - g_adj).abs().max() / g_bp.abs().max()).item())
        steps = round(1.0 / dt)
        assert st_bp["steps_forward"] == st_adj["steps_forward"] == st_adj["steps_backward"] == steps
        # midpoint: drift + diffusion at both stages, 4 evaluations per step.
        assert st_adj["nfe_forward"] == 4 * steps and st_adj["nfe_backward"] > 0
    assert gaps[1] < 0.02
    assert gaps[1] < gaps[0] / 2


def test_adaptive_error_follows_tolerance(f64):
    # Step doubling controls the local error ~ C dt^(p+1), so dt ~ tol^(1/(p+1)) and the global error
    # ~ tol^(p/(p+1)): tol^(1/2) for Euler (p = 1), tol^(2/3) for midpoint (p = 2). Over a factor 100 in tol that
    # is a factor 10 and 21.5; measured 10.0 and 20.2 on y' = −y (errors 9.0e-4 → 9.0e-5, 4.8e-5 → 2.4e-6).
    y0 = torch.ones(2, 1)
    for method, factor in (("euler", 10.0), ("midpoint", 100 ** (2 / 3))):
        errors, nfes = [], []
        for tol in (1e-5, 1e-7):
            block = SDEBlock(Linear(1.0), noise=None, method=method, adaptive=True, rtol=tol, atol=tol)
            sol = block.solve(y0)
            errors.append(abs(sol.y[0, 0].item() - math.exp(-1.0)))
            nfes.append(sol.stats["nfe_forward"])
        assert abs(math.log(errors[0] / errors[1]) / math.log(factor) - 1) < 0.15
        assert nfes[1] > nfes[0]


def test_seeded_runs_repeat(f64):
    field = _friction()
    y0 = torch.randn(5, 3)
    a = SDEBlock(field, sigma=0.4, seed=3, step_size=0.1)
    b = SDEBlock(field, sigma=0.4, seed=3, step_size=0.1)
    first, second = a(y0), a(y0)
    assert torch.equal(first, b(y0)) and torch.equal(second, b(y0))
    assert (first - second).abs().max().item() > 1e-3  # a new path at each call
    a.reseed()
    assert torch.equal(a(y0), first)


def test_given_brownian_path(f64):
    # With zero drift and additive noise, Euler-Maruyama is exact: y(T) = y0 + σ (W(T) − W(0)) on the given path,
    # whatever the block's seed.
    y0 = torch.randn(3, 2)
    bm = torchsde.BrownianInterval(t0=0.0, t1=1.0, size=(3, 2), dtype=torch.float64, entropy=5)
    block = SDEBlock(Linear(0.0, dim=2), noise="additive", sigma=torch.tensor([0.2, 0.7]), step_size=0.1, seed=9)
    expected = y0 + torch.tensor([0.2, 0.7]) * bm(0.0, 1.0)
    assert (block(y0, bm=bm) - expected).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="`bm` must have shape \\(3, 2\\)"):
        block(y0, bm=torchsde.BrownianInterval(t0=0.0, t1=1.0, size=(4, 2), dtype=torch.float64))


def test_paths_average_reduces_variance(f64):
    # The mean of 16 OU paths has 1/16 of the one-path variance (±3 standard errors over 2000 samples).
    field = Linear(1.0)
    y0 = torch.zeros(2000, 1)
    with torch.no_grad():
        one = SDEBlock(field, noise="additive", sigma=1.0, step_size=0.25, seed=1)(y0).var().item()
        avg = (
            SDEBlock(field, noise="additive", sigma=1.0, step_size=0.25, seed=2, settings=SDESettings(paths=16))(y0)
            .var()
            .item()
        )
    assert abs(avg * 16 / one - 1) < 3 * 2 * math.sqrt(2 / 1999)


def test_validation_errors():
    field = _friction()
    with pytest.raises(ValueError, match="`noise` must be one of"):
        SDEBlock(field, noise="general")
    with pytest.raises(ValueError, match="`sigma` must be finite and > 0.*noise=None"):
        SDEBlock(field, sigma=0.0)
    with pytest.raises(ValueError, match="`sigma` must be a number or have shape \\(3,\\)"):
        SDEBlock(field, sigma=torch.ones(2))
    with pytest.raises(ValueError, match="`step_size` must be a finite number > 0"):
        SDEBlock(field, step_size=-0.1)
    with pytest.raises(ValueError, match="`T` must be a finite number > 0"):
        SDEBlock(Linear(1.0), T=0.0)
    with pytest.raises(ValueError, match="`T`=2.0 differs from the field's T"):
        SDEBlock(field, T=2.0)
    with pytest.raises(ValueError, match="`y0` has shape \\(4, 2\\)"):
        SDEBlock(field)(torch.randn(4, 2))
    with pytest.raises(ValueError, match="`method`='srk' does not integrate stratonovich.*valid methods: .*'midpoint'"):
        SDEBlock(field, method="srk", settings=SDESettings(sde_type="stratonovich"))
    with pytest.raises(ValueError, match="`method`='midpoint' does not integrate ito.*valid methods: .*'euler'"):
        SDEBlock(field, method="midpoint", settings=SDESettings(sde_type="ito"))
    with pytest.raises(ValueError, match="`method` 'rk4' is unknown; valid"):
        SDEBlock(field, method="rk4")
    with pytest.raises(ValueError, match="`method` 'adjoint_reversible_heun' is unknown \\(it serves only as"):
        SDEBlock(field, method="adjoint_reversible_heun")
    with pytest.raises(ValueError, match="`adjoint_method`='adjoint_reversible_heun' cannot.*valid adjoint methods"):
        SDEBlock(field, method="midpoint", settings=SDESettings(adjoint_method="adjoint_reversible_heun"))
    with pytest.raises(ValueError, match="`adjoint_method`='srk' cannot solve the adjoint of this stratonovich"):
        SDEBlock(field, method="heun", settings=SDESettings(adjoint_method="srk"))
    with pytest.raises(ValueError, match="`adjoint_method` applies to gradient='adjoint' only"):
        SDEBlock(field, gradient="backprop", settings=SDESettings(adjoint_method="euler"))
    with pytest.raises(ValueError, match="`gradient` must be one of"):
        SDEBlock(field, gradient="checkpoint")
    with pytest.raises(ValueError, match="`paths` must be a positive integer"):
        SDEBlock(field, settings=SDESettings(paths=0))
    with pytest.raises(ValueError, match="`sde_type` must be 'ito' or 'stratonovich'"):
        SDEBlock(field, settings=SDESettings(sde_type="marcus"))
    with pytest.raises(ValueError, match="`adaptive=True` is not supported with method='reversible_heun'"):
        SDEBlock(field, method="reversible_heun", adaptive=True)
    with pytest.raises(ValueError, match="`adaptive=True` with method='euler' and diagonal.*'milstein'"):
        SDEBlock(field, noise="diagonal", method="euler", adaptive=True)
    with pytest.raises(ValueError, match="`rtol` must be a finite number > 0"):
        SDEBlock(field, noise="additive", adaptive=True, rtol=0.0)


def test_noise_robustness_experiment_tiny(tmp_path):
    # The two models differ only by the noise: same initial weights, and with noise off the SDE model's logits
    # equal the ODE model's (Euler on the same grid; float32, 1e-5). The tiny run gives one accuracy per model
    # and ε.
    from cde_nets.experiments import noise_robustness as nr

    s = nr.SETTINGS["tiny"]
    ode, sde = nr.build(False, s, 0), nr.build(True, s, 0)
    x = torch.randn(7, 2)
    with torch.no_grad():
        assert (ode.eval()(x) - sde.eval()(x)).abs().max().item() < 1e-5
        sde.train()
        assert (ode(x) - sde(x)).abs().max().item() > 1e-3  # noise on in training mode
    res = nr.run("tiny", 0, tmp_path)
    curves = res["settings"]["curves"]
    assert len(curves) == 3 and all(len(c) == len(s["eps"]) for c in curves.values())
    assert len(res["rows"]) == 3 * len(s["eps"]) + 3 and all(r["published"] is None for r in res["rows"])
    assert all(_count_of(r["ours"], 100) for r in res["rows"] if r["unit"] == "%")  # swiss roll n = 200: 100 test
    drop = next(r["ours"] for r in res["rows"] if r["setting"] == "ODE, accuracy lost from ε = 0 to ε = 0.1")
    assert drop == curves["ODE"][0] - curves["ODE"][s["eps"].index(0.1)]
    with pytest.raises(ValueError, match="`size` must be one of"):
        nr.run("huge", 0, tmp_path)


def _count_of(percent: float, n: int) -> bool:
    """Whether ``percent`` is a whole number of ``n`` test samples (an accuracy is a count, not any number in
    [0, 100])."""
    k = percent * n / 100
    return abs(k - round(k)) <= 1e-6 * n and 0 <= round(k) <= n
