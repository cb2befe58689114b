"""Per-sample events, end times and output times (cde_nets.solvers.events): closed-form event times and their
implicit-function-theorem gradients, finite differences in every gradient mode, a sample alone equals the same
sample in a batch, per-sample end times equal separate solves, dense output and backward integration."""

import math

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, Stop
from cde_nets.solvers.events import hermite, locate_roots
from cde_nets.solvers.gradients import GRADIENTS as ODE_GRADIENTS

TIGHT = dict(rtol=1e-10, atol=1e-12)
# every gradient mode of dopri5 ("reversible" belongs to method="alf": its own test below)
GRADIENTS = [g for g in ODE_GRADIENTS if g != "reversible"]


class Decay(nn.Module):
    """``x' = −k x`` with a trainable rate ``k``."""

    def __init__(self, k: float = 1.0):
        super().__init__()
        self.k = nn.Parameter(torch.tensor(k, dtype=torch.float64))

    def forward(self, t, y):
        return -self.k * y


class Fall(nn.Module):
    """``h'' = −g``, state ``(h, v)``: hits the ground at ``t* = (v0 + √(v0² + 2 g h0)) / g``."""

    def __init__(self, g: float = 9.81):
        super().__init__()
        self.g = nn.Parameter(torch.tensor(g, dtype=torch.float64))

    def forward(self, t, y):
        return torch.stack([y[:, 1], -self.g.expand(y.shape[0])], 1)


class Level(nn.Module):
    """The event ``g(t, y) = y_0 − c`` with a trainable level ``c``."""

    def __init__(self, c: float):
        super().__init__()
        self.c = nn.Parameter(torch.tensor(c, dtype=torch.float64))

    def forward(self, t, y):
        return y[:, 0] - self.c


@pytest.mark.slow
@pytest.mark.parametrize("gradient", GRADIENTS)
def test_decay_hits_level_at_log_time_with_gradient_one_over_x0(f64, gradient):
    x0 = torch.tensor([[1.0], [2.0], [5.0], [0.3], [0.1]], requires_grad=True)
    c = 0.2
    sol = ODEBlock(Decay(), T=4.0, gradient=gradient, **TIGHT).solve(x0, event=lambda t, y: y[:, 0] - c)
    x = x0.detach()[:, 0]
    assert sol.fired.tolist() == [True, True, True, True, False]
    want = torch.where(sol.fired, torch.log(x / c), torch.tensor(4.0))
    assert torch.allclose(sol.stop_times, want, atol=1e-8, rtol=0)
    assert torch.allclose(sol.y[:4, 0], torch.full((4,), c), atol=1e-9) and sol.stop_times.dtype == torch.float64
    assert torch.allclose(sol.y[4, 0], x[4] * math.exp(-4.0), atol=1e-9)
    (gx,) = torch.autograd.grad(sol.stop_times[:4].sum(), x0)
    assert torch.allclose(gx[:4, 0], 1 / x[:4], rtol=1e-7, atol=0)  # ∂t*/∂x0 = 1/x0


@pytest.mark.parametrize("gradient", GRADIENTS)
def test_falling_bodies_hit_the_ground_in_closed_form(f64, gradient):
    h0 = torch.tensor([1.0, 5.0, 20.0, 0.5])
    v0 = torch.tensor([0.0, 3.0, -2.0, 10.0])
    y0 = torch.stack([h0, v0], 1).requires_grad_(True)
    field = Fall()
    sol = ODEBlock(field, T=5.0, gradient=gradient, **TIGHT).solve(y0, event=lambda t, y: y[:, 0])
    g = 9.81
    root = torch.sqrt(v0**2 + 2 * g * h0)
    assert sol.fired.all() and torch.allclose(sol.stop_times, (v0 + root) / g, atol=1e-8, rtol=0)
    assert torch.allclose(sol.y[:, 1], -root, atol=1e-7)  # the speed at impact, −√(v0² + 2 g h0)
    gy0, gg = torch.autograd.grad(sol.stop_times.sum(), (y0, field.g))
    assert torch.allclose(gy0[:, 0], 1 / root, rtol=1e-6)  # ∂t*/∂h0
    assert torch.allclose(gy0[:, 1], (1 + v0 / root) / g, rtol=1e-6)  # ∂t*/∂v0
    want_g = (h0 / root - (v0 + root) / g) / g  # ∂t*/∂g
    assert torch.allclose(gg, want_g.sum(), rtol=1e-6)


@pytest.mark.parametrize("gradient", GRADIENTS)
def test_event_gradients_equal_central_differences(f64, gradient):
    """A loss on event times and on states at events trains the field (k) and the event's own level (c)."""
    x0 = torch.tensor([[1.0, 0.5], [3.0, -1.0], [0.7, 2.0]])
    w = torch.tensor([0.3, -1.2, 0.8])

    def loss(k, c):
        field, event = Decay(k), Level(c)
        sol = ODEBlock(field, T=6.0, gradient=gradient, **TIGHT).solve(x0, event=event)
        assert sol.fired.all()
        return (sol.stop_times * w).sum() + sol.y[:, 1].pow(2).sum(), (field.k, event.c)

    value, params = loss(0.8, 0.25)
    grads = torch.autograd.grad(value, params)
    for i, p0 in enumerate((0.8, 0.25)):
        e = 1e-5
        args_p, args_m = [0.8, 0.25], [0.8, 0.25]
        args_p[i], args_m[i] = p0 + e, p0 - e
        with torch.no_grad():
            fd = (loss(*args_p)[0] - loss(*args_m)[0]) / (2 * e)
        # differences see the root of the interpolant (slope H'), the IFT the ODE's (slope F): O(Δ³) apart
        assert abs(float(grads[i]) - float(fd)) < 1e-5 * max(1.0, abs(float(fd))), (i, float(grads[i]), float(fd))


def test_reversible_mode_event_gradient_equals_backprop(f64):
    """method='alf' (asynchronous leapfrog) with gradient='reversible': the event time's gradient is backprop's."""
    x0 = torch.tensor([[1.0, 0.5], [3.0, -1.0]])
    grads = {}
    for gradient in ("reversible", "backprop"):
        field, event = Decay(0.8), Level(0.25)
        sol = ODEBlock(field, T=6.0, method="alf", gradient=gradient, step_size=0.01).solve(x0, event=event)
        assert sol.fired.all() and torch.allclose(sol.stop_times, torch.log(x0[:, 0] / 0.25) / 0.8, atol=1e-3)
        grads[gradient] = torch.autograd.grad(sol.stop_times.sum() + sol.y.pow(2).sum(), (field.k, event.c))
    for a, b in zip(grads["reversible"], grads["backprop"]):
        assert torch.allclose(a, b, rtol=1e-8)


def test_a_sample_alone_and_in_a_batch_agree(f64):
    x0 = torch.tensor([[1.0, 0.0], [0.1, 2.0], [4.0, 4.0], [0.05, 0.0]])
    block = ODEBlock(Fall(), T=3.0, **TIGHT)
    batch = block.solve(x0, event=lambda t, y: y[:, 0])
    for i in range(4):
        alone = block.solve(x0[i : i + 1], event=lambda t, y: y[:, 0])
        assert abs(float(alone.stop_times[0].detach() - batch.stop_times[i].detach())) < 1e-9
        assert torch.allclose(alone.y[0], batch.y[i], atol=1e-8)


def test_end_times_per_sample_equal_separate_solves(f64):
    x0 = torch.tensor([[1.0, 0.5], [3.0, -1.0], [0.7, 2.0], [2.0, 2.0]])
    t_end = torch.tensor([0.3, 1.7, 0.0, 2.0], requires_grad=True)
    field = Fall(1.5)
    sol = ODEBlock(field, T=2.0, **TIGHT).solve(x0, t_end=t_end)
    assert torch.equal(sol.stop_times.detach(), t_end.detach()) and sol.fired.all()
    for i in range(4):
        te = float(t_end[i].detach())
        ref = x0[i] if te == 0 else ODEBlock(Fall(1.5), T=te, **TIGHT)(x0[i : i + 1])[0]
        assert torch.allclose(sol.y[i], ref, atol=1e-9)
    (g,) = torch.autograd.grad(sol.y[:, 0].sum(), t_end)  # dy/dt_end = F: the height moves with v(t_end)
    assert torch.allclose(g, sol.y[:, 1].detach(), atol=1e-9)
    both = ODEBlock(field, T=2.0, **TIGHT).solve(x0, t_end=t_end, event=lambda t, y: y[:, 0])  # earlier wins
    hit = (x0[:, 1] + torch.sqrt(x0[:, 1] ** 2 + 3 * x0[:, 0])) / 1.5
    assert torch.allclose(both.stop_times, torch.minimum(hit, t_end.detach()), atol=1e-8)


def test_stop_rule_is_an_event_at_the_closed_form_time(f64):
    """x' = −k x: ‖F‖ = k‖x0‖e^{−kt} = eps at t* = ln(k‖x0‖/eps)/k — no window, the root itself."""
    x0 = torch.tensor([[1.0, 0.0], [2.0, 2.0], [0.3, 0.4], [1e-4, 0.0]])
    eps = 1e-3
    sol = ODEBlock(Decay(), T=8.0, stop=Stop(eps=eps), **TIGHT).solve(x0)
    t_star = torch.log((x0.norm(dim=1) / eps).clamp_min(1))
    assert sol.fired[:3].all() and torch.allclose(sol.stop_times, t_star, atol=1e-8)
    assert float(sol.stop_times[3].detach()) == 0.0 and torch.equal(sol.y[3], x0[3])  # already below eps at t = 0


def test_fixed_step_events_follow_the_scheme(f64):
    """rk4 at step 0.05: the sign is checked at every step, the root located on that step's interpolant."""
    x0 = torch.tensor([[1.0], [2.0]])
    sol = ODEBlock(Decay(), T=2.0, method="rk4", step_size=0.05).solve(x0, event=lambda t, y: y[:, 0] - 0.5)
    assert torch.allclose(sol.stop_times, torch.log(x0[:, 0] / 0.5), atol=1e-5)


def test_dense_output_and_backward_integration(f64):
    x0 = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    block = ODEBlock(Decay(0.7), T=3.0, **TIGHT)
    sol = block.solve(x0, dense=True)
    t = torch.tensor([0.0, 0.123, 1.5, 2.999, 3.0])
    assert torch.allclose(sol.evaluate(t), torch.exp(-0.7 * t)[:, None, None] * x0, atol=1e-8)
    assert sol.evaluate(1.0).shape == (2, 2) and torch.allclose(sol.y, block(x0), atol=1e-9)
    with pytest.raises(ValueError, match="within the solved span"):
        sol.evaluate(3.5)
    # backwards: y0 is the state at T, outputs at decreasing times
    yT = block(x0)
    back = block.solve(yT, t=[3.0, 1.0, 0.0])
    assert torch.allclose(back.ys[1], math.exp(-0.7) * x0, atol=1e-8) and torch.allclose(back.y, x0, atol=1e-8)
    mid = block.solve(yT, t=[2.0, 0.5])  # need not start at T
    assert torch.allclose(mid.ys[0], math.exp(-1.4) * x0, atol=1e-8)
    with pytest.raises(ValueError, match="no dense output"):
        block.solve(x0).evaluate(1.0)


def test_hermite_and_illinois_on_known_roots(f64):
    """Cubic Hermite reproduces cubics exactly; Illinois finds roots to the bracket tolerance."""
    t = torch.tensor([0.2, 0.7])
    y, dy = hermite(t, 0.0, 1.0, torch.zeros(2, 1), torch.ones(2, 1), torch.zeros(2, 1), 3 * torch.ones(2, 1))
    assert torch.allclose(y[:, 0], t**3) and torch.allclose(dy[:, 0], 3 * t**2)
    roots = locate_roots(
        lambda s: s**3 - torch.tensor([0.1, 0.5]),
        torch.zeros(2),
        torch.ones(2),
        torch.tensor([-0.1, -0.5]),
        torch.tensor([0.9, 0.5]),
        1e-13,
    )
    assert torch.allclose(roots, torch.tensor([0.1, 0.5]) ** (1 / 3), atol=1e-12)


def test_combinations_refused_by_name(f64):
    block = ODEBlock(Decay(), T=1.0)
    x0 = torch.ones(2, 1)
    with pytest.raises(ValueError, match="`t` and `event` do not combine"):
        block.solve(x0, t=[0.0, 1.0], event=lambda t, y: y[:, 0])
    with pytest.raises(ValueError, match="`dense=True` keeps the whole batch"):
        block.solve(x0, dense=True, t_end=torch.ones(2))
    with pytest.raises(ValueError, match="`event` and the block's `stop` rule"):
        ODEBlock(Decay(), T=1.0, stop=Stop(1e-3)).solve(x0, event=lambda t, y: y[:, 0])
    with pytest.raises(ValueError, match="`stop` has no `window` any more"):
        ODEBlock(Decay(), T=1.0, stop=dict(eps=1e-3, window=0.1))
    empty = block.solve(torch.zeros(0, 1), event=lambda t, y: y[:, 0])
    assert empty.stop_times.shape == (0,) and empty.fired.shape == (0,)


def test_discrete_events_on_the_layer_index(f64):
    """x_{l+1} = x_l + h(−x_l) = (1 − h)^{l+1} x_0 crosses the level c after the first layer with
    (1 − h)^l x_0 < c: depth l* = ceil(ln(c / x_0) / ln(1 − h)) per sample; alone or in a batch the same."""
    import math

    from cde_nets import discretize

    class Decay(torch.nn.Module):
        def forward(self, t, x):
            return -x

    net = discretize(Decay(), "euler", T=4.0, steps=80)
    h, c = 0.05, 0.1
    x0 = torch.tensor([[0.5], [1.0], [3.0], [0.05]])
    sol = net.solve(x0, event=lambda l, y: y[:, 0] - c)
    want = [math.ceil(math.log(c / float(x)) / math.log(1 - h)) for x in x0[:3, 0]]
    assert sol.depths[:3].tolist() == want and sol.fired[:3].all()
    assert torch.allclose(sol.y[:3, 0], x0[:3, 0] * torch.tensor([(1 - h) ** d for d in want]))
    assert sol.depths[3] == 80 and not sol.fired[3]  # starts below c and never crosses
    alone = net.solve(x0[1:2], event=lambda l, y: y[:, 0] - c)
    assert torch.equal(alone.y, sol.y[1:2]) and alone.depths.tolist() == [want[1]]
    with pytest.raises(ValueError, match="one value per sample"):
        net.solve(x0, event=lambda l, y: y - c)


def test_first_event_mode_stops_the_whole_batch_at_the_first_root():
    """``x' = −k x`` from ``x_0 = (2, 4)``, ``g = min_i x_i − 1``: the first sample reaches 1 at
    ``t* = ln(2)/k`` and the whole batch stops there (``x = x_0 e^{−k t*} = (1, 2)``), ``dt*/dk = −ln(2)/k²``."""
    field = Decay(1.5)
    x0 = torch.tensor([[2.0], [4.0]], dtype=torch.float64)
    block = ODEBlock(field, T=2.0, **TIGHT)
    sol = block.solve(x0, event=lambda t, y: y.min() - 1.0, event_mode="first")
    t_star = math.log(2.0) / 1.5
    torch.testing.assert_close(
        sol.stop_times.detach(), torch.full((2,), t_star, dtype=torch.float64), atol=1e-9, rtol=0
    )
    torch.testing.assert_close(sol.y.detach(), torch.tensor([[1.0], [2.0]], dtype=torch.float64), atol=1e-8, rtol=0)
    assert bool(sol.fired.all())
    (dk,) = torch.autograd.grad(sol.stop_times[0], field.k)
    assert abs(float(dk) + math.log(2.0) / 1.5**2) < 1e-7
    with pytest.raises(ValueError, match="`t_end` stops each sample.*event_mode='per_sample'"):
        block.solve(x0, event=lambda t, y: y.min() - 1.0, event_mode="first", t_end=torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="`event_mode` must be 'first'.*or 'per_sample'"):
        block.solve(x0, event=lambda t, y: y.min() - 1.0, event_mode="last")
