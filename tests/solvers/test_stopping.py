"""Pattern-dependent stopping depth (Ciccone et al., N §5.3): per-sample depths and stopping times in closed form,
equality with running each sample alone, rows evaluated = Σ depths, gradients through each final state."""

import math

import pytest
import torch

from cde_nets import ODEBlock, Stop, discretize
from cde_nets.fields import NAIS, Field
from cde_nets.fields.pieces import Pieces
from cde_nets.solvers.stopping import unroll


class Decay(Field):
    """``x' = −tanh(W x)``, ``W = I``: stopping depth grows with ``‖x(0)‖``; counts the rows it evaluates."""

    def __init__(self, T=1.0, layers=1, dim=2):
        super().__init__(T=T, layers=layers)
        self.state_shape = (dim,)
        self.w = Pieces(self.grid, (dim, dim), init=torch.eye(dim))
        self.rows_seen = 0

    def evaluate(self, l, x):
        self.rows_seen += x.shape[0]
        return -torch.tanh(x @ self.w[l].T)


def geometric_depth(a, x0, eps, max_depth):
    """``x(n) = aⁿ x0``: the first ``n`` with ``‖x(n) − x(n−1)‖ = a^{n−1} (1 − a) ‖x0‖ < eps``."""
    for n in range(1, max_depth + 1):
        if a ** (n - 1) * (1 - a) * x0 < eps:
            return n
    return max_depth


def test_unroll_depths_and_states_in_closed_form(f64):
    """x ← a_i x per sample (a_i through idx): depths, final states and rows evaluated in closed form."""
    a = torch.tensor([0.5, 0.9, 0.2, 0.97, 0.7])
    x0 = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0], [1.0, 1.0], [1e-5, 0.0]])
    rows = []

    def step(i, x, idx):
        rows.append(x.shape[0])
        return a[idx, None] * x

    eps, max_depth = 1e-6, 300
    y, depths = unroll(step, x0, eps=eps, max_depth=max_depth)
    want = [geometric_depth(float(a[i]), float(x0[i].norm()), eps, max_depth) for i in range(5)]
    assert depths.tolist() == want and len(set(want)) == 5
    assert torch.allclose(y, a[:, None] ** depths[:, None] * x0, atol=1e-14, rtol=1e-12)
    assert sum(rows) == sum(want) < 5 * max(want)  # compacted, not masked
    assert rows == sorted(rows, reverse=True)


def test_unroll_tuple_state_readout_norm_and_max_depth(f64):
    """Tuple states keep their form; readout and norm decide; samples that never converge stop at max."""
    a = torch.tensor([0.5, 0.99])
    x0 = torch.tensor([[1.0, -1.0], [1.0, 1.0]])
    step = lambda i, s, idx: (a[idx, None] * s[0], s[1] + 1)  # noqa: E731
    (y, count), depths = unroll(
        step, (x0, torch.zeros(2, 3)), eps=1e-3, max_depth=50, norm=lambda d: d.abs().amax(dim=1)
    )
    want0 = geometric_depth(0.5, 1.0, 1e-3, 50)  # the max-norm of x0 is 1 (the 2-norm would be √2)
    assert depths.tolist() == [want0, 50] and want0 != geometric_depth(0.5, math.sqrt(2), 1e-3, 50)
    assert torch.equal(count, depths[:, None].double().expand(2, 3))
    assert torch.allclose(y, a[:, None] ** depths[:, None] * x0, atol=1e-14)
    # the readout picks what is measured: the counter changes by 1 every step, so nothing stops before max
    _, d2 = unroll(step, (x0, torch.zeros(2, 3)), eps=0.5, max_depth=7, readout=lambda s: s[1])
    assert d2.tolist() == [7, 7]


def test_unroll_gradient_through_each_final_state(f64):
    """d x_final / d x0 = a^depth per sample (the depth itself is not differentiated)."""
    a = torch.tensor([0.5, 0.8, 0.9])
    x0 = torch.tensor([[1.0], [2.0], [0.5]], requires_grad=True)
    y, depths = unroll(lambda i, x, idx: a[idx, None] * x, x0, eps=1e-4, max_depth=200)
    y.sum().backward()
    assert len(set(depths.tolist())) == 3
    assert torch.allclose(x0.grad[:, 0], a**depths, atol=1e-15, rtol=1e-12)


def test_nais_depths_differ_and_states_equal_running_alone(f64):
    field = NAIS(3, 2, T=0.5, eps=0.2, init_std=0.8, generator=torch.Generator().manual_seed(0)).project_()
    scale = torch.tensor([[0.01], [1], [3], [0.1], [5], [0.5]])
    u = torch.randn(6, 2, generator=torch.Generator().manual_seed(1)) * scale
    net = discretize(field, "euler", stop=Stop(eps=1e-4, max_depth=200))
    x0 = torch.zeros(6, 3)
    sol = net.solve(x0, u=u)
    y, depths = sol.y, sol.depths
    assert torch.equal(net(x0, u=u), y) and torch.equal(sol.stop_times, depths.double() * 0.5)
    assert len(set(depths.tolist())) > 3 and int(depths.max()) < 200
    for i in range(6):
        xi = x0[i : i + 1]
        for _ in range(int(depths[i])):
            xi = xi + 0.5 * field.evaluate(0, xi, u[i : i + 1])
        assert torch.allclose(y[i : i + 1], xi, atol=1e-10, rtol=0)


def test_discretized_rows_evaluated_equal_the_sum_of_depths(f64):
    field = Decay()
    x0 = torch.tensor([[0.001, 0.0], [0.5, 0.5], [2.0, -3.0], [0.0, 0.01]])
    sol = discretize(field, "euler", stop=dict(eps=1e-3, max_depth=500)).solve(x0)
    depths = sol.depths
    assert field.rows_seen == int(depths.sum()) < 4 * int(depths.max())
    assert (sol.stats["nfe_forward"], sol.stats["steps_forward"]) == (int(depths.max()), int(depths.max()))
    assert len(set(depths.tolist())) == 4


def test_discretized_gradient_equals_running_alone(f64):
    x0 = torch.tensor([[0.01, 0.0], [1.0, 0.5]], requires_grad=True)
    sol = discretize(Decay(), "euler", stop=dict(eps=1e-3, max_depth=300)).solve(x0)
    y, depths = sol.y, sol.depths
    y.sum().backward()
    alone = discretize(Decay(), "euler", stop=dict(eps=1e-3, max_depth=int(depths[1])))
    J = torch.autograd.functional.jacobian(lambda z: alone(z), x0[1:].detach())
    assert torch.allclose(x0.grad[1], J[0].sum(0), atol=1e-12)


def test_continuous_stopping_times_in_closed_form(f64):
    """x' = −x: ‖F‖ = ‖x0‖e^{−t} reaches eps at t* = ln(‖x0‖/eps), located per sample (the stopping rule is the
    event ‖F‖ − eps); a sample already below eps stops at 0."""
    x0 = torch.tensor([[1.0, 0.0], [2.0, 2.0], [0.3, 0.4], [1e-4, 0.0]])
    eps = 1e-3

    class Linear(torch.nn.Module):
        def forward(self, t, x):
            return -x

    sol = ODEBlock(Linear(), T=20.0, rtol=1e-10, atol=1e-12, stop=Stop(eps=eps)).solve(x0)
    t_star = torch.log((x0.norm(dim=1) / eps).clamp_min(1))
    assert torch.allclose(sol.stop_times, t_star, atol=1e-7, rtol=0)
    assert torch.allclose(sol.y, x0 * torch.exp(-t_star)[:, None], atol=1e-9, rtol=0)


def test_ode_block_stopping_times_differ(f64):
    field = Decay(T=20.0)
    x0 = torch.tensor([[0.001, 0.0], [1.0, 1.0], [3.0, -2.0]])
    block = ODEBlock(field, rtol=1e-8, atol=1e-10, stop=Stop(eps=1e-3))
    sol = block.solve(x0)
    y, times = sol.y, sol.stop_times
    assert torch.equal(block(x0), y)
    assert times[0] < times[1] < times[2] < 20.0
    assert (y.norm(dim=1) < 1.5e-3).all()
    ref = ODEBlock(Decay(T=times[2].item()), rtol=1e-8, atol=1e-10)(x0[2:])
    assert torch.allclose(y[2:], ref, atol=1e-7)


def test_stopping_saving_benchmark_tiny(tmp_path):
    """The benchmark's batch-level baseline evaluates batch × max depth rows; stopping evaluates Σ depths."""
    from cde_nets.benchmarks.stopping_saving import run

    res = run(tiny=True, out_dir=tmp_path)
    assert (tmp_path / "stopping_saving.json").exists()
    assert res["rows_whole_batch"] == 16 * res["depth_max"]
    assert res["rows_stop"] == 8 * (res["depth_early_half_mean"] + res["depth_late_half_mean"])
    assert res["depth_early_half_mean"] < res["depth_late_half_mean"] and res["rows_ratio"] < 0.6


def test_errors():
    step = lambda i, x, idx: x  # noqa: E731
    x0 = torch.zeros(2, 1)
    for eps in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="`eps` must be a finite number > 0"):
            unroll(step, x0, eps=eps, max_depth=3)
    for max_depth in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="`max_depth` must be a positive integer"):
            unroll(step, x0, eps=1e-3, max_depth=max_depth)
    with pytest.raises(ValueError, match="`state0` tensors must share the batch size"):
        unroll(step, (x0, torch.zeros(3, 1)), eps=1e-3, max_depth=3)
    with pytest.raises(ValueError, match="`eps` must be a finite number > 0"):
        discretize(Decay(), "euler", stop=dict(eps=0.0, max_depth=3))
    with pytest.raises(ValueError, match="`max_depth` must be a positive integer"):
        discretize(Decay(), "euler", stop=dict(eps=1e-3, max_depth=0))
    with pytest.raises(ValueError, match="`eps` must be a finite number > 0"):
        ODEBlock(Decay(), stop=dict(eps=-1.0))


@pytest.mark.slow
def test_ode_block_stopping_adjoint_with_bound_input(f64):
    field = NAIS(3, 2, T=5.0, generator=torch.Generator().manual_seed(0)).project_()
    u = torch.randn(4, 2, generator=torch.Generator().manual_seed(1)) * torch.tensor([[0.01], [1], [2], [3]])
    kw = dict(stop=Stop(eps=1e-2), rtol=1e-9, atol=1e-10)
    y = ODEBlock(field, gradient="adjoint", **kw)(torch.zeros(4, 3), u=u)
    y.sum().backward()
    grad = field.R.data.grad.clone()
    field.R.data.grad = None
    y = ODEBlock(field, gradient="backprop", **kw)(torch.zeros(4, 3), u=u)
    y.sum().backward()
    assert torch.allclose(grad, field.R.data.grad, atol=1e-6)
