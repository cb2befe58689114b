"""Trajectory regularisers on ODEBlock and DiscreteNet (float64): the integrated values against Gauss-Legendre
quadrature of the same integrands along the trajectory, the discrete sums against their definitions and their
convergence orders, gradients against finite differences in every gradient method, and the refusals."""

import numpy as np
import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, Regularisation, discretize, integrated_terms, odeint
from cde_nets.regularisers import jacobian_frobenius, kinetic_energy, taylor

REF = dict(rtol=1e-12, atol=1e-12)
NAMES = ("kinetic", "jacobian", "taylor2")


class Diagonal(nn.Module):
    """``F(t, y) = (1 + t) tanh(a ⊙ y + c)``: its Jacobian is diagonal, so one Rademacher probe gives
    ``‖εᵀ ∂F/∂y‖² = ‖∂F/∂y‖²_F`` exactly."""

    def __init__(self, d=3):
        super().__init__()
        self.a = nn.Parameter(torch.linspace(-1.1, 0.9, d, dtype=torch.float64))
        self.c = nn.Parameter(torch.linspace(0.3, -0.2, d, dtype=torch.float64))

    def forward(self, t, y):
        return (1 + t) * torch.tanh(self.a * y + self.c)


def _x(n=4, d=3, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _quadrature(field, x, T, n=30):
    """Per-sample ``∫₀ᵀ ‖F‖²``, ``∫₀ᵀ ‖∂F/∂y‖²_F`` (torch.func.jacrev) and ``∫₀ᵀ ‖∂F/∂t + (∂F/∂y) F‖²``
    (torch.func.jvp, forward mode) by Gauss-Legendre on a reference trajectory."""
    nodes, weights = np.polynomial.legendre.leggauss(n)
    ts = torch.tensor([0.0, *(T / 2 * (nodes + 1))], dtype=torch.float64)
    with torch.no_grad():
        ys = odeint(field, x, ts, **REF)[1:]
    out = torch.zeros(3, x.shape[0], dtype=torch.float64)
    for w, t, y in zip(weights, ts[1:], ys):
        for i in range(x.shape[0]):
            F = field(t, y[i : i + 1])[0]
            J = torch.func.jacrev(lambda yi, s=t: field(s, yi[None])[0])(y[i])
            _, d2 = torch.func.jvp(lambda s, yi: field(s, yi[None])[0], (t, y[i]), (torch.ones_like(t), F))
            out[:, i] += w * T / 2 * torch.stack([F.square().sum(), J.square().sum(), d2.square().sum()]).detach()
    return out.mean(1)


def test_ode_block_regularisers_match_quadrature_of_the_integrands():
    field, x, T = Diagonal(), _x(), 0.9
    block = ODEBlock(field, T, rtol=1e-10, atol=1e-10, regularisation=Regularisation(NAMES, noise="rademacher"))
    sol = block.solve(x)
    torch.testing.assert_close(sol.y, odeint(field, x, torch.tensor([0.0, T], dtype=torch.float64), **REF)[-1])
    expected = _quadrature(field, x, T)
    for name, q in zip(NAMES, expected):
        # the integrals stay out of the step-size control: good to ~100× the solver's 1e-10, not to it
        torch.testing.assert_close(sol.regularisation[name].detach(), q, rtol=1e-7, atol=0)


def test_hutchinson_jacobian_term_is_unbiased_on_a_full_jacobian():
    """A field with a full Jacobian and Gaussian probes: the mean over 4000 copies of one point lies within three
    standard errors of the quadrature of ``‖∂F/∂y‖²_F``."""
    torch.manual_seed(0)
    field = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    class Auto(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = field

        def forward(self, t, y):
            return self.net(y)

    f, T = Auto(), 0.6
    block = ODEBlock(f, T, rtol=1e-8, atol=1e-8, regularisation=Regularisation(("jacobian",)))
    x = _x(1)
    means = []
    for _ in range(40):  # 40 batches of 100 probes: their means' spread gives the standard error
        means.append(float(block.solve(x.expand(100, 3)).regularisation["jacobian"].detach()))
    exact = float(_quadrature(f, x, T)[1])
    assert abs(np.mean(means) - exact) < 3 * np.std(means, ddof=1) / 40**0.5
    assert np.std(means) > 0  # the probes differ between calls


@pytest.mark.slow
@pytest.mark.parametrize("gradient", ["checkpoint", "adjoint", "backprop", "symplectic"])
def test_ode_block_regularised_loss_gradient_matches_finite_differences(gradient):
    field, x, T = Diagonal(), _x(3), 0.7
    block = ODEBlock(
        field, T, rtol=1e-11, atol=1e-11, gradient=gradient, regularisation=Regularisation(NAMES, noise="rademacher")
    )

    def loss():
        torch.manual_seed(5)  # one probe for every evaluation
        sol = block.solve(x)
        return sol.y.square().sum() + sum(sol.regularisation.values())

    grads = torch.autograd.grad(loss(), [field.a, field.c])
    eps = 1e-6
    for p, g in zip((field.a, field.c), grads):
        for i in range(p.numel()):
            with torch.no_grad():
                p[i] += eps
                up = float(loss())
                p[i] -= 2 * eps
                down = float(loss())
                p[i] += eps
            assert float(g[i]) == pytest.approx((up - down) / (2 * eps), rel=1e-6, abs=1e-8)


@pytest.mark.slow
def test_a_regularised_block_after_a_layer_in_every_gradient_method():
    """An input that requires grad (any layer before the block): checkpoint and adjoint solve forward without a
    graph, where the state is a view that says it requires grad while its derivatives flow to its base; the terms
    raised 'appears to not have been used in the graph'. Now every method gives backprop's gradient."""
    x = _x(3)
    grads = {}
    for gradient in ("backprop", "checkpoint", "adjoint", "symplectic"):
        torch.manual_seed(0)
        lin, field = nn.Linear(3, 3).double(), Diagonal()
        block = ODEBlock(
            field,
            0.7,
            rtol=1e-11,
            atol=1e-11,
            gradient=gradient,
            regularisation=Regularisation(NAMES, noise="rademacher"),
        )
        sol = block.solve(lin(x))
        loss = sol.y.square().sum() + sum(sol.regularisation.values())
        grads[gradient] = torch.autograd.grad(loss, [lin.weight, field.a])
    for gradient in ("checkpoint", "adjoint", "symplectic"):
        for a, b in zip(grads[gradient], grads["backprop"]):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_regularised_block_takes_the_unregularised_steps():
    field, x = Diagonal(), _x(64, seed=9)
    with torch.no_grad():
        field.a.mul_(4)
    plain = ODEBlock(field, 1.0, rtol=1e-6, atol=1e-6)
    regularised = ODEBlock(field, 1.0, rtol=1e-6, atol=1e-6, regularisation=Regularisation(NAMES))
    reg, ref = regularised.solve(x), plain.solve(x)
    torch.testing.assert_close(reg.y, ref.y, rtol=0, atol=1e-12)
    assert reg.stats["nfe_forward"] == ref.stats["nfe_forward"]
    assert reg.stats["rejected_forward"] == ref.stats["rejected_forward"]


def test_trainer_terms_read_the_blocks_of_a_model():
    """Blocks nested in a model report into the open collection: each term is the sum over the blocks that
    integrated it, the same numbers as each block's own solution."""
    x = _x()
    cont = ODEBlock(Diagonal(), 0.5, rtol=1e-9, atol=1e-9, regularisation=Regularisation(NAMES, noise="rademacher"))
    disc = discretize(Diagonal(), "rk4", T=0.5, steps=4, regularisers=("kinetic",))
    model = nn.Sequential(cont, disc)
    torch.manual_seed(3)
    with integrated_terms() as terms:
        model(x)
    torch.manual_seed(3)
    first = cont.solve(x)
    second = disc.solve(first.y)
    both = first.regularisation["kinetic"] + second.regularisation["kinetic"]
    with integrated_terms():
        torch.manual_seed(3)
        model(x)
        assert float(kinetic_energy(0.1).fn(model).detach()) == float(both.detach())
        assert float(jacobian_frobenius(0.1).fn(model).detach()) == float(first.regularisation["jacobian"].detach())
        assert float(taylor(0.1).fn(model).detach()) == float(first.regularisation["taylor2"].detach())
    assert float(terms["kinetic"].detach()) == float(both.detach()) and set(terms) == set(NAMES)
    assert terms.nfe_forward == first.stats.nfe_forward + second.stats.nfe_forward
    with pytest.raises(RuntimeError, match="integrated_terms"):
        kinetic_energy(0.1).fn(model)  # no collection open
    with integrated_terms(), pytest.raises(ValueError, match="integrated 'kinetic'"):
        ODEBlock(Diagonal(), 0.5)(x)
        kinetic_energy(0.1).fn(model)


def test_trainer_fits_with_a_regularised_block():
    from cde_nets.train.trainer import Trainer

    torch.manual_seed(0)
    x, y = _x(32), _x(32, seed=2)
    block = ODEBlock(Diagonal(), 0.5, rtol=1e-6, atol=1e-6, regularisation=Regularisation(("kinetic", "jacobian")))
    hist = Trainer(task="regression", lr=1e-2, progress=False, regularisers=[kinetic_energy(1.0)]).fit(
        block, (x, y, None, None), epochs=2, batch_size=32
    )
    assert hist[-1]["reg_kinetic"] == pytest.approx(float(block.solve(x).regularisation["kinetic"].detach()), rel=0.2)


def test_euler_sums_are_the_riemann_sums_of_the_layer_states():
    """``x_{l+1} = x_l + h F(x_l)``: the net's terms are ``Σ_l h ‖F(x_l)‖²`` and ``Σ_l h ‖∂F/∂x(x_l)‖²_F``."""
    field, x, h = Diagonal(), _x(), 0.1
    net = discretize(field, "euler", T=1.0, steps=10, regularisers=("kinetic", "jacobian"), noise="rademacher")
    terms = net.solve(x).regularisation
    states = net.layer_states(x)[:-1]
    ts = [torch.tensor(l * h, dtype=torch.float64) for l in range(10)]
    kin = sum(h * field(t, s).square().sum(1) for t, s in zip(ts, states))
    jac = sum(
        h * ((1 + t) * field.a / torch.cosh(field.a * s + field.c) ** 2).square().sum(1) for t, s in zip(ts, states)
    )
    torch.testing.assert_close(terms["kinetic"], kin.mean(), rtol=1e-14, atol=0)
    torch.testing.assert_close(terms["jacobian"], jac.mean(), rtol=1e-14, atol=0)


@pytest.mark.parametrize(("scheme", "order"), [("euler", 1), ("midpoint", 2), ("rk4", 4)])
def test_discrete_terms_converge_to_the_integrals_at_the_scheme_order(scheme, order):
    field, x, T = Diagonal(), _x(), 1.0
    exact = _quadrature(field, x, T)
    errors = []
    for steps in (16, 32, 64):
        net = discretize(field, scheme, T=T, steps=steps, regularisers=("kinetic", "jacobian"), noise="rademacher")
        terms = net.solve(x).regularisation
        errors.append([abs(float(terms[n].detach()) - float(q)) for n, q in zip(("kinetic", "jacobian"), exact)])
    for k in range(2):
        rates = [np.log2(errors[i][k] / errors[i + 1][k]) for i in range(2)]
        assert min(rates) > order - 0.2, rates


def test_discrete_regularised_gradient_matches_finite_differences():
    field, x = Diagonal(), _x(3)
    net = discretize(field, "midpoint", T=0.8, steps=5, regularisers=("kinetic", "jacobian"), noise="rademacher")

    def loss():
        sol = net.solve(x)
        return sol.y.square().sum() + sol.regularisation["kinetic"] + sol.regularisation["jacobian"]

    (g,) = torch.autograd.grad(loss(), [field.a])
    eps = 1e-6
    for i in range(3):
        with torch.no_grad():
            field.a[i] += eps
            up = float(loss())
            field.a[i] -= 2 * eps
            down = float(loss())
            field.a[i] += eps
        assert float(g[i]) == pytest.approx((up - down) / (2 * eps), rel=1e-7)


def test_steer_draws_the_end_time_in_training_only():
    """``F = −y`` gives ``y(T') = e^{−T'} x``, so the end time of each call can be read off the result."""

    class Decay(nn.Module):
        def forward(self, t, y):
            return -y

    block = ODEBlock(Decay(), 1.0, rtol=1e-10, atol=1e-10, regularisation=Regularisation(steer=0.25))
    x = torch.ones(1, 1, dtype=torch.float64)
    ends = [-float(torch.log(block(x))) for _ in range(20)]
    assert all(0.75 - 1e-8 <= e <= 1.25 + 1e-8 for e in ends) and max(ends) - min(ends) > 0.1
    block.eval()
    assert -float(torch.log(block(x))) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda f: ODEBlock(f, 1.0, regularisation=Regularisation(("energy",))),
            "`regularisers` must hold distinct names",
        ),
        (
            lambda f: ODEBlock(f, 1.0, regularisation=Regularisation(("jacobian",), noise="uniform")),
            "`noise` must be one of",
        ),
        (
            lambda f: ODEBlock(f, 1.0, regularisation=Regularisation(("kinetic",), noise="rademacher")),
            "drop `noise` or add 'jacobian'",
        ),
        (
            lambda f: ODEBlock(f, 1.0, method="gl4", step_size=0.1, regularisation=Regularisation(("kinetic",))),
            "explicit methods",
        ),
        (lambda f: ODEBlock(f, 1.0, stop={"eps": 0.1}, regularisation=Regularisation(("kinetic",))), "no `stop`"),
        (lambda f: ODEBlock(f, 1.0, regularisation=Regularisation(steer=1.0)), "`steer` must be the half-width"),
        (lambda f: discretize(f, "momentum", T=1.0, steps=4, regularisers=("kinetic",)), "explicit Runge-Kutta"),
        (lambda f: discretize(f, "euler", T=1.0, steps=4, regularisers=("taylor2",)), "'taylor2' has no discrete"),
    ],
)
def test_bad_settings_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build(Diagonal())


def test_per_sample_calls_of_a_regularised_block_are_refused():
    block = ODEBlock(Diagonal(), 1.0, regularisation=Regularisation(("kinetic",)))
    with pytest.raises(ValueError, match="drop `event`"):
        block.solve(_x(), t_end=torch.full((4,), 0.5, dtype=torch.float64))


def test_saved_times_and_a_backward_solve_integrate_over_the_span_solved():
    """Through ``t = [0, T/2, T]`` the integrals are those of the call; solving back from ``y(T)`` over
    ``[T, 0]`` retraces the trajectory, so its (non-negative) integrals are the same."""
    field, x, T = Diagonal(), _x(), 0.8
    block = ODEBlock(field, T, rtol=1e-11, atol=1e-11, regularisation=Regularisation(("kinetic", "taylor2")))
    whole = block.solve(x)
    forward = {k: float(v.detach()) for k, v in whole.regularisation.items()}
    sol = block.solve(x, t=torch.tensor([0.0, T / 2, T], dtype=torch.float64))
    assert sol.ys.shape == (3, 4, 3)
    for k, v in sol.regularisation.items():
        assert float(v.detach()) == pytest.approx(forward[k], rel=1e-12)
    back = block.solve(whole.y.detach(), t=torch.tensor([T, 0.0], dtype=torch.float64))
    torch.testing.assert_close(back.y, x, rtol=1e-8, atol=1e-8)
    assert set(back.regularisation) == set(forward)
    for k, v in back.regularisation.items():
        assert float(v.detach()) == pytest.approx(forward[k], rel=1e-7)


def test_regularisers_refuse_per_sample_steps():
    with pytest.raises(ValueError, match="controller='batch' with regularisers"):
        ODEBlock(Diagonal(), T=1.0, controller="per_sample", regularisation=Regularisation(("kinetic",)))
