"""Forward sensitivity: the Jacobian of a solve by forward-mode differentiation through its steps, in both doors.

Its gradient is the derivative of the computed solution, adaptive step sizes included, so it equals backprop's to
rounding; directional derivatives of ``y' = A y`` are ``e^{At} v`` (and, in ``A``, the off-diagonal block of the
exponential of ``[[A, V], [0, A]]``, Van Loan 1978, "Computing integrals involving the matrix exponential")."""

from __future__ import annotations

import pytest
import torch
from scipy.linalg import expm
from torch import nn

from cde_nets import Backprop, Forward, ODEBlock, odeint, sensitivity
from cde_nets.fields import CubicFriction, Hamiltonian

TIMES = torch.tensor([0.0, 0.3, 0.55, 1.0], dtype=torch.float64)


class MLP(nn.Module):
    """``F(t, y) = W2 tanh(W1 y + b1) + b2``."""

    def __init__(self, width: int = 6, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1 = nn.Linear(2, width).double()
        self.l2 = nn.Linear(width, 2).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, t, y):
        return self.l2(torch.tanh(self.l1(y)))


class Linear(nn.Module):
    def __init__(self, A: torch.Tensor):
        super().__init__()
        self.A = nn.Parameter(A)

    def forward(self, t, y):
        return y @ self.A.T


def _block_grads(field, gradient, y0, **kw):
    block = ODEBlock(field, gradient=gradient, **kw)
    sol = block.solve(y0, t=TIMES)
    w = torch.linspace(0.5, 1.5, sol.ys.numel(), dtype=torch.float64).view(sol.ys.shape)
    params = [p for p in field.parameters() if p.requires_grad]
    return sol, torch.autograd.grad((w * sol.ys).sin().sum(), [*params, y0])


def _rel(a, b) -> float:
    num = sum(float((x - y).norm()) ** 2 for x, y in zip(a, b)) ** 0.5
    return num / sum(float(y.norm()) ** 2 for y in b) ** 0.5


def test_block_rk4_hamiltonian_with_pieces_equals_backprop():
    g = torch.Generator().manual_seed(3)
    field = Hamiltonian(2, layers=4, T=1.0, generator=g).double()
    y0 = torch.randn(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    fwd_sol, fwd = _block_grads(field, Forward(), y0, method="rk4", step_size=0.125)
    back_sol, back = _block_grads(field, Backprop(), y0, method="rk4", step_size=0.125)
    assert torch.equal(fwd_sol.ys, back_sol.ys)
    assert _rel(fwd, back) < 1e-10
    # one solve carries every direction: the steps and evaluations of backprop's (8 steps of the grid, two more
    # for the times inside them)
    assert fwd_sol.stats.steps_forward == back_sol.stats.steps_forward == 10
    assert fwd_sol.stats.nfe_forward == back_sol.stats.nfe_forward == 40


@pytest.mark.parametrize("steps", ["differentiated", "fixed"])
def test_block_dopri5_cubic_friction_equals_backprop_with_the_same_steps(steps):
    """The adaptive step sizes as functions of the state (the default) or held: as backprop's ``steps``."""
    g = torch.Generator().manual_seed(0)
    field = CubicFriction(2, layers=2, gamma=0.5, zero_init=False, generator=g).double()
    y0 = torch.randn(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    kw = {"rtol": 1e-4, "atol": 1e-6}
    fwd_sol, fwd = _block_grads(field, Forward(steps=steps), y0, **kw)
    _, back = _block_grads(field, Backprop(steps=steps), y0, **kw)
    assert fwd_sol.stats.steps_forward > 3
    assert _rel(fwd, back) < 1e-10
    if steps == "differentiated":
        _, held = _block_grads(field, Backprop(steps="fixed"), y0, **kw)
        assert _rel(held, back) > 1e-8  # the steps' tangents matter at this tolerance: the test can tell


def test_odeint_gradient_equals_backprop_and_central_differences():
    func = MLP()
    y0 = torch.tensor([[0.3, -0.7], [1.1, 0.2]], dtype=torch.float64, requires_grad=True)
    kw = {"rtol": 1e-6, "atol": 1e-8, "method": "dopri5"}

    def loss(gradient):
        return odeint(func, y0, TIMES, gradient=gradient, **kw).square().sum()

    fwd = torch.autograd.grad(loss("forward"), [*func.parameters(), y0])
    back = torch.autograd.grad(loss("backprop"), [*func.parameters(), y0])
    assert _rel(fwd, back) < 1e-10
    w = func.l1.weight
    h = 1e-6
    for idx in [(0, 0), (3, 1)]:
        with torch.no_grad():
            w[idx] += h
            up = float(loss("backprop"))
            w[idx] -= 2 * h
            down = float(loss("backprop"))
            w[idx] += h
        assert abs((up - down) / (2 * h) - float(fwd[0][idx])) < 1e-6 * max(1.0, abs(float(fwd[0][idx])))


def test_directional_derivative_of_a_linear_field_is_the_exponential():
    g = torch.Generator().manual_seed(1)
    A = torch.randn(3, 3, generator=g, dtype=torch.float64) * 0.7
    V = torch.randn(3, 3, generator=g, dtype=torch.float64)
    y0 = torch.randn(3, generator=g, dtype=torch.float64)
    v = torch.randn(3, generator=g, dtype=torch.float64)
    func = Linear(A.clone())
    kw = {"rtol": 1e-13, "atol": 1e-13, "method": "dopri5"}
    ys, dys = sensitivity.jvp(func, y0, TIMES, tangent_y0=v, **kw)
    _, dA = sensitivity.jvp(func, y0, TIMES, tangent_params={"A": V}, **kw)
    M = torch.zeros(6, 6, dtype=torch.float64)
    M[:3, :3], M[:3, 3:], M[3:, 3:] = A, V, A
    for i, ti in enumerate(TIMES.tolist()):
        E = torch.from_numpy(expm(A.numpy() * ti))
        assert torch.allclose(ys[i], E @ y0, rtol=0, atol=1e-11)
        assert float((dys[i] - E @ v).norm() / (E @ v).norm()) < 1e-10
        exact = torch.from_numpy(expm(M.numpy() * ti))[:3, 3:] @ y0
        assert float((dA[i] - exact).norm()) < 1e-10 * max(1.0, float(exact.norm()))


def test_jvp_of_a_block_is_the_jacobian_applied():
    """The directional derivative of a block equals the full Jacobian (``gradient="forward"``) contracted."""
    g = torch.Generator().manual_seed(5)
    field = Hamiltonian(2, layers=2, T=1.0, generator=g).double()
    block = ODEBlock(field, rtol=1e-6, atol=1e-8, gradient="forward")
    y0 = torch.randn(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, generator=g, dtype=torch.float64)
    name, p = next(iter(block.named_parameters()))
    vp = torch.randn(p.shape, generator=g, dtype=torch.float64)
    y, dy = sensitivity.jvp(block, y0, tangent_y0=v, tangent_params={name: vp})
    assert block.gradient == Forward() and not dy.requires_grad
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    gp, gy = torch.autograd.grad((w * block(y0)).sum(), [p, y0])
    assert abs(float((w * dy).sum()) - float((gp * vp).sum() + (gy * v).sum())) < 1e-10 * float(dy.norm())


def test_forward_only_call_and_piecewise_odeint_closure():
    """No gradient asked: one plain solve. A function closing over a tensor gets its tangent in the closure."""
    A = torch.tensor([[0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64, requires_grad=True)

    def func(t, y):
        return y @ A.T

    y0 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    with torch.no_grad():
        plain = odeint(
            func, y0, TIMES, method="rk4", options={"step_size": 0.05}, gradient="forward", adjoint_params=(A,)
        )
    out = odeint(func, y0, TIMES, method="rk4", options={"step_size": 0.05}, gradient="forward", adjoint_params=(A,))
    assert torch.equal(out.detach(), plain)
    (gA,) = torch.autograd.grad(out[-1, 0], A)
    ref = odeint(func, y0, TIMES, method="rk4", options={"step_size": 0.05})
    (bA,) = torch.autograd.grad(ref[-1, 0], A)
    assert torch.allclose(gA, bA, rtol=1e-12, atol=1e-14)


def test_constants_memoised_before_the_solve_are_not_reused():
    """Inside one block call a field memoises its constants (``gathered``): built from the plain parameters before
    the solve, reused by the tangent solve they would carry no tangent, and the parameters' gradient would be zero."""
    from cde_nets.blocks.gathering import gathered

    g = torch.Generator().manual_seed(2)
    field = CubicFriction(2, layers=2, gamma=0.5, zero_init=False, generator=g).double()
    y0 = torch.randn(2, 2, generator=g, dtype=torch.float64)
    grads = []
    for gradient in ("forward", "backprop"):
        with gathered(field):
            field(torch.tensor(0.0, dtype=torch.float64), y0)  # fills the memo under grad mode
            y = ODEBlock(field, method="rk4", step_size=0.25, gradient=gradient)(y0)
            grads.append(torch.autograd.grad(y.square().sum(), list(field.parameters())))
    assert _rel(*grads) < 1e-10


def test_events_in_both_doors_equal_backprop():
    """The event's time and state are differentiated around the solve to it (implicit function theorem), which
    forward mode serves as backprop does."""
    func = Linear(torch.tensor([[0.1, 1.0], [-1.0, 0.0]], dtype=torch.float64))
    y0 = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    grads = []
    for gradient in ("forward", "backprop"):
        t_event, sol = odeint(
            func,
            y0,
            torch.tensor([0.0, 5.0], dtype=torch.float64),
            event_fn=lambda t, y: y[..., 0].sum(),
            gradient=gradient,
        )
        grads.append(torch.autograd.grad(t_event + sol[-1].sum(), [func.A, y0]))
    assert _rel(*grads) < 1e-10
    g = torch.Generator().manual_seed(3)
    field = Hamiltonian(2, layers=2, T=1.0, generator=g).double()
    y0 = torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    grads = []
    for gradient in ("forward", "backprop"):
        sol = ODEBlock(field, rtol=1e-6, atol=1e-8, gradient=gradient).solve(y0, event=lambda t, y: y[:, 0] - 0.1)
        assert bool(sol.fired.any())
        grads.append(torch.autograd.grad(sol.y.square().sum() + sol.stop_times.sum(), [*field.parameters(), y0]))
    assert _rel(*grads) < 1e-10


def test_refusals_name_the_argument_and_the_fix():
    field = Hamiltonian(2, layers=2, T=1.0).double()
    with pytest.raises(ValueError, match="method='alf'.*gradient='reversible'"):
        ODEBlock(field, method="alf", step_size=0.1, gradient="forward")
    with pytest.raises(ValueError, match="gradient='forward' differentiates the library's own Runge-Kutta stepper"):
        ODEBlock(field, method="gl4", step_size=0.25, gradient="forward")
    with pytest.raises(ValueError, match="does not serve per-sample steps"):
        ODEBlock(field, controller="per_sample", gradient="forward")
    with pytest.raises(ValueError, match="steps='torchdiffeq'"):
        Forward(steps="torchdiffeq")
    func, y0 = MLP(), torch.ones(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="method='explicit_adams'"):
        odeint(func, y0, TIMES, method="explicit_adams", gradient="forward")
    with pytest.raises(ValueError, match="gradient='forward' does not serve per-sample steps"):
        odeint(func, y0, TIMES, controller="per_sample", gradient="forward")
    with pytest.raises(ValueError, match="above max_entries=10.*gradient='checkpoint'"):
        odeint(func, y0, TIMES, gradient=Forward(max_entries=10)).sum().backward()
    hidden = torch.ones(2, 2, dtype=torch.float64, requires_grad=True)
    box = [hidden]
    with pytest.raises(ValueError, match=r"tensor to differentiate \(shape \(2, 2\)\)"):
        odeint(lambda t, y: y @ box[0], y0, TIMES, gradient="forward", adjoint_params=(hidden,))
    with pytest.raises(ValueError, match="not parameters of the model"):
        sensitivity.jvp(func, y0, TIMES, tangent_params={"nope": torch.ones(1)})


@pytest.mark.slow
def test_stiff_van_der_pol_in_both_doors_is_the_central_difference_of_the_solve():
    """Van der Pol at μ = 20.88 (dopri5 at 1e-5 / 1e-7 over [0, 10], where holding the step sizes gave −101 506):
    forward mode through ODEBlock and through odeint gives the same dL/dx0, the central difference of the
    block's own solve (4.82888) to 1e-6."""
    from test_step_sizes import TOL, VdP, _fd, _loss, _y0

    block = ODEBlock(VdP(), T=10.0, method="dopri5", gradient=Forward(), **TOL)
    y0 = _y0().requires_grad_()
    (g_block,) = torch.autograd.grad(_loss(block(y0)).sum(), y0)
    y0 = _y0()[0].requires_grad_()
    span = torch.tensor([0.0, 10.0], dtype=torch.float64)
    out = odeint(VdP(), y0, span, method="dopri5", gradient=Forward(), **TOL)[-1]
    (g_odeint,) = torch.autograd.grad(_loss(out), y0)
    fd = _fd(block, _y0())
    assert abs(float(g_block[0, 0]) - fd) < 1e-6 * abs(fd)
    assert float(g_odeint[0]) == pytest.approx(float(g_block[0, 0]), rel=1e-12)


@pytest.mark.parametrize(
    "kw", [dict(rtol=1e-6, atol=1e-8, method="dopri5"), dict(method="rk4", options={"step_size": 0.1})]
)
def test_jvp_equals_torch_func_jvp_through_the_same_steps(kw):
    """The library's forward sensitivity is forward-mode differentiation of the solver's map: ``torch.func.jvp`` of
    ``cde_nets.odeint`` (the same steps, the adaptive sizes differentiated in both) gives the same bits, along
    ``y0`` and along a parameter (through ``functional_call``)."""
    from torch.func import functional_call
    from torch.func import jvp as func_jvp

    g = torch.Generator().manual_seed(3)
    field = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()

    class Field(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = field

        def forward(self, t, y):
            return self.net(y)

    func = Field()
    y0 = torch.randn(4, 2, generator=g, dtype=torch.float64)
    v = torch.randn(4, 2, generator=g, dtype=torch.float64)
    ys, dys = sensitivity.jvp(func, y0, TIMES, tangent_y0=v, **kw)
    ref_ys, ref_dys = func_jvp(lambda y: odeint(func, y, TIMES, **kw), (y0,), (v,))
    assert torch.equal(ys, ref_ys) and torch.equal(dys, ref_dys)
    params = dict(func.named_parameters())
    name = "net.0.weight"
    vp = torch.randn(params[name].shape, generator=g, dtype=torch.float64)
    _, dp = sensitivity.jvp(func, y0, TIMES, tangent_params={name: vp}, **kw)

    def solve(w: torch.Tensor) -> torch.Tensor:
        return odeint(lambda t, y: functional_call(func, {**params, name: w}, (t, y)), y0, TIMES, **kw)

    _, ref_dp = func_jvp(solve, (params[name].detach(),), (vp,))
    assert torch.allclose(dp, ref_dp, rtol=1e-12, atol=1e-14)
