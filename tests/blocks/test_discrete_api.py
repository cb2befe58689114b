"""The discrete net as a Block: one way to call, Solution from solve, per-call input u (gradients reach it), any
forward(t, y) module, schemes that never claim a property that does not hold, module hygiene."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from cde_nets import DiscreteNet, Solution, Stop, discretize
from cde_nets.blocks.models import Classifier
from cde_nets.fields import MS1, NAIS, CubicFriction, Hamiltonian, SecondOrder, canonical_J
from cde_nets.solvers.schemes import SCHEMES, Momentum, Verlet, get_scheme


def _nais(layers=1, T=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return NAIS(3, 2, layers=layers, T=T, eps=0.2, init_std=0.8, generator=g).project_()


# -- calling and solving ------------------------------------------------------------------------------------------
def test_call_returns_a_tensor_and_solve_a_solution(f64):
    net = discretize(Hamiltonian(4, layers=5, T=2.0), "rk4")
    y0 = torch.randn(3, 4)
    sol = net.solve(y0, t=[0.0, 0.8, 2.0])
    assert isinstance(sol, Solution) and torch.equal(sol.y, net(y0))
    assert sol.ts.tolist() == [0.0, 0.8, 2.0] and sol.ys.shape == (3, 3, 4) and torch.equal(sol.ys[0], y0)
    assert torch.equal(sol.ys[-1], sol.y) and torch.equal(sol.ys[1], net.solve(y0, t=net.times).ys[2])
    assert (sol.stats["nfe_forward"], sol.stats["steps_forward"], sol.stats["nfe_backward"]) == (20, 5, 0)
    assert net.times.dtype == torch.float64 and net.times.tolist() == pytest.approx([0, 0.4, 0.8, 1.2, 1.6, 2.0])
    assert sol.depths is None and sol.stop_times is None
    with pytest.raises(ValueError, match=r"`t` must be layer boundaries l·h \(h = 0.4\); 0.5 is not one"):
        net.solve(y0, t=[0.0, 0.5])


def test_stopping_net_returns_a_tensor_and_works_in_sequential_classifier_and_training(f64):
    """`stop=` no longer changes what the net returns: it trains inside nn.Sequential, Classifier and the trainer."""
    from cde_nets.train.trainer import Trainer

    torch.manual_seed(0)
    net = discretize(_nais(), "euler", stop=Stop(eps=1e-3))
    assert net.stop.max_depth is None  # default: L layers
    model = Classifier(net, in_features=2, state_dim=3, n_out=2, input_as_u=True)
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    hist = Trainer(lr=0.05, progress=False).fit(model, (x, y, x, y), epochs=2, batch_size=8)
    assert len(hist) == 2 and np.isfinite(hist[-1]["train_loss"])
    seq = nn.Sequential(
        nn.Linear(2, 4), discretize(CubicFriction(4, T=1.0), "euler", stop={"eps": 1e-6}), nn.Linear(4, 1)
    )
    assert seq(x).shape == (16, 1)


def test_stopping_depths_times_and_a_per_call_rule(f64):
    net = discretize(_nais(), "momentum", momentum=(0.5, 1.0), stop=Stop(1e-2, max_depth=40))
    x0, u = torch.zeros(4, 3), torch.randn(4, 2, generator=torch.Generator().manual_seed(1))
    u = u * torch.tensor([[0.01], [0.3], [1.0], [3.0]])
    sol = net.solve(x0, u)
    assert sol.depths.dtype == torch.long and len(set(sol.depths.tolist())) == 4
    assert torch.equal(sol.stop_times, sol.depths.double() * 0.5)
    tight = net.solve(x0, u, stop=Stop(1e-4, max_depth=200))  # an evaluation rule for one call; the net keeps its own
    assert (tight.depths > sol.depths).all() and torch.equal(net.solve(x0, u).depths, sol.depths)
    full = net.solve(x0, u, stop=None)
    assert full.depths is None and full.stats["steps_forward"] == 1
    with pytest.raises(ValueError, match="`t` saves every sample's state.*`stop`"):
        net.solve(x0, u, t=[0.0, 0.5])


@pytest.mark.parametrize("mode", ["plain", "stopping", "memory-free"])
def test_gradient_reaches_u_as_central_differences_say(f64, mode):
    """d(loss)/du of a NAIS net, discrete, stopping and memory-free momentum, against central differences."""
    field = _nais(layers=3, T=1.5)
    kw = {
        "plain": {},
        "stopping": dict(stop=Stop(1e-3, max_depth=20)),
        "memory-free": dict(momentum=(0.8, 1.0), memory_free=True),
    }[mode]
    net = discretize(field, "momentum" if mode == "memory-free" else "euler", **kw)
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(3, 3, generator=g)
    u = (torch.randn(3, 2, generator=g) * torch.tensor([[0.05], [0.5], [2.0]])).requires_grad_(True)
    c = torch.randn(3, 3, generator=g)
    (c * net(x0, u)).sum().backward()
    fd = torch.zeros_like(u)
    with torch.no_grad():
        for i in range(3):
            for j in range(2):
                e = torch.zeros_like(u)
                e[i, j] = 1e-6
                fd[i, j] = ((c * net(x0, u + e)).sum() - (c * net(x0, u - e)).sum()) / 2e-6
    assert u.grad.abs().max() > 1e-3 and torch.allclose(u.grad, fd, atol=1e-7, rtol=1e-6)


# -- any field, both modes ------------------------------------------------------------------------------------------
class Clock(nn.Module):
    """``F(t, y) = t`` (any y): the stages' times, summed with the scheme's weights, give ``y(T) = y0 + T²/2``."""

    def forward(self, t, y):
        return torch.ones_like(y) * t


@pytest.mark.parametrize("scheme", ["midpoint", "rk4", "verlet"])
def test_plain_module_sees_each_stage_time(f64, scheme):
    """Order >= 2 schemes integrate y' = t exactly only if every stage is evaluated at its own time t_l + c_i h."""
    kw = dict(split=(1, 1)) if scheme == "verlet" else {}
    net = discretize(Clock(), scheme, T=2.0, steps=4, **kw)
    y0 = torch.zeros(3, 2)
    assert torch.allclose(net(y0), torch.full((3, 2), 2.0), atol=1e-14)
    assert discretize(Clock(), "euler", T=2.0, steps=4)(y0)[0, 0].item() == pytest.approx(0.5 * (0 + 0.5 + 1 + 1.5))
    with pytest.raises(ValueError, match="pass `T=` .* and `steps=`"):
        discretize(Clock(), scheme)


# -- schemes never claim what does not hold ----------------------------------------------------------------------------
def _defect(net, y):
    J = canonical_J(4)
    Phi = torch.autograd.functional.jacobian(lambda z: net.scheme.readout(net.step(0, net.init_state(z[None])))[0], y)
    return torch.linalg.matrix_norm(Phi.T @ J @ Phi - J).item()


def test_split_schemes_on_a_non_separable_field_are_labelled_not_symplectic(f64):
    """Hamiltonian(K="full") with split=(2, 2): the layer is not symplectic, so neither label nor properties say so;
    on the separable H2 field the same scheme is H2-DNN and symplectic to 1e-12."""
    g = torch.Generator().manual_seed(5)
    y = torch.tensor([0.3, -0.2, 0.5, 0.1])
    full = Hamiltonian(4, T=0.5, init_std=1.5, generator=g)
    sep = Hamiltonian(4, T=0.5, K="blockdiag", init_std=1.5, generator=g)
    for scheme in ("symplectic_euler", "symplectic_euler_qp", "verlet"):
        net = discretize(full, scheme, split=(2, 2))
        assert "symplectic" not in net.properties and net.scheme.variant == "non-separable"
        assert "not symplectic" in net.architecture[0] and "H2-DNN" not in net.architecture[0]
        assert _defect(net, y) > 1e-3
        good = discretize(sep, scheme)
        assert good.properties == {"symplectic"} and "not symplectic" not in good.architecture[0]
        assert _defect(good, y) < 1e-12
    assert discretize(sep, "symplectic_euler").architecture == ("H2-DNN", "eqs. H12-13")


def test_verlet_declares_the_order_that_holds(f64):
    """Verlet is order 2 on separable fields and order 1 on others; the declared order follows, and the measured
    convergence slope on a non-separable field matches it."""
    from scipy.linalg import expm

    assert SCHEMES["verlet"].order == 2 and discretize(MS1(4), "verlet").order == 2
    A = torch.tensor([[-0.3, 0.8, 0.5, 0.0], [-0.6, 0.1, 0.0, 0.7], [-0.9, 0.2, 0.2, 0.4], [0.3, -1.0, -0.5, 0.1]])

    class Linear(nn.Module):
        def forward(self, t, y):
            return y @ A.T

    y0 = torch.tensor([[0.6, -0.4, 0.3, 0.9]])
    exact = y0 @ torch.from_numpy(expm(A.numpy() * 2.0)).T
    Ls = [32, 64, 128, 256]
    nets = [discretize(Linear(), "verlet", T=2.0, steps=L, split=(2, 2)) for L in Ls]
    errs = [(net(y0) - exact).abs().max().item() for net in nets]
    slope = np.polyfit(np.log([2.0 / L for L in Ls]), np.log(errs), 1)[0]
    assert nets[0].order == 1 and abs(slope - 1) < 0.2, errs


def test_momentum_label_follows_the_parameters_used(f64):
    """SecondOrder(order=1) has no velocity: the scheme creates its own m_l, η_l and the label says so."""
    first = discretize(SecondOrder(2, layers=3, order=1), "momentum")
    assert {"a", "b"} <= dict(first.named_parameters()).keys()
    assert "own m_l, η_l" in first.architecture[0] and "from the field" not in first.architecture[0]
    second = discretize(SecondOrder(2, layers=3), "momentum")
    assert not any(n in ("a", "b") for n, _ in second.named_parameters())
    assert "from the field" in second.architecture[0] and second.scheme.variant == "field velocity"


def test_schemes_are_objects_that_declare_themselves():
    v = get_scheme("verlet")
    assert isinstance(v, Verlet) and v.state == "split" and v.order == 2 and v.coefficients == ()
    m = get_scheme("momentum", momentum=(0.9, 0.5), tie_eta=True)
    assert isinstance(m, Momentum) and m.coefficients == ("a",) and m.state == "velocity"
    assert get_scheme("ck", k=4).lags == 4 and SCHEMES["lm2"].coefficients == ("k_lm",)
    net = DiscreteNet(CubicFriction(4, layers=3), m)  # built directly: the scheme's declaration makes the parameters
    assert net.a.shape == (3, 4) and not hasattr(net, "b")
    with pytest.raises(ValueError, match="scheme 'verlet' needs a \\(p, q\\) split"):
        DiscreteNet(CubicFriction(4), "verlet")  # validated however the net is built
    with pytest.raises(ValueError, match="`split` applies to the split schemes"):
        DiscreteNet(CubicFriction(4), "euler", split=(2, 2))


# -- module hygiene ------------------------------------------------------------------------------------------------
def test_module_hygiene(f64):
    net = discretize(_nais(layers=2), "momentum")
    x0, u = torch.randn(2, 3), torch.randn(2, 2, requires_grad=True)
    out = net(x0, u)
    out.sum().backward()
    twin = copy.deepcopy(net)  # after a forward with a u that needs grad: nothing of the call is stored
    assert torch.equal(twin(x0, u.detach()), out.detach())
    fresh = discretize(_nais(layers=2, seed=9), "momentum")
    fresh.load_state_dict(net.state_dict())
    assert torch.equal(fresh(x0, u.detach()), out.detach())
    assert set(net.state_dict()) >= {"a", "b"}
    f32 = net.to(torch.float32)
    assert f32(x0.float(), u.detach().float()).dtype == torch.float32 and f32.a.dtype == torch.float32
    half = discretize(MS1(4, layers=2), "symplectic_euler_qp").half()  # MS1's half size no longer shadows .half()
    assert half.field.K0.data.dtype == torch.float16
    with pytest.raises(TypeError, match="`y0` is torch.float64 but the field's parameters are torch.float32"):
        f32(x0, u.detach())


def test_tensors_follow_the_input(f64):
    """Every tensor the net makes (state, velocity, times, depths) follows the input's device and dtype."""
    net = discretize(_nais(), "momentum", stop=Stop(1e-3, max_depth=5)).to(torch.float32)
    sol = net.solve(torch.zeros(3, 3, dtype=torch.float32), torch.randn(3, 2, dtype=torch.float32))
    assert sol.y.dtype == torch.float32 and sol.stop_times.dtype == torch.float64
    assert sol.depths.device == sol.y.device == sol.stop_times.device
    plain = discretize(Clock(), "rk4", T=1.0, steps=2)
    assert plain(torch.zeros(2, 2, dtype=torch.float32)).dtype == torch.float32
