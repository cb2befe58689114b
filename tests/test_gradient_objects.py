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


def test_the_default_is_the_exact_gradient_where_the_steps_can_be_replayed():
    """Checkpointed replay for replayable methods (exact, 4.9x faster than the adjoint on the ode_demo spiral):
    every explicit Runge-Kutta method, dopri8 included; the reversible gradient for alf."""
    field = _field()
    assert ODEBlock(field).gradient == Checkpoint()
    assert ODEBlock(field, method="rk4").gradient == Checkpoint()
    assert ODEBlock(field, method="gl4", step_size=0.25).gradient == Checkpoint()
    assert ODEBlock(field, method="alf").gradient == Reversible()
    for method in ("dopri8", "fehlberg2", "adaptive_heun"):
        assert ODEBlock(field, method=method).gradient == Checkpoint()


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
        ODEBlock(field, rtol=1e-10, atol=1e-10, max_steps=3)(y0)
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
    # through the command line: the adjoint-study reproduction runs every registered method
    from cde_nets.experiments import adjoint_study as reproduction
    from cde_nets.experiments.__main__ import main

    monkeypatch.setitem(reproduction.SETTINGS, "tiny", {**reproduction.SETTINGS["tiny"], "tolerances": (1e-3,)})
    assert main(["adjoint_study", "--tiny", "--out", str(tmp_path), "--no-checkpoints", "--threads", "1"]) == 0
    rows = json.loads((tmp_path / "adjoint_study.json").read_text())["rows"]
    assert any(r.get("mode") == "segmented" for r in rows)
