"""Memory-free backward of the invertible discrete schemes (cde_nets.blocks.invertible) and the discrete ALF scheme."""

import numpy as np
import pytest
import torch
from scipy.linalg import expm

from cde_nets import discretize
from cde_nets.blocks.invertible import reconstruction_error
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.fields import MS1, MS3, NAIS, CubicFriction, Field, Hamiltonian, SecondOrder
from cde_nets.fields.pieces import Pieces
from cde_nets.solvers.schemes import ALF, LM2


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# name -> (field of L layers, scheme, discretize options, block input dim or None)
CASES = {
    "H2 symplectic_euler": (
        lambda L, g: Hamiltonian(4, layers=L, K="blockdiag", J="structured", generator=g),
        "symplectic_euler",
        {},
        None,
    ),
    "H blockdiag symplectic_euler_qp": (
        lambda L, g: Hamiltonian(4, layers=L, K="blockdiag", generator=g),
        "symplectic_euler_qp",
        {},
        None,
    ),
    "H blockdiag verlet": (
        lambda L, g: Hamiltonian(4, layers=L, K="blockdiag", J="structured", generator=g),
        "verlet",
        {},
        None,
    ),
    "MS1": (lambda L, g: MS1(4, layers=L, generator=g), "symplectic_euler_qp", {}, None),
    "MS3": (lambda L, g: MS3(4, layers=L, generator=g), "symplectic_euler", {}, None),
    "lm2 friction": (lambda L, g: CubicFriction(4, layers=L, zero_init=False, generator=g), LM2(k0=1.0), {}, None),
    "lm2 NAIS u": (lambda L, g: NAIS(4, 3, layers=L, generator=g), LM2(k0=0.8), {}, 3),
    "momentum NAIS u": (lambda L, g: NAIS(4, 3, layers=L, generator=g), "momentum", dict(momentum=(0.9, 0.5)), 3),
    "momentum tied friction": (
        lambda L, g: CubicFriction(4, layers=L, zero_init=False, generator=g),
        "momentum",
        dict(momentum=(0.8, 0.2), tie_eta=True),
        None,
    ),
    "alf hamiltonian": (lambda L, g: Hamiltonian(4, layers=L, generator=g), "alf", {}, None),
    "alf NAIS u": (lambda L, g: NAIS(4, 3, layers=L, generator=g), "alf", {}, 3),
    "alf damped": (lambda L, g: Hamiltonian(4, layers=L, generator=g), ALF(eta=0.9), {}, None),
}


def _pair(case, L=12):
    """The stored-activation net and its memory-free twin on the same field, coefficients moved off their start so
    their gradients are generic."""
    make, scheme, kw, n_u = CASES[case]
    g = _gen(1)
    field = make(L, g)
    stored = discretize(field, scheme, **kw)
    with torch.no_grad():
        for name, p in stored.named_parameters():
            if not name.startswith("field."):  # the scheme's own coefficients (m, η, k_l)
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    free = discretize(field, scheme, memory_free=True, **kw)
    free.load_state_dict(stored.state_dict())
    y0 = 0.5 * torch.randn(6, 4, generator=g)
    u = None if n_u is None else torch.randn(6, n_u, generator=g)
    return stored, free, y0, u


def _grads(net, y0, u, c):
    y0 = y0.clone().requires_grad_(True)
    ins = [y0] + ([] if u is None else [u.clone().requires_grad_(True)])
    out = net(*ins)
    wrt = ins + list(net.parameters())
    return out, torch.autograd.grad((c * out).sum(), wrt, allow_unused=True)


@pytest.mark.parametrize("case", list(CASES))
def test_memory_free_gradients_equal_stored_activation_gradients(f64, case):
    """Output identical; every gradient (y0, u, pieces, the scheme's coefficients, shared parameters such as J's X
    or a learned friction γ) equal to 1e-10 of its scale."""
    stored, free, y0, u = _pair(case)
    c = torch.randn(6, 4, generator=_gen(2))
    out_s, g_s = _grads(stored, y0, u, c)
    out_f, g_f = _grads(free, y0, u, c)
    assert torch.equal(out_s, out_f)
    assert len(g_s) == len(g_f) > 2
    for a, b in zip(g_s, g_f):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a - b).abs().max() <= 1e-10 * max(1.0, a.abs().max().item()), case


def test_memory_free_gradient_against_central_differences(f64):
    """H2 memory-free: d loss / d θ against (loss(θ + ε) − loss(θ − ε)) / 2ε for a few entries of every parameter
    and of y0 (ε = 1e-6: truncation ε² ≈ 1e-12, rounding 1e-16 / ε ≈ 1e-10)."""
    _, net, y0, _ = _pair("H2 symplectic_euler", L=6)
    c = torch.randn(6, 4, generator=_gen(2))
    y0 = y0.requires_grad_(True)
    tensors = [y0, *net.parameters()]
    grads = torch.autograd.grad((c * net(y0)).sum(), tensors)
    eps = 1e-6
    with torch.no_grad():
        for t, g in zip(tensors, grads):
            flat, gflat = t.view(-1), g.reshape(-1)
            for i in torch.randperm(flat.numel(), generator=_gen(3))[:4].tolist():
                old = flat[i].item()
                flat[i] = old + eps
                up = (c * net(y0)).sum().item()
                flat[i] = old - eps
                down = (c * net(y0)).sum().item()
                flat[i] = old
                assert abs((up - down) / (2 * eps) - gflat[i].item()) < 1e-7 * max(1.0, abs(gflat[i].item()))


# bound on max|ŷ0 − y0| / max|y0| after 1000 layers forwards and 1000 inverse layers back, and why
RECONSTRUCTION = {
    # shears (additive coupling) and ALF with η = 1: each inverse layer adds a few ulps and multiplies nothing, so
    # the error grows like L ε ≈ 2e-13 (times the flow's conditioning, O(1) at T = 1)
    "H2 symplectic_euler": 1e-12,
    "H blockdiag symplectic_euler_qp": 1e-12,
    "H blockdiag verlet": 1e-12,
    "MS1": 1e-12,
    "MS3": 1e-12,
    "alf hamiltonian": 1e-12,
    "alf NAIS u": 1e-12,
    # k_l = 1: x_{l−1} = x_{l+1} − h F(x_l), the same leapfrog backwards: no amplification either
    "lm2 friction": 1e-12,
}


@pytest.mark.parametrize("case", list(RECONSTRUCTION))
def test_reconstruction_error_at_depth_1000(f64, case):
    make, scheme, kw, n_u = CASES[case]
    g = _gen(4)
    net = discretize(make(1000, g), scheme, memory_free=True, **kw)
    y0 = torch.randn(8, 4, generator=g)
    u = None if n_u is None else torch.randn(8, n_u, generator=g)
    err = reconstruction_error(net, y0, u)
    assert err < RECONSTRUCTION[case], err


def test_reconstruction_error_grows_like_one_over_m_to_the_L_for_momentum(f64):
    """Momentum divides by m per layer: at depth 1000, m = 0.99 leaves at most ε (1/m)^L ≈ 5e-12 (bounded by
    1e-10), m = 0.9 ε 0.9^-1000 ≈ 1e30 (the input is lost; the cubic friction overflows it to nan): the reason the
    docs ask for m near 1 at great depth."""
    g = _gen(5)
    errs = {}
    for m in (0.99, 0.9):
        net = discretize(
            CubicFriction(4, layers=1000, zero_init=False, generator=g), "momentum", momentum=(m, 0.5), memory_free=True
        )
        errs[m] = reconstruction_error(net, torch.randn(8, 4, generator=g))
    assert errs[0.99] < 1e-10 and not errs[0.9] < 1.0, errs


@pytest.mark.parametrize("case", ["H2 symplectic_euler", "MS1", "lm2 friction", "momentum NAIS u", "alf hamiltonian"])
def test_memory_saved_for_backward_does_not_grow_with_depth(f64, case):
    """The memory-free forward saves its last state only: the same bytes at 10 and 300 layers."""
    make, scheme, kw, n_u = CASES[case]
    saved = {}
    for L in (10, 300):
        net = discretize(make(L, _gen(6)), scheme, memory_free=True, **kw)
        # small inputs: the cubic friction's lm2 net overflows from unit ones (the net now says so instead of
        # returning NaN), and this test is about memory only
        y0 = (0.1 * torch.randn(16, 4)).requires_grad_()
        u = None if n_u is None else torch.randn(16, n_u, requires_grad=True)
        mem = SavedTensorMemory(exclude=[*net.parameters(), y0] + ([] if u is None else [u]))
        with mem:
            out = net(y0) if u is None else net(y0, u)
        out.sum().backward()
        saved[L] = mem.peak_bytes
    assert saved[300] == saved[10] <= 2 * 16 * 4 * 8, saved


def test_alf_scheme_is_second_order_and_counts_its_first_evaluation(f64):
    """One ALF step per layer on y' = A y: the error against expm falls like h² (fitted slope 2 ± 0.2); the first
    layer also reads v_0 = F_0(y_0)."""
    A = torch.tensor([[-0.3, 1.0], [-1.2, 0.1]])

    class Lin(Field):
        def __init__(self, L):
            super().__init__(T=2.0, layers=L)
            self.state_shape = (2,)
            self.A = Pieces(self.grid, (2, 2), init=A)

        def evaluate(self, l, y):
            return y @ self.A[l].T

    y0 = torch.tensor([[0.6, -0.4]])
    exact = y0 @ torch.from_numpy(expm(A.numpy() * 2.0)).T
    Ls = [16, 32, 64, 128]
    errs = [(discretize(Lin(L), "alf")(y0) - exact).abs().max().item() for L in Ls]
    assert abs(np.polyfit(np.log([2.0 / L for L in Ls]), np.log(errs), 1)[0] - 2) < 0.2, errs
    net = discretize(Lin(5), "alf")
    assert net.solve(y0).stats["nfe_forward"] == 6 and net.order == 2
    assert net.architecture == ("asynchronous leapfrog (MALI) net, state (y, v), invertible", "MALI Alg. 1")


def test_errors_name_the_fix(f64):
    for scheme, kw in [("euler", {}), ("rk4", {}), ("midpoint", {}), ("ck", {"k": 2}), ("dense", {"k": 3})]:
        with pytest.raises(ValueError, match=f"explicitly invertible scheme.*{scheme!r} is not.*drop `memory_free`"):
            discretize(CubicFriction(4, layers=3), scheme, memory_free=True, **kw)
    with pytest.raises(ValueError, match="exact only on a separable field.*`split=` evaluates the whole field"):
        discretize(CubicFriction(4, layers=3), "verlet", split=(2, 2), memory_free=True)
    with pytest.raises(ValueError, match="Hamiltonian\\(K='blockdiag'\\), MS1 or MS3, or drop `memory_free`"):
        discretize(SecondOrder(2, layers=3), "symplectic_euler", memory_free=True)
    with pytest.raises(ValueError, match="drop `momentum`, `tie_eta` and `memory_free`"):
        discretize(SecondOrder(2, layers=3), "momentum", memory_free=True)
    with pytest.raises(ValueError, match="rounding grows like \\(1/m\\)\\^L.*`momentum=\\(0.9, 1.0\\)`"):
        discretize(CubicFriction(4, layers=3), "momentum", memory_free=True)
    with pytest.raises(ValueError, match="k_l starts at 0.*`discretize\\(field, LM2\\(k0=1.0\\), memory_free=True\\)`"):
        discretize(CubicFriction(4, layers=3), "lm2", memory_free=True)
    net = discretize(CubicFriction(4, layers=3), LM2(k0=1.0), memory_free=True)
    with torch.no_grad():
        net.k_lm[2] = 0.0
    with pytest.raises(ValueError, match="divides by k_l, but k_2 = 0"):
        net(torch.randn(2, 4))
    with pytest.raises(ValueError, match="ALF damping `eta` must lie in \\(0, 1\\] and differ from 1/2"):
        ALF(eta=0.5)


def test_a_second_derivative_through_the_memory_free_backward_is_refused_by_name(f64):
    """Its backward pass takes each layer's product without a graph: the Hessian came out as zeros."""
    stored, free, y0, u = _pair("lm2 friction", L=4)
    x = y0[:1].clone().requires_grad_(True)
    first = torch.autograd.grad(free(x).square().sum(), x)[0]
    again = torch.autograd.grad(free(x).square().sum(), x, create_graph=True)[0]
    assert torch.equal(first, again)  # create_graph for a first derivative alone changes nothing
    with pytest.raises(ValueError, match=r"memory_free=True\) gives first derivatives only.*memory_free=False"):
        torch.autograd.functional.hessian(lambda z: free(z).square().sum(), x.detach())
    assert torch.autograd.functional.hessian(lambda z: stored(z).square().sum(), x.detach()).abs().max() > 0
