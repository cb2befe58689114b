"""Gradients through adaptive steps are the derivative of the computed solution
(:mod:`cde_nets.solvers.gradients.step_sizes`): every step size is a function of the state through the error estimate
and the controller.

The case that found it: Van der Pol ``x' = v``, ``v' = μ (1 − x²) v − x`` at ``μ = 20.88``, ``y_0 = (2, 0)``,
``t ∈ [0, 10]``, dopri5 at ``rtol = 1e-5``, ``atol = 1e-7``, ``L = x(10)² + v(10)²``: the true ``dL/dx_0`` is 4.8294
(a central difference of dopri8 at 1e-12), the central difference of this library's own forward solve 4.8289 (shared
step) and 4.8293 (per-sample steps). With the step sizes held fixed the gradient was −101 506 (per-sample) and, as
torchdiffeq's backprop (first step differentiated, the others held fixed), −57.65 (shared step)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torchdiffeq
from torch import nn

from cde_nets import ODEBlock, odeint
from cde_nets.solvers.controllers import Integral
from cde_nets.solvers.errors import Reason, SolverError
from cde_nets.solvers.gradients import Adjoint, Backprop, Checkpoint, Symplectic
from cde_nets.solvers.gradients.step_sizes import attach, check_steps
from cde_nets.solvers.per_sample.solve import odeint_per_sample

F64 = torch.float64
TOL = dict(rtol=1e-5, atol=1e-7)
T10 = torch.tensor([0.0, 10.0], dtype=F64)
TRUE = 4.8294  # dL/dx0 of the exact flow (dopri8 at 1e-12)


class VdP(nn.Module):
    """Van der Pol with ``μ`` carried in the state's third component (so one module serves every sample)."""

    def forward(self, t, y):
        x, v, mu = y[..., 0], y[..., 1], y[..., 2]
        return torch.stack((v, mu * (1 - x * x) * v - x, torch.zeros_like(mu)), -1)


@pytest.mark.slow
@pytest.mark.parametrize("gradient", ["checkpoint", "symplectic", "forward", "interpolating", "gauss"])
def test_the_stiff_sample_under_vmap_by_each_gradient_method(gradient):
    """Each gradient method's own backward pass under ``torch.vmap`` on the stiff sample (over ``[0, 3]``): those
    that differentiate the steps taken give the central difference of the instance's solve to 1e-6, the
    continuous ones (the ODE's gradient, not the solve's) to 1e-3 (measured 8e-6 on the stiff instance, 3.6e-4 on
    the mild one's smaller gradient at rtol 1e-5); the mild instance beside it alike."""
    Y = torch.tensor([[2.0, 0.0, 20.88], [1.0, 0.5, 2.0]], dtype=F64)
    T3 = torch.tensor([0.0, 3.0], dtype=F64)

    def loss(y0: torch.Tensor, g: str = gradient) -> torch.Tensor:
        return _loss(odeint(VdP(), y0, T3, gradient=g, adjoint_params=(), **TOL)[-1])

    g = torch.func.vmap(torch.func.grad(loss))(Y)
    rel = 1e-6 if gradient in ("checkpoint", "symplectic", "forward") else 1e-3
    for b in range(2):
        e = torch.zeros(3, dtype=F64)
        e[0] = 1e-6
        with torch.no_grad():
            fd = float((loss(Y[b] + e, "backprop") - loss(Y[b] - e, "backprop")) / 2e-6)
        assert abs(float(g[b, 0]) - fd) < rel * abs(fd)


def test_the_stiff_sample_through_the_stacked_vmap_loop():
    """``vmap`` innermost and autograd outside: the loop runs once on the stacked instances (the vmap level
    popped), differentiated by backprop; each instance's gradient is the central difference of its solve to 1e-6."""
    Y = torch.tensor([[2.0, 0.0, 20.88], [1.0, 0.5, 2.0]], dtype=F64)
    T3 = torch.tensor([0.0, 3.0], dtype=F64)

    def ends(y: torch.Tensor) -> torch.Tensor:
        return _loss(torch.func.vmap(lambda y0: odeint(VdP(), y0, T3, **TOL)[-1])(y))

    y = Y.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ends(y).sum(), y)
    e = torch.zeros_like(Y)
    e[:, 0] = 1e-6
    with torch.no_grad():
        fd = (ends(Y + e) - ends(Y - e)) / 2e-6
    assert ((g[:, 0] - fd).abs() < 1e-6 * fd.abs()).all()


class VdPRows(nn.Module):
    """Van der Pol with a ``μ`` per sample, read for the rows a per-sample sweep runs."""

    def __init__(self, mu: torch.Tensor):
        super().__init__()
        self.mu = mu

    def forward(self, t, y, rows):
        x, v = y[:, 0], y[:, 1]
        return torch.stack((v, self.mu[rows] * (1 - x * x) * v - x), 1)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y[..., 0] ** 2 + y[..., 1] ** 2


def _y0() -> torch.Tensor:
    return torch.tensor([[2.0, 0.0, 20.88]], dtype=F64)


def _fd(solve, y0: torch.Tensor, eps: float = 1e-6) -> float:
    e = torch.zeros_like(y0)
    e[0, 0] = eps
    with torch.no_grad():
        return float((_loss(solve(y0 + e)) - _loss(solve(y0 - e))).sum() / (2 * eps))


@pytest.mark.parametrize("controller", ["batch", "per_sample"])
@pytest.mark.parametrize("gradient", [Backprop(), Checkpoint(), Symplectic()])
def test_stiff_sample_gradient_is_the_derivative_of_the_computed_solution(controller, gradient):
    """Every gradient method that differentiates the steps taken gives the central difference of the block's own
    forward solve to 1e-6, and the exact flow's 4.8294 to the solve's accuracy (2e-4)."""
    block = ODEBlock(VdP(), T=10.0, method="dopri5", gradient=gradient, controller=controller, **TOL)
    y0 = _y0().requires_grad_()
    (g,) = torch.autograd.grad(_loss(block(y0)).sum(), y0)
    fd = _fd(block, _y0())
    assert abs(float(g[0, 0]) - fd) < 1e-6 * abs(fd)
    assert abs(float(g[0, 0]) - TRUE) < 2e-4 * TRUE


@pytest.mark.slow
def test_the_odeint_door_differentiates_the_steps_and_keeps_torchdiffeqs_gradient_on_request():
    """``odeint``'s default backprop and checkpoint give the derivative of its solve; ``Backprop(steps="torchdiffeq")``
    is torchdiffeq's backprop bit for bit (−57.65 here), ``"fixed"`` the frozen mesh's, far from both."""
    y0 = _y0()[0]

    def grad(gradient) -> float:
        x = y0.clone().requires_grad_()
        (g,) = torch.autograd.grad(_loss(odeint(VdP(), x, T10, gradient=gradient, **TOL)[-1]), x)
        return float(g[0])

    fd = _fd(lambda x: odeint(VdP(), x[0], T10, **TOL)[-1][None], _y0())
    for gradient in ("backprop", "checkpoint"):
        assert abs(grad(gradient) - fd) < 1e-6 * abs(fd), gradient
    x = y0.clone().requires_grad_()
    (theirs,) = torch.autograd.grad(_loss(torchdiffeq.odeint(VdP(), x, T10, **TOL)[-1]), x)
    assert grad(Backprop(steps="torchdiffeq")) == float(theirs[0])
    assert abs(float(theirs[0]) - (-57.653)) < 1e-3
    assert abs(grad(Checkpoint(steps="fixed")) - fd) > 10 * abs(fd)


@pytest.mark.slow
def test_every_sample_of_the_mixed_batch():
    """The mixed-stiffness batch of the per-sample benchmark (256 samples, ``μ = 1 + 24 U(0, 1)``): with the steps
    held fixed 60 samples (``μ`` from 19 to 25) are off by more than 1 %, sample 203 (``μ = 20.88``) by six orders
    of magnitude; differentiated, every sample's gradient is its central difference to 1e-5 (samples are solved
    independently, so one pair of perturbed solves gives every sample's difference)."""
    B = 256
    mu = 1 + 24 * torch.rand(B, generator=torch.Generator().manual_seed(0), dtype=F64)
    field = VdPRows(mu)
    y0 = torch.tensor([[2.0, 0.0]], dtype=F64).repeat(B, 1)
    e = torch.zeros_like(y0)
    e[:, 0] = 1e-6
    with torch.no_grad():
        up, down = (odeint_per_sample(field, y0 + s * e, T10, rows=True, **TOL)[-1] for s in (1, -1))
        fd = (_loss(up) - _loss(down)) / 2e-6
    for gradient, well in ((Backprop(), True), (Checkpoint(), True), (Backprop(steps="fixed"), False)):
        x = y0.clone().requires_grad_()
        out = odeint_per_sample(field, x, T10, rows=True, gradient=gradient, params=[], **TOL)
        (g,) = torch.autograd.grad(_loss(out[-1]).sum(), x)
        rel = (g[:, 0] - fd).abs() / fd.abs().clamp_min(1e-3)
        if well:
            assert float(rel.max()) < 1e-5, gradient
        else:
            assert int((rel > 0.01).sum()) >= 40 and float(rel[203]) > 1e5
    assert abs(float(mu[203]) - 20.88) < 1e-2


@pytest.mark.parametrize(
    ("mu", "match"),
    [
        # The time-reversed solve of the stiff sample diverges; the per-sample adjoint said nothing and returned
        # 1.2e79. It now stops within a round of the state leaving the forward trajectory's size, naming the
        # exact methods.
        (20.88, "diverged.*gradient='checkpoint'"),
        # The backward solve stays bounded but ends elsewhere (time-reversed Van der Pol at μ = 1 over [0, 10]
        # falls towards the origin): the reconstructed state is 60 times its size away from the forward's, and the
        # adjoint read along it was 20 % off backprop's gradient.
        (1.0, "landed"),
    ],
)
def test_the_per_sample_adjoint_names_a_failing_backward_solve(mu, match):
    field = VdPRows(torch.tensor([mu], dtype=F64))
    y0 = torch.tensor([[2.0, 0.0]], dtype=F64, requires_grad=True)
    out = odeint_per_sample(field, y0, T10, rows=True, gradient=Adjoint(), params=[], **TOL)
    with pytest.raises(SolverError, match=match) as info:
        _loss(out[-1]).sum().backward()
    assert info.value.reason is Reason.BACKWARD_UNSTABLE


def test_rejected_attempts_are_replayed():
    """A solve with rejected steps: checkpoint and symplectic replay every attempt (a rejected attempt's error
    ratio sets the next size), equal to backprop to 1e-12, and to each other; with the sizes fixed they differ
    from it by more than the tolerance."""
    field = VdP()
    block = {
        name: ODEBlock(field, T=3.0, method="dopri5", gradient=g, **TOL)
        for name, g in (("b", Backprop()), ("c", Checkpoint()), ("s", Symplectic()), ("f", Checkpoint(steps="fixed")))
    }
    y0 = torch.tensor([[1.5, 0.3, 8.0], [0.5, -1.0, 3.0]], dtype=F64)
    grads = {}
    for name, b in block.items():
        x = y0.clone().requires_grad_()
        sol = b.solve(x)
        (grads[name],) = torch.autograd.grad(_loss(sol.y).sum(), x)
        if name == "c":
            assert sol.stats["rejected_forward"] > 0 and sol.stats["rejected_backward"] == sol.stats["rejected_forward"]
    scale = float(grads["b"].abs().max())
    assert float((grads["c"] - grads["b"]).abs().max()) < 1e-12 * scale
    assert float((grads["s"] - grads["b"]).abs().max()) < 1e-12 * scale
    assert float((grads["f"] - grads["b"]).abs().max()) > 1e-6 * scale


def test_attach_keeps_the_solvers_bits():
    """The step size a solver computed on the host is what its graph carries, bit for bit."""
    h = torch.tensor(0.1, dtype=F64, requires_grad=True)
    g = h * 0.3000000000000001  # a different rounding of the same number
    out = attach(0.03, g)
    assert isinstance(out, torch.Tensor) and out.item() == 0.03
    (d,) = torch.autograd.grad(out, h)
    assert float(d) == 0.3000000000000001
    assert attach(0.5, 0.5) == 0.5  # no graph: the float itself


@pytest.mark.parametrize(
    ("ratio", "low", "free"),
    [(0.5, 1.0, True), (1e-12, 1.0, False), (0.95, 1.0, False), (3.0, 0.2, True), (1e6, 0.2, False)],
)
def test_controller_factor_is_the_constant_where_clamped(ratio, low, free):
    """``min(ifactor, max(safety r^(−1/p), low))``: a function of the ratio where neither bound holds, else the
    bound itself (derivative zero)."""
    r = torch.tensor(ratio, dtype=F64, requires_grad=True)
    f = Integral(safety=0.9, ifactor=10.0).factor_graph(ratio, lambda: r, 5, accepted=low == 1.0)
    expected = min(10.0, max(0.9 * ratio**-0.2, low))
    if free:
        assert isinstance(f, torch.Tensor)
        assert math.isclose(float(f), expected, rel_tol=1e-15)
        (d,) = torch.autograd.grad(f, r)
        assert math.isclose(float(d), -0.2 * expected / ratio, rel_tol=1e-12)
    else:
        assert f == expected


def test_steps_setting_is_checked():
    with pytest.raises(ValueError, match="`steps` must be 'differentiated'"):
        Backprop(steps="frozen")
    assert check_steps("fixed") == "fixed"
    with pytest.raises(ValueError, match="steps='torchdiffeq' reproduces torchdiffeq"):
        odeint_per_sample(
            VdPRows(torch.ones(1, dtype=F64)),
            torch.zeros(1, 2, dtype=F64, requires_grad=True),
            T10,
            rows=True,
            gradient=Backprop(steps="torchdiffeq"),
        )


def test_step_t_norm_and_tolerance_tensors_take_the_library_stepper():
    """``step_t``, a ``norm`` and per-element tolerances run on the library's stepper (so their gradients
    differentiate the steps too) with torchdiffeq's accepted and rejected steps and its values to 1e-12."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.log: list[tuple[str, float]] = []

        def forward(self, t, y):
            return VdP()(t, y)

        def callback_accept_step(self, t0, y0, dt):
            self.log.append(("a", float(dt)))

        def callback_reject_step(self, t0, y0, dt):
            self.log.append(("r", float(dt)))

    y0 = torch.tensor([1.5, 0.3, 8.0], dtype=F64)
    t = torch.linspace(0.0, 3.0, 4, dtype=F64)
    cases = [
        dict(options={"step_t": torch.tensor([0.77, 1.9], dtype=F64)}, **TOL),
        dict(options={"norm": lambda x: x.abs().max()}, **TOL),
        dict(rtol=torch.tensor([1e-5, 1e-6, 1e-5], dtype=F64), atol=1e-7),
    ]
    for kw in cases:
        ours, theirs = Counting(), Counting()
        with torch.no_grad():
            a = odeint(ours, y0, t, **kw)
            b = torchdiffeq.odeint(theirs, y0, t, **kw)
        assert ours.log == theirs.log and any(k == "r" for k, _ in ours.log)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        x = y0.clone().requires_grad_()
        (g,) = torch.autograd.grad(_loss(odeint(VdP(), x, t, gradient=Checkpoint(), **kw)[-1]), x)
        x = y0.clone().requires_grad_()
        (h,) = torch.autograd.grad(_loss(odeint(VdP(), x, t, **kw)[-1]), x)
        torch.testing.assert_close(g, h, rtol=1e-10, atol=1e-12)


def test_torchdiffeqs_dtype_option_runs_on_the_stepper_with_its_steps_differentiated():
    """torchdiffeq's ``dtype`` (the dtype of its times) is taken where it leaves the times in float64: the solve,
    once left to torchdiffeq (its backprop holding the steps after the first fixed), runs on the library's stepper,
    its gradient the one without the option, bit for bit, with no warning; a ``dtype`` that would step the times in
    float32 is refused, named."""
    grads = []
    for options in ({"dtype": F64}, {}):
        x = _y0()[0].clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ys = odeint(VdP(), x, torch.tensor([0.0, 0.1], dtype=F64), method="dopri8", options=options, **TOL)
        grads.append(torch.autograd.grad(ys[-1].sum(), x)[0])
    assert torch.equal(grads[0], grads[1])
    x32 = _y0()[0].float()
    with pytest.raises(ValueError, match=r"options\['dtype'\]=torch.float32 would step the times in torch.float32"):
        odeint(VdP(), x32, torch.tensor([0.0, 0.1]), method="dopri5", options={"dtype": torch.float32})


def test_a_zero_slope_at_the_start_differentiates_the_first_step_per_sample():
    """``y' = −t y`` has ``F(0, y) = 0``: the initial step's ``d1`` is zero, and its square root's derivative
    infinite, though ``max(d1, d2)`` takes ``d2``; the per-sample gradient stays finite and is ``e^(−t²/2)``."""
    y0 = torch.tensor([[1.0], [-2.0]], dtype=F64, requires_grad=True)
    out = odeint_per_sample(
        lambda t, y: -t[:, None] * y, y0, torch.tensor([0.0, 2.0], dtype=F64), rtol=1e-10, atol=1e-12
    )
    (g,) = torch.autograd.grad(out[-1].sum(), y0)
    torch.testing.assert_close(g, torch.full_like(g, math.exp(-2.0)), rtol=1e-8, atol=0)


@pytest.mark.slow
def test_where_the_controller_rings_the_default_is_the_computed_losss_derivative():
    """The adjoint study's Hamiltonian field (16 swiss-roll points) at rtol 1e-6: 94 accepted and 226 rejected
    steps. The default gradient, which differentiates the step sizes, is 38 % from the gradient on the steps'
    mesh, and it is the derivative of the loss as computed: along the direction where the two differ, a central
    difference of the solves gives 0.25566, the default 0.25569, the mesh's gradient -0.0599."""
    from cde_nets.experiments import adjoint_study

    x, label, readout = adjoint_study._data(16, 0)
    field = adjoint_study.MODELS["Hamiltonian H2 (16 pieces, T = 4)"]()
    params = [p for p in field.parameters() if p.requires_grad]

    def loss(block):
        return torch.nn.functional.binary_cross_entropy_with_logits(block(x) @ readout, label)

    default, held = (
        ODEBlock(field, method="dopri5", rtol=1e-6, atol=1e-6, gradient=g)
        for g in (Backprop(), Backprop(steps="fixed"))
    )
    stats = default.solve(x).stats
    assert (stats.steps_forward, stats.rejected_forward) == (94, 226)
    g_default, g_held = (torch.autograd.grad(loss(b), params) for b in (default, held))
    diff = [a - b for a, b in zip(g_default, g_held)]
    size = math.sqrt(sum(float(d.square().sum()) for d in diff))
    assert size > 0.3 * math.sqrt(sum(float(g.square().sum()) for g in g_held))
    v = [d / size for d in diff]
    eps = 1e-6
    with torch.no_grad():
        for p, d in zip(params, v):
            p.add_(eps * d)
        up = float(loss(default))
        for p, d in zip(params, v):
            p.sub_(2 * eps * d)
        down = float(loss(default))
        for p, d in zip(params, v):
            p.add_(eps * d)
    fd = (up - down) / (2 * eps)
    along = [sum(float((g * d).sum()) for g, d in zip(gs, v)) for gs in (g_default, g_held)]
    assert abs(along[0] - fd) < 1e-3 * abs(fd) and abs(along[1] - fd) > 0.5 * abs(fd)


@pytest.mark.slow
@pytest.mark.parametrize("gradient", [Backprop(), Checkpoint()])
def test_the_stiff_sample_through_tsit5_per_sample_steps(gradient):
    """Tsitouras's method on per-sample steps (served since the per-sample controller took tsit5): the gradient
    of the stiff sample is the central difference of the same solve to 1e-6, in both doors alike."""
    block = ODEBlock(VdP(), T=10.0, method="tsit5", gradient=gradient, controller="per_sample", **TOL)
    y0 = _y0().requires_grad_()
    (g,) = torch.autograd.grad(_loss(block(y0)).sum(), y0)
    fd = _fd(block, _y0())
    assert abs(float(g[0, 0]) - fd) < 1e-6 * abs(fd)
    x = _y0().requires_grad_()
    out = odeint(VdP(), x, T10, method="tsit5", controller="per_sample", gradient=gradient, adjoint_params=(), **TOL)
    (g2,) = torch.autograd.grad(_loss(out[-1]).sum(), x)
    assert abs(float(g2[0, 0]) - fd) < 1e-6 * abs(fd)


@pytest.mark.slow
def test_the_stiff_sample_under_vmap_is_the_derivative_of_each_instance_solve():
    """Under ``torch.vmap`` each instance takes its own steps, differentiated as a single solve's: the stiff
    sample's gradient (and a mild one's beside it) is the central difference of that instance's solve to 1e-6."""
    Y = torch.tensor([[2.0, 0.0, 20.88], [1.0, 0.5, 2.0]], dtype=F64)

    def loss(y0: torch.Tensor) -> torch.Tensor:
        return _loss(odeint(VdP(), y0, T10, **TOL)[-1])

    g = torch.func.vmap(torch.func.grad(loss))(Y)
    for b in range(2):
        e = torch.zeros(3, dtype=F64)
        e[0] = 1e-6
        with torch.no_grad():
            fd = float((loss(Y[b] + e) - loss(Y[b] - e)) / 2e-6)
        assert abs(float(g[b, 0]) - fd) < 1e-6 * abs(fd)
