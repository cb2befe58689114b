"""The adjoint study (Chen et al. 2018): errors fall as the tolerance tightens; the discrete-mode row is the exact
gradient of the discrete net. (The benchmark script's tiny run is read in tests/experiments/test_benchmarks.py,
which makes that run for its JSON check too.)"""

import json
import math

import pytest
import torch

from cde_nets.diagnostics import adjoint_study, markdown_table, registered_gradients, to_jsonable
from cde_nets.fields import Hamiltonian
from cde_nets.solvers.gradients import GradientMethod


def make_field():
    return Hamiltonian(4, layers=4, T=1.0, K="blockdiag", init_std=1.0, generator=torch.Generator().manual_seed(0))


def loss_fn(y, target):
    return (y - target).pow(2).mean()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)


def test_errors_fall_with_tolerance_and_discrete_row_is_autograd_of_the_net(f64):
    study = adjoint_study(
        make_field,
        batch(),
        loss_fn,
        tolerances=[1e-3, 1e-5, 1e-7],
        methods=["dopri5"],
        gradients=["adjoint", "backprop"],
        schemes=["symplectic_euler"],
        keep_gradients=True,
    )
    rows = study["rows"]
    for mode in ("adjoint", "backprop"):
        errs = [r["rel_grad_error"] for r in rows if r["mode"] == mode]
        assert len(errs) == 3 and errs[0] > errs[1] > errs[2]
        assert errs[2] < 1e-4
    adj = [r for r in rows if r["mode"] == "adjoint"]
    bp = [r for r in rows if r["mode"] == "backprop"]
    assert all(a["peak_saved_bytes"] < b["peak_saved_bytes"] for a, b in zip(adj, bp))

    # Independent: autograd of the H2 loop (eqs. H12-13) against the reference gradient.
    f = make_field()
    y0, target = batch()
    h = f.grid.h
    p, q = y0[:, :2], y0[:, 2:]
    for l in range(4):
        p = p + h * f.evaluate_part(l, torch.cat([p, q], 1), 0)
        q = q + h * f.evaluate_part(l, torch.cat([p, q], 1), 1)
    params = [x for x in f.parameters() if x.requires_grad]
    g_net = torch.cat([gi.flatten() for gi in torch.autograd.grad(loss_fn(torch.cat([p, q], 1), target), params)])
    (disc,) = [r for r in rows if r["mode"] == "discrete"]
    assert (disc["grad"] - g_net).norm() <= 1e-10 * g_net.norm()
    assert disc["rel_grad_error"] == pytest.approx(
        float((g_net - study["reference"]["grad"]).norm() / study["reference"]["grad"].norm()), rel=1e-9
    )
    assert disc["nfe_forward"] == 4
    json.dumps(to_jsonable(study))
    assert markdown_table(study).count("\n") == len(rows) + 1


def test_fixed_step_rows_and_validation(f64):
    study = adjoint_study(
        make_field(), batch(), loss_fn, tolerances=[], steps=[4, 8], methods=["rk4"], gradients=["backprop"], schemes=[]
    )
    errs = [r["rel_grad_error"] for r in study["rows"]]
    assert [r["steps"] for r in study["rows"]] == [4, 8]
    assert 8 < errs[0] / errs[1] < 40  # fourth order: halving the step divides the error by about 16
    with pytest.raises(ValueError, match="`methods` has unknown"):
        adjoint_study(make_field(), batch(), loss_fn, methods=["rk5"])
    with pytest.raises(ValueError, match="`reference` has unknown keys"):
        adjoint_study(make_field(), batch(), loss_fn, reference={"tol": 1})


def test_the_reference_holds_the_step_sizes_on_their_mesh(f64):
    """The reference is the ODE's gradient to its tolerance: backprop through dopri5 at 1e-10 with the step sizes
    held (the discrete adjoint of the mesh), not the default backprop, whose step-size terms need not vanish with
    the tolerance (on the full study's models the rk4 rows at 1024 steps read 3.7e-9 from the held reference and
    2.2e-8 from the differentiated one)."""
    from cde_nets import Backprop, ODEBlock

    study = adjoint_study(
        make_field(),
        batch(),
        loss_fn,
        tolerances=[],
        steps=[4],
        methods=["rk4"],
        gradients=["backprop"],
        schemes=[],
        keep_gradients=True,
    )
    y0, target = batch()

    def grad(gradient):
        f = make_field()
        out = ODEBlock(f, method="dopri5", rtol=1e-10, atol=1e-10, gradient=gradient)(y0)
        params = [x for x in f.parameters() if x.requires_grad]
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss_fn(out, target), params)])

    held, moved = grad(Backprop(steps="fixed")), grad(Backprop())
    assert torch.equal(study["reference"]["grad"], held)
    assert not torch.equal(held, moved)


class _Broken(GradientMethod):
    name = "broken"

    def solve(self, run):
        raise RuntimeError("no gradient here")


class _Decay(torch.nn.Module):
    """``y' = −k y``: ``y(T) = y0 e^{−kT}``, so ``d Σy(T)/dk = −T Σy0 e^{−kT}``."""

    def __init__(self, k: float):
        super().__init__()
        self.k = torch.nn.Parameter(torch.tensor(k, dtype=torch.float64))

    def forward(self, t, y):
        return -self.k * y


def test_the_study_enumerates_the_registry_refuses_by_message_and_errors_match_a_closed_form(monkeypatch, f64):
    """A gradient method registered now is a row; a refused cell carries the refusal, a method that raises on a
    cell a failed row with the exception; on ``y' = −ky`` the reference
    is the closed form to 1e-9, the solver-exact rows are the derivative of rk4's map ``y0 R(−kh)^n``, ``R`` the
    degree-4 Taylor polynomial, and every row's error is its distance from the closed form."""
    import sys
    from pathlib import Path

    from cde_nets import Backprop
    from cde_nets.solvers.gradients import GRADIENTS

    sys.path.insert(0, str(Path(__file__).parent))
    from toy_gradient import Segmented

    monkeypatch.setitem(GRADIENTS, "segmented", Segmented)
    monkeypatch.setitem(GRADIENTS, "broken", _Broken)
    k, T, n = 0.7, 1.0, 4
    y0 = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    study = adjoint_study(
        _Decay(k),
        y0,
        lambda y: y.sum(),
        tolerances=(),
        steps=(n,),
        methods=("rk4",),
        keep_gradients=True,
        gradients=registered_gradients([Backprop(steps="fixed")]),
        solve={"T": T},
    )
    rows = {r["mode"]: r for r in study["rows"]}
    assert list(rows) == [*(cls().describe() for cls in GRADIENTS.values()), "backprop (fixed steps)"]
    assert "segmented" in rows and "broken" in rows
    refused = {m for m, r in rows.items() if r["status"] == "refused"}
    assert "reversible" in refused and refused == {m for m in GRADIENTS if not GRADIENTS[m]().supports("rk4")}
    assert rows["reversible"]["refused"] == GRADIENTS["reversible"]().refusal("rk4")
    assert rows["reversible"]["rel_grad_error"] is None
    assert f"refused: {rows['reversible']['refused']}" in markdown_table(study)
    assert rows["broken"]["status"] == "failed" and rows["broken"]["error"] == "RuntimeError: no gradient here"

    exact = -T * float(y0.sum()) * math.exp(-k * T)
    assert float(study["reference"]["grad"]) == pytest.approx(exact, rel=1e-9)
    z = -k * T / n
    R, dR = 1 + z + z**2 / 2 + z**3 / 6 + z**4 / 24, 1 + z + z**2 / 2 + z**3 / 6
    discrete = float(y0.sum()) * n * R ** (n - 1) * dR * (-T / n)
    for mode in ("backprop", "checkpoint", "symplectic", "forward", "segmented", "backprop (fixed steps)"):
        assert float(rows[mode]["grad"]) == pytest.approx(discrete, rel=1e-12)
    for r in rows.values():
        if r["status"] == "ok":
            # measured against the reference, itself within 1e-9 of the closed form (above)
            assert r["rel_grad_error"] == pytest.approx(abs(float(r["grad"]) - exact) / abs(exact), abs=2e-9)
    assert rows["adjoint"]["rel_grad_error"] < 1e-3


def test_gradient_growth_fits_the_exponential_rate():
    """Norms ``e^{0.9T}`` give the rate 0.9 exactly; a refused cell keeps its message and no point."""
    from cde_nets.diagnostics import gradient_growth

    def study(T):
        ok = {"mode": "backprop", "method": "dopri5", "status": "ok", "grad_norm": 3 * math.exp(0.9 * T)}
        refused = {"mode": "reversible", "method": "dopri5", "status": "refused", "refused": "use alf"}
        return {"reference": {"grad_norm": math.exp(0.9 * T)}, "rows": [{**ok, "rel_grad_error": 0.0}, refused]}

    growth = gradient_growth({T: study(T) for T in (1.0, 2.0, 4.0)}, lyapunov=0.906)
    assert growth["reference"]["rate"] == pytest.approx(0.9, rel=1e-12)
    assert growth["modes"]["backprop dopri5"]["rate"] == pytest.approx(0.9, rel=1e-12)
    assert growth["modes"]["reversible dopri5"] == {
        "horizons": [],
        "norms": [],
        "errors": [],
        "messages": {1.0: "use alf", 2.0: "use alf", 4.0: "use alf"},
        "rate": None,
    }
