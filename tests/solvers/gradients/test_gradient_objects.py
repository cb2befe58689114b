"""Gradient methods as objects: the short names resolve to the registered classes, settings of the adjoint's
backward solve live in ``Adjoint``, and a new method is one file plus one registry line, served by the block,
the adjoint study and the command line without other changes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from cde_nets import Adjoint, Backprop, Checkpoint, ODEBlock, Reversible, SolverOptions, Symplectic
from cde_nets.blocks import ode as ode_block
from cde_nets.diagnostics import adjoint_study
from cde_nets.fields import Hamiltonian
from cde_nets.solvers import Reason, SolverError
from cde_nets.solvers.gradients import GRADIENTS, as_gradient

sys.path.insert(0, str(Path(__file__).parent))
from toy_gradient import Segmented  # noqa: E402


def _field():
    return Hamiltonian(4, layers=4, T=1.0, generator=torch.Generator().manual_seed(3)).double()


def _grads(block, y0, counts=None):
    sol = block.solve(y0)
    grads = torch.autograd.grad(sol.y.square().sum(), [*block.parameters(), y0])
    if counts is not None:
        counts.append(sol.stats)
    return grads


def test_short_names_are_the_registered_defaults():
    assert [type(as_gradient(n)) for n in ("adjoint", "backprop", "checkpoint", "symplectic", "reversible")] == [
        Adjoint,
        Backprop,
        Checkpoint,
        Symplectic,
        Reversible,
    ]
    assert ODEBlock(_field(), gradient="adjoint").gradient == Adjoint()
    assert repr(Adjoint(rtol=1e-8)) == "Adjoint(rtol=1e-08)"
    with pytest.raises(ValueError, match="`gradient` must be one of"):
        as_gradient("exact")


def test_the_default_is_chosen_per_call_from_the_state_bytes_times_the_evaluations(monkeypatch):
    """Backprop while bytes of y0 x stages x steps <= 64 MiB (adaptive: 100 steps assumed), else checkpointed
    replay: for dopri5 (7 stages) the largest float64 state kept by backprop has floor(2^26 / 700 / 8) = 11983
    elements. The implicit methods keep the replay, alf the reversible gradient; the block stores no choice."""
    field = _field()
    block = ODEBlock(field)
    assert block.gradient is None
    assert block.gradient_for(torch.empty(11983, 1, dtype=torch.float64)) == Backprop()
    assert block.gradient_for(torch.empty(11984, 1, dtype=torch.float64)) == Checkpoint()
    # rk4 (4 stages) in steps of 1/4, one more step counted per output time: 2^26 / (4 * 4) bytes at t = None
    fixed = ODEBlock(field, method="rk4", step_size=0.25)
    assert fixed.gradient_for(torch.empty(2**19, dtype=torch.float64)) == Backprop()
    assert fixed.gradient_for(torch.empty(2**19 + 1, dtype=torch.float64)) == Checkpoint()
    assert fixed.gradient_for(torch.empty(2**19, dtype=torch.float64), t=[0.0, 1.0]) == Checkpoint()
    small = torch.empty(5, 4, dtype=torch.float64)
    assert ODEBlock(field, method="gl4", step_size=0.25).gradient_for(small) == Checkpoint()
    assert ODEBlock(field, method="alf").gradient_for(small) == Reversible()
    for method in ("dopri5", "dopri8", "fehlberg2", "adaptive_heun", "bosh3"):
        assert ODEBlock(field, method=method).gradient_for(small) == Backprop()
    assert ODEBlock(field, gradient="checkpoint").gradient_for(small) == Checkpoint()
    # where torchdiffeq would run backprop (decreasing times, a half-precision state), holding the step sizes
    # fixed, the replay differentiates every step
    assert block.gradient_for(small, t=[1.0, 0.5, 0.0]) == Checkpoint()
    assert block.gradient_for(small, t=[0.0, 0.5, 1.0]) == Backprop()
    assert fixed.gradient_for(torch.empty(5, 4, dtype=torch.float16)) == Checkpoint()
    spy = _Spy(field)
    spy.block.append(ODEBlock(spy, T=1.0))
    handed: list = []

    def integrate(*args, **kwargs):
        handed.append(kwargs["gradient"])
        return ode_block.integrate_unspied(*args, **kwargs)

    monkeypatch.setattr(ode_block, "integrate_unspied", ode_block.integrate, raising=False)
    monkeypatch.setattr(ode_block, "integrate", integrate)
    spy.block[0](torch.randn(5, 4, dtype=torch.float64))
    # the call's choice travels down the call; the block itself holds none, not even while it runs
    assert handed == [Backprop()] and set(spy.seen) == {None} and spy.block[0].gradient is None


class _Spy(torch.nn.Module):
    """``field``, recording the gradient its block is using at each evaluation."""

    def __init__(self, field):
        super().__init__()
        self.field, self.block, self.seen = field, [], []

    def forward(self, t, y):
        self.seen.append(self.block[0].gradient)
        return self.field(t, y)


class _VdP(torch.nn.Module):
    """Van der Pol, ``x'' = mu (1 - x^2) x' - x``, with ``mu`` a parameter."""

    def __init__(self, mu: float):
        super().__init__()
        self.mu = torch.nn.Parameter(torch.tensor(mu, dtype=torch.float64))

    def forward(self, t, y):
        x, v = y[..., 0], y[..., 1]
        return torch.stack((v, self.mu * (1 - x * x) * v - x), -1)


@pytest.mark.parametrize("case", ["hamiltonian", "stiff_van_der_pol"])
def test_the_default_backprop_equals_the_checkpointed_replay_to_rounding(case):
    """Both are exact gradients of the same steps (step sizes differentiated): the states are the same bits and
    the gradients agree to 1e-12 relative, on a non-stiff field and on Van der Pol at mu = 50, whose dopri5 steps
    sit at the stability edge (about 90 accepted, 19 rejected over [0, 0.5])."""
    if case == "hamiltonian":
        field, T = _field(), 1.0
        y0 = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    else:
        field, T = _VdP(50.0), 0.5
        y0 = torch.tensor([[2.0, 0.0], [1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    default = ODEBlock(field, T=T, rtol=1e-6, atol=1e-8)
    assert default.gradient_for(y0) == Backprop()
    replay = ODEBlock(field, T=T, rtol=1e-6, atol=1e-8, gradient="checkpoint")
    sols = [default.solve(y0), replay.solve(y0)]
    assert torch.equal(sols[0].y, sols[1].y)
    if case != "hamiltonian":
        assert sols[0].stats["rejected_forward"] > 10
    ours, theirs = (
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(s.y.square().sum(), [*field.parameters(), y0])])
        for s in sols
    )
    assert float((ours - theirs).norm()) <= 1e-12 * float(theirs.norm())


def test_adjoint_settings_live_in_the_object():
    """A looser tolerance of the adjoint's backward solve alone moves its gradient away from the exact one."""
    field = _field()
    y0 = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    exact = _grads(ODEBlock(field, rtol=1e-12, atol=1e-12, gradient="backprop"), y0)
    loose = _grads(ODEBlock(field, rtol=1e-9, atol=1e-9, gradient=Adjoint(rtol=1e-3, atol=1e-3)), y0)
    tight = _grads(ODEBlock(field, rtol=1e-9, atol=1e-9, gradient=Adjoint()), y0)
    err = [float(sum((a - b).norm() ** 2 for a, b in zip(g, exact)) ** 0.5) for g in (loose, tight)]
    assert err[1] < 1e-6 < err[0] and err[1] < err[0] / 100


def test_solver_options_are_validated_once_and_shared():
    solver = SolverOptions("rk4", step_size=0.125)
    a, b = ODEBlock(_field(), solver=solver), ODEBlock(_field(), solver=solver)
    assert a.solver is b.solver and a.method == "rk4" and a.step_size == 0.125
    with pytest.raises(TypeError, match="solver options are fixed"):
        SolverOptions("dopri5", options={"first_step": 0.1}).options["first_step"] = 0.2  # type: ignore[index]
    with pytest.raises(ValueError, match="`rtol`/`atol` control adaptive methods"):
        SolverOptions("euler", rtol=1e-3)


def test_errors_carry_a_reason():
    field = _field()
    y0 = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(SolverError) as info:
        ODEBlock(field, rtol=1e-10, atol=1e-10, options={"max_num_steps": 3})(y0)
    assert info.value.reason is Reason.MAX_STEPS


@pytest.mark.slow
def test_a_new_gradient_method_is_one_file_and_one_registry_line(monkeypatch, tmp_path):
    monkeypatch.setitem(GRADIENTS, "segmented", Segmented)  # the one registry line
    field = _field()
    y0 = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    t = torch.linspace(0, 1, 5, dtype=torch.float64)
    # through the block, by name and as an object: the gradient of torchdiffeq's backprop (which the toy's
    # torchdiffeq solves take), operation for operation
    for gradient in ("segmented", Segmented()):
        block = ODEBlock(field, method="dopri5", rtol=1e-7, atol=1e-9, gradient=gradient)
        # its intervals run in torchdiffeq, whose backprop holds the step sizes after the first fixed
        ref = ODEBlock(field, method="dopri5", rtol=1e-7, atol=1e-9, gradient=Backprop(steps="torchdiffeq"))
        with torch.no_grad():
            assert torch.equal(block.solve(y0, t=t).ys, ref.solve(y0, t=t).ys)
        counts: list = []
        for g, r in zip(_grads(block, y0, counts), _grads(ref, y0)):
            assert torch.allclose(g, r, rtol=1e-12, atol=1e-14)
        assert counts[0]["nfe_backward"] > 0
    # through the adjoint study
    study = adjoint_study(
        field, y0.detach(), lambda y: y.square().mean(), tolerances=(1e-6,), gradients=("segmented",), schemes=[]
    )
    (row,) = study["rows"]
    assert row["mode"] == "segmented" and row["rel_grad_error"] < 1e-4
    # through the command line: the adjoint-study reproduction runs every registered method on each of its
    # problems; its stiff and chaotic problems suffice here (the seeds' fields cost most, and their rows come from
    # the same loop over the registry: tests/experiments/test_experiments_adjoint_study.py reads them)
    from cde_nets.experiments import adjoint_study as reproduction
    from cde_nets.experiments.__main__ import main

    tiny = {**reproduction.SETTINGS["tiny"], "tolerances": (1e-3,), "models": ()}
    monkeypatch.setitem(reproduction.SETTINGS, "tiny", tiny)
    assert main(["adjoint_study", "--tiny", "--out", str(tmp_path), "--no-snapshots", "--threads", "1"]) == 0
    rows = json.loads((tmp_path / "adjoint_study.json").read_text())["rows"]
    models = {r["model"] for r in rows if r.get("mode") == "segmented"}
    assert models == {reproduction.STIFF, f"{reproduction.CHAOTIC}, T = {min(tiny['horizons']):g}"}, models
