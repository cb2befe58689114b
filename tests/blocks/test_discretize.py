"""discretize(): parameters shared with continuous mode (both directions), memory-free momentum, errors."""

import pytest
import torch
import torchdiffeq

from cde_nets import ODEBlock, discretize
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.fields import CubicFriction, Field, Hamiltonian, SecondOrder
from cde_nets.fields.pieces import Pieces


class Tanh(Field):
    def __init__(self, d, layers, T=1.0):
        super().__init__(T=T, layers=layers)
        self.state_shape = (d,)
        self.W = Pieces(self.grid, (d, d), init=lambda w: w.normal_(0, 0.5))

    def evaluate(self, l, x):
        return torch.tanh(x @ self.W[l].T)


def test_discrete_euler_is_torchdiffeq_fixed_grid_euler(f64):
    """Same weights, discrete mode = continuous mode with one Euler step per piece (1e-12)."""
    f = CubicFriction(3, layers=12, T=2.0, zero_init=False, gamma=0.3)
    x0 = torch.randn(5, 3)
    assert torch.allclose(discretize(f, "euler")(x0), ODEBlock(f, method="euler")(x0), atol=1e-12, rtol=0)
    assert torch.allclose(discretize(f, "midpoint")(x0), ODEBlock(f, method="midpoint")(x0), atol=1e-12, rtol=0)
    # "rk4" is one tableau in both modes (Kutta's 3/8 rule, torchdiffeq's rk4); the classical tableau, named
    # rk4_classical, is another method of the same order: O(h^5) per step apart
    assert torch.allclose(discretize(f, "rk4")(x0), ODEBlock(f, method="rk4")(x0), atol=1e-12, rtol=0)
    gap = (discretize(f, "rk4_classical")(x0) - ODEBlock(f, method="rk4")(x0)).abs().max()
    assert 1e-12 < gap < 1e-2


def test_discrete_euler_is_plain_torchdiffeq_euler_with_perturb(f64):
    """torchdiffeq.odeint(field, method='euler', step_size=h, perturb=True) evaluates piece l at t = l h + 0: it is
    the discrete forward-Euler net, and a gradient through either is the same (1e-12)."""
    f = Hamiltonian(4, layers=10, T=2.0, init_std=1.0)
    x0 = torch.randn(3, 4)
    t = torch.tensor([0.0, 2.0])
    cont = torchdiffeq.odeint(f, x0, t, method="euler", options=dict(step_size=0.2, perturb=True))[-1]
    disc = discretize(f, "euler")(x0)
    assert torch.allclose(cont, disc, atol=1e-12, rtol=0)
    g1 = torch.autograd.grad(cont.square().sum(), f.K.data)[0]
    g2 = torch.autograd.grad(disc.square().sum(), f.K.data)[0]
    assert torch.allclose(g1, g2, atol=1e-12, rtol=0)


@pytest.fixture
def one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation (10x slower on a loaded machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_trained_in_discrete_mode_evaluates_in_continuous_mode(f64, one_thread):
    """Train a 32-piece H1 net by forward Euler; the same weights in dopri5 give nearly the same outputs."""
    torch.manual_seed(0)
    f = Hamiltonian(4, layers=32, T=1.0, init_std=0.5)
    teacher = Hamiltonian(4, layers=4, T=1.0, init_std=1.5)
    x = torch.randn(64, 4)
    with torch.no_grad():
        target = ODEBlock(teacher, rtol=1e-9, atol=1e-9)(x)  # reachable: a Hamiltonian flow map
    net = discretize(f, "euler")
    opt = torch.optim.Adam(f.parameters(), lr=1e-2)
    start = (net(x) - target).square().mean().item()
    for _ in range(30):
        opt.zero_grad()
        loss = (net(x) - target).square().mean()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * start
    cont = ODEBlock(f, rtol=1e-9, atol=1e-9)(x)
    assert (cont - net(x)).abs().max() < 0.05  # O(h) gap between Euler (h = 1/32) and the flow
    assert (cont - target).square().mean() < 0.8 * start


def test_trained_in_continuous_mode_evaluates_in_discrete_mode(f64, one_thread):
    torch.manual_seed(1)
    f = Hamiltonian(4, layers=8, T=1.0, K="blockdiag", init_std=0.5)
    x = torch.randn(32, 4)
    with torch.no_grad():
        target = ODEBlock(Hamiltonian(4, K="blockdiag", init_std=1.5), rtol=1e-9, atol=1e-9)(x)
    block = ODEBlock(f, rtol=1e-6, atol=1e-6, gradient="backprop")  # the adjoint's backward solve is ~10x slower
    opt = torch.optim.Adam(f.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = (block(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    cont = block(x)
    assert (discretize(f, "rk4")(x) - cont).abs().max() < 1e-4  # rk4, h = 1/8: O(h^4)
    assert (discretize(f, "symplectic_euler")(x) - cont).abs().max() < 0.1  # O(h), h = 1/8


def test_solve_saves_every_layer(f64):
    f = Tanh(3, layers=6)
    net = discretize(f, "momentum")
    y0 = torch.randn(2, 3)
    sol = net.solve(y0, t=net.times)
    assert sol.ys.shape == (7, 2, 3) and torch.equal(sol.ys[0], y0) and torch.equal(sol.ys[-1], net(y0))
    assert torch.equal(sol.ts, net.times) and sol.ts.dtype == torch.float64


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_memory_free_momentum_gradients(dtype, tol):
    torch.manual_seed(2)
    f = Tanh(4, layers=16).to(dtype)
    stored = discretize(f, "momentum", momentum=(0.9, 0.5))
    free = discretize(f, "momentum", momentum=(0.9, 0.5), memory_free=True)
    free.load_state_dict(stored.state_dict())
    x0 = torch.randn(8, 4, dtype=dtype, requires_grad=True)
    c = torch.randn(8, 4, dtype=dtype)
    grads = []
    for net in (stored, free):
        out = net(x0)
        params = [x0, *net.parameters()]
        grads.append(torch.autograd.grad((c * out).sum(), params))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=tol, rtol=tol)


def test_memory_free_momentum_memory_does_not_grow_with_depth(f64):
    saved = {}
    for L in (8, 64):
        f = Tanh(16, layers=L)
        x0 = torch.randn(32, 16)
        for free in (False, True):
            net = discretize(f, "momentum", momentum=(0.9, 0.5), memory_free=free)
            mem = SavedTensorMemory(exclude=list(net.parameters()) + [x0])
            with mem:
                net(x0)
            saved[(L, free)] = mem.peak_bytes
    assert saved[(64, True)] == saved[(8, True)]
    assert saved[(64, False)] > 6 * saved[(8, False)]


def test_errors(f64):
    with pytest.raises(ValueError, match="unknown scheme 'rk5'; valid schemes: euler, midpoint, rk4"):
        discretize(Tanh(2, 2), "rk5")
    with pytest.raises(ValueError, match="scheme 'symplectic_euler' needs a \\(p, q\\) split.*declares none"):
        discretize(CubicFriction(4), "symplectic_euler")
    with pytest.raises(ValueError, match="n = 3 is odd: pad the state with a zero feature"):
        discretize(CubicFriction(3), "verlet")
    with pytest.raises(ValueError, match="`split`=\\(1, 2\\) must add up to the state size 4"):
        discretize(CubicFriction(4), "verlet", split=(1, 2))
    with pytest.raises(ValueError, match="`memory_free=True` .* explicitly invertible scheme"):
        discretize(Tanh(2, 2), "euler", memory_free=True)
    with pytest.raises(ValueError, match="rounding grows like \\(1/m\\)\\^L.*`momentum=\\(0.9, 1.0\\)`"):
        discretize(Tanh(2, 2), "momentum", memory_free=True)
    with pytest.raises(ValueError, match="`k` applies to the 'ck' and 'dense' schemes"):
        discretize(Tanh(2, 2), "euler", k=3)
    with pytest.raises(ValueError, match="`y0` has shape"):
        discretize(Tanh(2, 2), "euler")(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="`tie_eta` ties the momentum scheme's"):
        discretize(Tanh(2, 2), "euler", tie_eta=True)
    with pytest.raises(ValueError, match="m = 1 − hγ and η = hη come from the field's γ, η; drop `momentum`"):
        discretize(SecondOrder(2), "momentum", momentum=(0.5, 1.0))
    with pytest.raises(ValueError, match="drop `momentum`, `tie_eta` and `memory_free`"):
        discretize(SecondOrder(2), "momentum", memory_free=True)


def test_momentum_on_a_second_order_field_converges_to_its_flow(f64):
    """Momentum on SecondOrder (x' = v, v' = −γ v + η f(x)) is consistent with that ODE: error against dopri5
    falls like h (fitted slope 1 ± 0.2) — the scheme uses the field's own v, not a velocity of (x, v)."""
    import numpy as np

    base = SecondOrder(2, gamma=0.6, eta=1.5, generator=torch.Generator().manual_seed(0))
    y0 = torch.tensor([[0.7, -0.3, 0.2, 0.4]])
    ref = ODEBlock(base, T=2.0, rtol=1e-12, atol=1e-12)(y0)
    Ls, errs = [16, 32, 64, 128], []
    for L in Ls:
        f = SecondOrder(2, layers=L, T=2.0, gamma=0.6, eta=1.5)
        with torch.no_grad():
            for name, p in f.named_parameters():
                p.copy_(dict(base.named_parameters())[name].expand_as(p))
        net = discretize(f, "momentum")
        assert net(y0).shape == (1, 4)
        errs.append((net(y0) - ref).abs().max().item())
    assert abs(np.polyfit(np.log([2 / L for L in Ls]), np.log(errs), 1)[0] - 1) < 0.2, errs


def test_general_split_for_a_non_separable_field(f64):
    """`split=` runs semi-implicit Euler on any even field: equals the hand-written two-half-step update."""
    f = Tanh(4, layers=3)
    x = torch.randn(2, 4)
    y = x
    for l in range(3):
        p = y[:, :2] + f.grid.h * f.evaluate(l, y)[:, :2]
        y = torch.cat([p, y[:, 2:] + f.grid.h * f.evaluate(l, torch.cat([p, y[:, 2:]], 1))[:, 2:]], 1)
    assert torch.allclose(discretize(f, "symplectic_euler", split=(2, 2))(x), y, atol=1e-14)


@pytest.mark.parametrize(
    "scheme,kw", [("verlet", dict(split=(1, 1))), ("momentum", dict(momentum=(0.5, 1.0))), ("dense", dict(k=3))]
)
def test_per_sample_stopping_with_tuple_states(f64, scheme, kw):
    """Stopping compacts the batch of split, velocity and lag states alike: each sample stops at the depth where
    it would stop alone, with the same state; on this contraction larger inputs need more layers to move less than
    eps, so the depths are ordered like the input norms."""

    class Decay(Field):
        def __init__(self):
            super().__init__(T=0.1, layers=1)
            self.state_shape = (2,)

        def evaluate(self, l, y):
            return -y

    f = Decay()
    y0 = torch.tensor([[1e-2, 0.0], [1.0, 1.0], [50.0, -20.0]])
    sol = discretize(f, scheme, stop=dict(eps=1e-4, max_depth=2000), **kw).solve(y0)
    y, depths = sol.y, sol.depths
    assert depths[0] < depths[1] < depths[2] < 2000
    for i in range(3):
        alone = discretize(f, scheme, stop=dict(eps=1e-4, max_depth=2000), **kw).solve(y0[i : i + 1])
        assert alone.depths.item() == depths[i].item() and torch.allclose(alone.y, y[i : i + 1], atol=1e-14, rtol=0)


def test_memory_free_momentum_loses_precision_like_one_over_m_to_the_L(f64):
    """The inversion divides by m once per layer: rounding grows like (1/m)^L, harmless at m = 0.9, fatal at
    m = 0.05 over 16 layers (why the docs ask for a moderate momentum with `memory_free`)."""
    errs = {}
    for m in (0.9, 0.5, 0.05):
        torch.manual_seed(2)
        f = Tanh(4, layers=16)
        x0 = torch.randn(8, 4, requires_grad=True)
        g = [
            torch.autograd.grad(discretize(f, "momentum", momentum=(m, 0.5), memory_free=free)(x0).sum(), x0)[0]
            for free in (False, True)
        ]
        errs[m] = (g[0] - g[1]).abs().max().item()
        assert errs[m] < 1e-13 * (1 / m) ** 16
    assert errs[0.9] < 1e-14 and errs[0.05] > 1e-4
