"""Pattern-dependent stopping depth: per-sample depths, equality with running alone, rows evaluated = Σ depths."""

import time

import pytest
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.fields import NAIS, Field
from cde_nets.pieces import Pieces


class Decay(Field):
    """x' = −c ⊙ x (per-sample rate through the bound input): converges at sample-dependent speed."""

    needs_input = False

    def __init__(self, T=1.0, layers=1, dim=2):
        super().__init__(T=T, layers=layers)
        self.state_shape = (dim,)
        self.w = Pieces(self.grid, (dim, dim), init=torch.eye(dim))
        self.rows_seen = 0

    def evaluate(self, l, x):
        self.rows_seen += x.shape[0]
        return -torch.tanh(x @ self.w[l].T)


def test_depths_differ_and_states_equal_running_alone(f64):
    field = NAIS(3, 2, T=0.5, eps=0.2, init_std=0.8, generator=torch.Generator().manual_seed(0)).project_()
    u = torch.randn(6, 2, generator=torch.Generator().manual_seed(1)) * torch.tensor([[0.01], [1], [3], [0.1], [5],
                                                                                       [0.5]])
    net = discretize(field, "euler", stop=dict(eps=1e-4, max_depth=200))
    x0 = torch.zeros(6, 3)
    y, depths = net(x0, u=u)
    assert len(set(depths.tolist())) > 2
    for i in range(6):
        xi = x0[i:i + 1]
        field.bind(u[i:i + 1])
        for _ in range(int(depths[i])):
            xi = xi + 0.5 * field.evaluate(0, xi)
        assert torch.allclose(y[i:i + 1], xi, atol=1e-10, rtol=0)


def test_rows_evaluated_equal_the_sum_of_depths(f64):
    field = Decay()
    x0 = torch.tensor([[0.001, 0.0], [0.5, 0.5], [2.0, -3.0], [0.0, 0.01]])
    net = discretize(field, "euler", stop=dict(eps=1e-3, max_depth=500))
    y, depths = net(x0)
    assert field.rows_seen == int(depths.sum()) < 4 * int(depths.max())


def test_gradients_flow_through_each_final_state(f64):
    field = Decay()
    x0 = torch.tensor([[0.01, 0.0], [1.0, 0.5]], requires_grad=True)
    y, depths = discretize(field, "euler", stop=dict(eps=1e-3, max_depth=300))(x0)
    y.sum().backward()
    J = torch.autograd.functional.jacobian(
        lambda z: discretize(Decay(), "euler", stop=dict(eps=1e-3, max_depth=int(depths[1])))(z)[0], x0[1:].detach())
    assert torch.allclose(x0.grad[1], J[0].sum(0), atol=1e-12)


def test_continuous_stopping_times_differ(f64):
    field = Decay(T=20.0)
    x0 = torch.tensor([[0.001, 0.0], [1.0, 1.0], [3.0, -2.0]])
    block = ODEBlock(field, rtol=1e-8, atol=1e-10, stop=dict(eps=1e-3, window=0.25))
    y, times = block(x0)
    assert times[0] < times[1] < times[2] < 20.0
    assert (y.norm(dim=1) < 1.5e-3).all()
    ref = ODEBlock(Decay(T=float(times[2])), rtol=1e-8, atol=1e-10)(x0[2:])
    assert torch.allclose(y[2:], ref, atol=1e-7)


def test_saving_against_the_slowest_sample(f64):
    """Half the batch converges early: rows evaluated and time fall against running all to the slowest depth."""
    field = Decay(T=0.1, dim=128)
    x0 = torch.cat([torch.full((512, 128), 1e-4), torch.full((512, 128), 2.0)])
    net = discretize(field, "euler", stop=dict(eps=1e-4, max_depth=2000))
    t0 = time.perf_counter()
    _, depths = net(x0)
    t_stop = time.perf_counter() - t0
    rows_stop, field.rows_seen = field.rows_seen, 0
    t0 = time.perf_counter()
    x = x0
    for _ in range(int(depths.max())):  # the whole batch to the slowest sample's depth
        x = x + 0.1 * field.evaluate(0, x)
    t_all = time.perf_counter() - t0
    assert rows_stop == int(depths.sum()) and field.rows_seen == 1024 * int(depths.max())
    assert rows_stop < 0.6 * field.rows_seen and t_stop < t_all


def test_errors():
    with pytest.raises(ValueError, match="`eps` must be a finite number > 0"):
        discretize(Decay(), "euler", stop=dict(eps=0.0, max_depth=3))
    with pytest.raises(ValueError, match="`max_depth` must be a positive integer"):
        discretize(Decay(), "euler", stop=dict(eps=1e-3, max_depth=0))
    with pytest.raises(ValueError, match="`stop` must be dict"):
        ODEBlock(Decay(), stop=dict(tol=1e-3))
    with pytest.raises(ValueError, match="`eps` must be a finite number > 0"):
        ODEBlock(Decay(), stop=dict(eps=-1.0))
