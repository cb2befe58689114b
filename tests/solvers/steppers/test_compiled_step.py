"""The compiled step (``compile=True``, :mod:`cde_nets.solvers.steppers.compiled`) against the eager stepper over
the same steps: values and backprop gradients to rounding (float64), the same accepted and rejected steps, no
recompilation for a second call of the same shapes, and refusals that name the argument.

The graphs run on torch.compile's ``aot_eager`` backend here (dynamo's trace and AOTAutograd's forward and
backward graphs, without inductor's code generation, whose compiles take tens of seconds on two cores); the
benchmark (``benchmarks/compiled_step.py``) runs inductor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, odeint
from cde_nets.solvers.gradients import Backprop, Checkpoint
from cde_nets.solvers.options import SolverOptions
from cde_nets.solvers.steppers import compiled


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


class _Field(nn.Module):
    """A small time-dependent MLP that counts the steps the solver reports (torchdiffeq's callbacks)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(2, 8, generator=g, dtype=torch.float64))
        self.w2 = nn.Parameter(torch.randn(8, 2, generator=g, dtype=torch.float64) / 3)
        self.accepted = self.rejected = 0

    def forward(self, t, y):
        return torch.tanh(y @ self.w1) @ self.w2 * (1 + t)

    def callback_accept_step(self, t0, y0, dt):
        self.accepted += 1

    def callback_reject_step(self, t0, y0, dt):
        self.rejected += 1


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-12) -> None:
    assert float((a - b).abs().max()) <= rel * max(1.0, float(b.abs().max()))


def _solve_and_grad(f: _Field, method: str, options: dict, gradient="backprop"):
    y0 = torch.tensor([[0.5, -1.0], [1.5, 0.2], [-0.7, 0.9]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.0, 0.35, 0.36, 1.0], dtype=torch.float64)  # 0.35 and 0.36 in one step
    f.accepted = f.rejected = 0
    ys = odeint(f, y0, t, method=method, rtol=1e-7, atol=1e-9, options=options, gradient=gradient)
    grads = torch.autograd.grad(
        (ys * torch.linspace(-1, 1, 6, dtype=torch.float64).view(1, 3, 2)).sum(), [y0, f.w1, f.w2]
    )
    return ys.detach(), grads, (f.accepted, f.rejected)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:method .* never calls")  # the fixed-step methods report no accept/reject
@pytest.mark.parametrize(
    "method,options",
    [("dopri5", {}), ("tsit5", {}), ("bosh3", {}), ("rk4", {"step_size": 0.25}), ("euler", {"step_size": 0.25})],
)
def test_values_gradients_and_steps_equal_the_eager_stepper(method, options):
    """Backprop through the compiled steps, and the checkpointed replay of them, against the eager stepper's."""
    f = _Field()
    for gradient in ("backprop", "checkpoint"):
        ys_e, g_e, steps_e = _solve_and_grad(f, method, options, gradient)
        ys_c, g_c, steps_c = _solve_and_grad(f, method, {**options, "compile": True}, gradient)
        _close(ys_c, ys_e)
        for a, b in zip(g_c, g_e):
            _close(a, b)
        assert steps_c == steps_e
        if method in ("dopri5", "tsit5", "bosh3"):
            assert steps_e[0] >= 3  # the step sizes (and their derivatives) are the controller's, not one step


@pytest.mark.slow
def test_step_size_settings_are_those_of_the_eager_backprop():
    """Backprop(steps=...) and Checkpoint(steps=...) hold the step sizes fixed (or all but the first) in both
    paths alike."""
    f = _Field()
    for steps in ("fixed", "torchdiffeq"):
        for gradient in (Backprop(steps=steps), Checkpoint(steps=steps)):
            _, g_e, _ = _solve_and_grad(f, "bosh3", {}, gradient)
            _, g_c, _ = _solve_and_grad(f, "bosh3", {"compile": True}, gradient)
            for a, b in zip(g_c, g_e):
                _close(a, b)


@pytest.mark.slow
def test_block_door_counts_and_gradients_equal_the_eager_stepper(monkeypatch):
    """Through ODEBlock, with the checkpointed replay (backprop is the matrix's), the outputs through the compiled
    dense output (the matrix's small states take theirs as one eager product)."""
    monkeypatch.setattr(compiled, "_DENSE_PRODUCT_MAX", 0)
    f = _Field()
    y0 = torch.tensor([[0.5, -1.0], [1.5, 0.2]], dtype=torch.float64, requires_grad=True)
    out = {}
    for name, solver in (
        ("eager", SolverOptions("dopri5", rtol=1e-7, atol=1e-9)),
        ("compiled", SolverOptions("dopri5", rtol=1e-7, atol=1e-9, compile=True)),
    ):
        block = ODEBlock(f, T=1.0, solver=solver, gradient="checkpoint")
        sol = block.solve(y0)
        grads = torch.autograd.grad(sol.y.square().sum(), [y0, f.w1, f.w2])
        out[name] = (sol.y.detach(), grads, sol.stats)
    _close(out["compiled"][0], out["eager"][0])
    for a, b in zip(out["compiled"][1], out["eager"][1]):
        _close(a, b)
    for key in ("nfe_forward", "steps_forward", "rejected_forward", "stored_states"):
        assert out["compiled"][2][key] == out["eager"][2][key]


@pytest.mark.slow
def test_a_second_call_with_the_same_shapes_does_not_recompile():
    from torch._dynamo.utils import counters

    f = _Field()
    y0 = torch.tensor([[0.5, -1.0]], dtype=torch.float64)
    t = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    before = counters["stats"]["unique_graphs"]
    first = odeint(f, y0, t, method="bosh3", options={"compile": True})
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > before  # the counter sees this field's compiles
    second = odeint(f, y0 + 0.25, t, method="bosh3", options={"compile": True})
    assert counters["stats"]["unique_graphs"] == graphs
    assert not torch.equal(first, second)  # the new state went through the cached graphs


_Y0 = torch.tensor([[0.5, -1.0]], dtype=torch.float64)
_T = torch.tensor([0.0, 1.0], dtype=torch.float64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(method="gl4", options={"compile": True, "step_size": 0.5}), "method='gl4'"),
        (dict(method="alf", options={"compile": True}), "method='alf'"),
        (dict(method="dopri8", options={"compile": True}), "method='dopri8'"),
        (dict(options={"compile": True}, gradient=Checkpoint(budget=2)), "budget=2"),
        (dict(options={"compile": True}, gradient="symplectic"), "gradient='symplectic'"),
        (dict(options={"compile": True}, gradient="adjoint"), "gradient='adjoint'"),
        (dict(options={"compile": True}, controller="per_sample"), "controller='per_sample'"),
        (dict(options={"compile": True}, event_fn=lambda t, y: y[..., 0]), "event_fn"),
        (dict(options={"compile": True, "step_t": [0.5]}), "step_t"),
        (dict(options={"compile": True, "jump_t": [0.5]}), "jump_t"),
        (dict(options={"compile": "yes"}), "compile"),
    ],
)
def test_odeint_refuses_what_it_does_not_serve_by_name(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        odeint(_Field(), _Y0, _T, **kwargs)


def test_compile_false_is_the_eager_path():
    f = _Field()
    assert torch.equal(odeint(f, _Y0, _T, options={"compile": False}), odeint(f, _Y0, _T))


def test_block_door_refuses_what_it_does_not_serve_by_name():
    with pytest.raises(ValueError, match="method='gl4'"):
        SolverOptions("gl4", step_size=0.5, compile=True)
    with pytest.raises(ValueError, match="controller='per_sample'"):
        SolverOptions("dopri5", controller="per_sample", compile=True)
    with pytest.raises(TypeError, match="compile"):
        SolverOptions("dopri5", compile=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gradient='adjoint'"):
        ODEBlock(_Field(), T=1.0, solver=SolverOptions(compile=True), gradient="adjoint")
    block = ODEBlock(_Field(), T=1.0, solver=SolverOptions(compile=True))
    assert block.gradient_for(_Y0).name == "backprop"
    with pytest.raises(ValueError, match="event"):
        block.solve(_Y0, event=lambda t, y: y[:, 0])


@pytest.mark.slow
def test_inductor_code_equals_the_eager_stepper(monkeypatch):
    """The backend users get: inductor's generated code (its decomposed ``tanh`` among it) gives the eager
    stepper's values and backprop gradients to rounding over the same steps (float64, dopri5)."""
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    eager_ys, eager_grads, eager_steps = _solve_and_grad(_Field(), "dopri5", {})
    ys, grads, steps = _solve_and_grad(_Field(), "dopri5", {"compile": True})
    assert steps == eager_steps
    _close(ys, eager_ys)
    for g, e in zip(grads, eager_grads):
        _close(g, e, 1e-11)


@pytest.mark.slow
@pytest.mark.parametrize("gradient", ["backprop", "checkpoint"])
def test_the_stiff_sample_through_the_compiled_step_is_the_derivative_of_its_solve(gradient):
    """Van der Pol at ``μ = 20.88`` over ``[0, 10]`` (dopri5, rtol 1e-5): the compiled step differentiates every
    step size in its graph, so the gradient is the central difference of the compiled solve itself to 1e-6 (the
    block door runs the same solve: the matrix test pins the two doors equal)."""

    class VdP(nn.Module):
        def forward(self, t, y):
            x, v = y[..., 0], y[..., 1]
            return torch.stack((v, 20.88 * (1 - x * x) * v - x), -1)

    f, t = VdP(), torch.tensor([0.0, 10.0], dtype=torch.float64)
    kw = dict(rtol=1e-5, atol=1e-7, options={"compile": True})

    def loss(y0: torch.Tensor) -> torch.Tensor:
        return odeint(f, y0, t, gradient=gradient, adjoint_params=(), **kw)[-1].square().sum()

    y0 = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    x = y0.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(x), x)
    e = torch.tensor([[1e-6, 0.0]], dtype=torch.float64)
    with torch.no_grad():
        fd = float((loss(y0 + e) - loss(y0 - e)) / 2e-6)
    assert abs(float(g[0, 0]) - fd) < 1e-6 * abs(fd)
