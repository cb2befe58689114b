"""Convergence orders, symplectic structure, energy behaviour and the blog's toys for the discrete schemes."""

import numpy as np
import pytest
import torch
from scipy.linalg import expm

from cde_nets import ODEBlock, discretize
from cde_nets.fields import MS1, MS3, Field, Hamiltonian, canonical_J
from cde_nets.fields.bound import BoundField
from cde_nets.fields.pieces import Pieces
from cde_nets.solvers import SCHEMES, Tableau, get_scheme


class Linear(Field):
    """y' = A y, the same A on every piece; ``split`` declared when A = [[0, B], [C, 0]] (then separable)."""

    def __init__(self, A, layers, T=1.0, split=None):
        super().__init__(T=T, layers=layers)
        A = torch.as_tensor(A)
        self.state_shape = (A.shape[0],)
        self.split = split
        self.separable = split is not None
        self.A = Pieces(self.grid, tuple(A.shape), init=A)

    def evaluate(self, l, y):
        return y @ self.A[l].T

    def evaluate_half(self, l, z, part):
        n = self.split[0]
        return z @ (self.A[l][:n, n:] if part == 0 else self.A[l][n:, :n]).T


class Fn(Field):
    """F(l, x) = fn(l, x) for toy problems."""

    def __init__(self, fn, d, layers, T=1.0):
        super().__init__(T=T, layers=layers)
        self.state_shape = (d,)
        self.fn = fn

    def evaluate(self, l, x):
        return self.fn(l, x)


def slope(hs, errs):
    return float(np.polyfit(np.log(hs), np.log(errs), 1)[0])


A_SEP = torch.tensor(
    [[0.0, 0.0, 1.0, 0.3], [0.0, 0.0, -0.2, 0.8], [-1.1, 0.4, 0.0, 0.0], [0.1, -0.7, 0.0, 0.0]], dtype=torch.float64
)


# every explicit scheme whose order the two tests below fit
ORDER_SCHEMES = [
    "euler",
    "midpoint",
    "rk4",
    "rk4_classical",
    "symplectic_euler",
    "symplectic_euler_qp",
    "verlet",
    "momentum",
    "dense",
    "lm2",
]


@pytest.mark.parametrize(
    "name",
    ORDER_SCHEMES,
)
def test_order_on_linear_problem(f64, name):
    """Fitted slope of the error against expm within 0.2 of the declared order."""
    y0 = torch.tensor([[0.6, -0.4, 0.3, 0.9]])
    exact = y0 @ torch.from_numpy(expm(A_SEP.numpy() * 2.0)).T
    Ls = [16, 32, 64, 128]
    nets = [discretize(Linear(A_SEP, L, T=2.0, split=(2, 2)), name) for L in Ls]
    errs = [(net(y0) - exact).abs().max().item() for net in nets]
    assert nets[0].order == SCHEMES[name].order
    assert abs(slope([2.0 / L for L in Ls], errs) - nets[0].order) < 0.2, errs


def test_ck_order_on_second_order_problem(f64):
    """C² on x'' = A x (q₂ = h x'): first order against expm of the first-order system."""
    A = torch.tensor([[-2.0, 0.5], [0.3, -1.0]])
    big = torch.zeros(4, 4)
    big[:2, 2:] = torch.eye(2)
    big[2:, :2] = A
    x0 = torch.tensor([[1.0, -0.5]])
    exact = (torch.cat([x0, torch.zeros(1, 2)], 1) @ torch.from_numpy(expm(big.numpy())).T)[:, :2]
    Ls = [32, 64, 128, 256]
    errs = [(discretize(Linear(A, L), "ck", k=2)(x0) - exact).abs().max().item() for L in Ls]
    assert abs(slope([1 / L for L in Ls], errs) - 1) < 0.2


@pytest.mark.parametrize(
    "name",
    ORDER_SCHEMES,
)
def test_order_on_nonlinear_hamiltonian(f64, name):
    base = Hamiltonian(4, K="blockdiag", init_std=1.0, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base.b_p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    y0 = torch.tensor([[0.5, -1.0, 0.8, 0.2]])
    ref = ODEBlock(base, T=2.0, rtol=1e-12, atol=1e-12)(y0)
    Ls, errs = [16, 32, 64, 128], []
    for L in Ls:
        f = Hamiltonian(4, layers=L, T=2.0, K="blockdiag")
        with torch.no_grad():
            for name_p, p in f.named_parameters():
                p.copy_(dict(base.named_parameters())[name_p].expand_as(p))
        net = discretize(f, name)
        errs.append((net(y0) - ref).abs().max().item())
    assert net.order == SCHEMES[name].order
    assert abs(slope([2 / L for L in Ls], errs) - net.order) < 0.2, errs


def layer_jacobian(net, l, y):
    return torch.autograd.functional.jacobian(lambda z: net.scheme.readout(net.step(l, net.init_state(z[None])))[0], y)


def test_h2_ms1_ms3_layers_are_symplectic(f64):
    g = torch.Generator().manual_seed(5)
    h2 = Hamiltonian(6, layers=4, T=4.0, K="blockdiag", init_std=1.5, generator=g)
    m1, m3 = MS1(6, layers=4, T=4.0, init_std=1.5, generator=g), MS3(6, layers=4, T=4.0, init_std=1.5, generator=g)
    for f in (h2, m1, m3):
        with torch.no_grad():
            for p in f.parameters():
                if p.dim() == 2:  # biases
                    p.normal_(0, 1.0, generator=g)
    J = canonical_J(6)
    cases = [
        (discretize(h2, "symplectic_euler"), lambda l: J),
        (discretize(m3, "symplectic_euler"), lambda l: -J),
        (discretize(m1, "symplectic_euler_qp"), m1.J_at),
    ]
    for net, J_of in cases:
        assert "symplectic" in net.properties
        for l in range(4):
            Phi = layer_jacobian(net, l, torch.randn(6, generator=g))
            assert torch.allclose(Phi.T @ J_of(l) @ Phi, J_of(l), atol=1e-12)


def test_h2_backward_sensitivities_never_vanish(f64):
    """64-layer H2 with random weights: ‖∂y_64/∂y_{64−ℓ}‖₂ >= 1 for every ℓ (Theorem H3)."""
    g = torch.Generator().manual_seed(6)
    f = Hamiltonian(4, layers=64, T=64 * 0.4, K="blockdiag", init_std=2.0, generator=g)
    with torch.no_grad():
        f.b_p.data.normal_(0, 1, generator=g)
        f.b_q.data.normal_(0, 1, generator=g)
    net = discretize(f, "symplectic_euler")
    ys = net.solve(torch.randn(1, 4, generator=g), t=net.times).ys
    Phi = torch.eye(4)
    norms = []
    for l in reversed(range(64)):
        Phi = Phi @ layer_jacobian(net, l, ys[l][0])
        norms.append(torch.linalg.matrix_norm(Phi, 2).item())
    assert min(norms) >= 1 - 1e-10


def test_h1_layers_are_not_symplectic_defect_is_h_squared(f64):
    base = Hamiltonian(4, init_std=1.0, generator=torch.Generator().manual_seed(7))
    y = torch.tensor([0.3, -0.2, 0.5, 0.1])
    J = canonical_J(4)
    Ts, defects = [0.2, 0.1, 0.05, 0.025], []
    for T in Ts:
        f = Hamiltonian(4, T=T)
        f.load_state_dict(base.state_dict())
        Phi = layer_jacobian(discretize(f, "euler"), 0, y)
        defects.append(torch.linalg.matrix_norm(Phi.T @ J @ Phi - J).item())
    assert min(defects) > 1e-6
    assert abs(slope(Ts, defects) - 2) < 0.2


@pytest.fixture
def one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation (10x slower on a loaded machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.slow
def test_energy_over_ten_thousand_steps(f64, one_thread):
    """Symplectic schemes keep the energy error bounded; forward Euler's grows."""
    f = Hamiltonian(2, K="blockdiag", init_std=1.0, generator=torch.Generator().manual_seed(8))
    y0, h, n = torch.tensor([[1.0, 0.5]]), 0.05, 10_000
    H0 = f.energy_at(0, y0)
    drift = {}
    with torch.no_grad():
        for name in ("symplectic_euler", "verlet", "euler"):
            sch, bound = get_scheme(name).for_field(f), BoundField(f)
            state, ys = sch.init(y0), []
            for i in range(n):
                state = sch.step(bound, 0, state, h)
                if i % 10 == 9:
                    ys.append(sch.readout(state))
            errs = (f.energy_at(0, torch.cat(ys)) - H0).abs()
            drift[name] = (errs[: n // 100].max().item(), errs.max().item())
    for name in ("symplectic_euler", "verlet"):
        first, overall = drift[name]
        assert overall < 2 * first + 1e-12 and overall < 0.05 * H0.abs().item()
    first, overall = drift["euler"]
    assert overall > 5 * first


def test_blog_scalar_toys_converge_like_one_over_L(f64):
    alpha, beta = 0.7, 1.3
    Ls = [10, 20, 40, 80, 160]
    e1 = [
        abs(discretize(Fn(lambda l, x: alpha * x, 1, L), "euler")(torch.ones(1, 1)).item() - np.exp(alpha)) for L in Ls
    ]
    e2 = [
        abs(discretize(Fn(lambda l, x: -(beta**2) * x, 1, L), "ck", k=2)(torch.ones(1, 1)).item() - np.cos(beta))
        for L in Ls
    ]
    assert abs(slope([1 / L for L in Ls], e1) - 1) < 0.2
    assert abs(slope([1 / L for L in Ls], e2) - 1) < 0.2


def test_second_order_recurrence_stays_bounded_below_two_L(f64):
    """Both roots of r² − (2 − β²/L²) r + 1 on the unit circle for β < 2L: |x_l| <= |x_0| / cos(θ/2)."""
    L, beta = 10, 19.0
    theta = np.arccos(1 - beta**2 / (2 * L**2))
    net = discretize(Fn(lambda l, x: -(beta**2) * x, 1, 10 * L, T=10.0), "ck", k=2)
    xs = net.solve(torch.ones(1, 1), t=net.times).ys
    assert xs.abs().max().item() <= 1 / np.cos(theta / 2) + 1e-9


def test_velocity_buffer_example(f64):
    u = [1.0, -0.8, 0.6, -0.4]
    f = Fn(lambda l, x: torch.full_like(x, u[l] * 4), 1, 4)  # h = 1/4, so h F = u_l
    nets = discretize(f, "euler"), discretize(f, "momentum", momentum=(0.5, 1.0))
    first, second = (net.solve(torch.zeros(1, 1), t=net.times).ys.flatten().tolist() for net in nets)
    assert np.allclose(first, [0, 1, 0.2, 0.8, 0.4], atol=1e-14)
    assert np.allclose(second, [0, 1, 0.7, 1.15, 0.975], atol=1e-14)


def test_tableaux_check_themselves():
    with pytest.raises(ValueError, match="row 1 of a sums to"):
        Tableau(a=((), (0.4,)), b=(0.5, 0.5), c=(0.0, 0.5))
    with pytest.raises(ValueError, match="weights b must sum to 1"):
        Tableau(a=((), (0.5,)), b=(0.5, 0.6), c=(0.0, 0.5))
