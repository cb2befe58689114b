"""Exact low-memory gradients: "checkpoint" and "symplectic" replay torchdiffeq's accepted steps, "reversible"
rebuilds ALF states by its inverse; each equals backprop through the same steps."""

from __future__ import annotations

import pytest
import torch

from cde_nets import ODEBlock, SolverOptions, odeint
from cde_nets.blocks.stop import Stop
from cde_nets.fields import NAIS, CubicFriction, Hamiltonian, SecondOrder
from cde_nets.fields.bound import BoundField
from cde_nets.solvers import SolverError
from cde_nets.solvers.counting import SolverStats, counted
from cde_nets.solvers.gradients import Backprop, Checkpoint, Symplectic
from cde_nets.solvers.gradients.replay import record_steps, replay
from cde_nets.solvers.grids import jump_options
from cde_nets.solvers.steppers.tableaux import TABLEAUX

ADAPTIVE = {"rtol": 1e-5, "atol": 1e-7}
TIMES = torch.tensor([0.0, 0.3, 0.55, 1.0], dtype=torch.float64)  # 0.3, 0.55 inside pieces; 1.0 the end


@pytest.fixture(autouse=True)
def _f64(monkeypatch):
    # the replayed steps are torchdiffeq's: compare with backprop through torchdiffeq's own forward solve (a
    # faster forward path, where one exists, takes the same steps with other rounding)
    from cde_nets.solvers import adapter

    monkeypatch.setattr(adapter, "_FAST_FORWARD", False, raising=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _field(name: str, L: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if name == "hamiltonian":
        return Hamiltonian(4, layers=L, generator=g), torch.randn(3, 4, generator=g), None
    if name == "cubic":
        return CubicFriction(3, layers=L, gamma=0.5, zero_init=False, generator=g), torch.randn(3, 3, generator=g), None
    if name == "second_order":
        return SecondOrder(2, layers=L, generator=g), torch.randn(3, 4, generator=g), None
    return NAIS(3, 2, layers=L, generator=g), torch.randn(3, 3, generator=g), torch.randn(3, 2, generator=g)


FIELDS = ["hamiltonian", "cubic", "second_order", "nais"]


def _kw(method: str) -> dict:
    if method == "alf":
        return {}
    if method in ("dopri5", "bosh3", "dopri8", "fehlberg2", "adaptive_heun"):
        # a given first step: torchdiffeq's own step selection is differentiated by its backprop, not a step;
        # the second-order methods at looser tolerances (some thirty steps, a few rejected)
        tol = {"rtol": 1e-3, "atol": 1e-5} if method in ("fehlberg2", "adaptive_heun") else ADAPTIVE
        return {**tol, "options": {"first_step": 0.05}}
    return {"step_size": 0.125}


def _grads(name: str, method: str, gradient: str, times=TIMES, **kw):
    field, y0, u = _field(name)
    y0.requires_grad_(True)
    if u is not None:
        u.requires_grad_(True)
    settings = {**_kw(method), **kw}
    if "jumps" in settings:  # a rarely changed setting: SolverOptions holds it
        block = ODEBlock(field, gradient=gradient, solver=SolverOptions(method, **settings))
    else:
        block = ODEBlock(field, method=method, gradient=gradient, **settings)
    sol = block.solve(y0, u, t=times)
    ys = sol.ys
    loss = (ys.pow(2) * torch.linspace(1.0, 2.0, len(times)).view(-1, 1, 1)).sum()
    inputs = [y0] + ([u] if u is not None else []) + list(field.parameters())
    return ys.detach(), torch.autograd.grad(loss, inputs), sol.stats


def _rel(new, old) -> float:
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) for a, b in zip(new, old))


@pytest.mark.parametrize("method", sorted(m for m, tab in TABLEAUX.items() if tab.continuous))
def test_replay_reproduces_torchdiffeq(method):
    """The tableaux are torchdiffeq's: replaying the recorded accepted steps gives its outputs to 1e-12."""
    for name in ("hamiltonian", "nais"):
        field, y0, u = _field(name, L=4, seed=1)
        bound = BoundField(field, u)
        stats = SolverStats()
        adaptive = TABLEAUX[method].adaptive
        func = counted(bound, stats, 10_000, adaptive=adaptive, count_vjp=False)
        grid = torch.linspace(0, 1, 9, dtype=torch.float64)
        opts = jump_options(method, field.grid.jumps if adaptive else None, None if adaptive else grid)
        ys, steps = record_steps(func, y0, TIMES, method=method, rtol=1e-6, atol=1e-8, options=opts, adaptive=adaptive)
        assert len(steps) == stats.steps_forward
        assert all(a == b for a, b in zip(steps.t1[:-1], steps.t0[1:]))
        with torch.no_grad():
            again = replay(func, TABLEAUX[method], steps, y0, TIMES)
        assert float((again - ys).abs().max() / ys.abs().max()) < 1e-12


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("method", ["dopri5", "bosh3", "rk4", "midpoint", "dopri8", "fehlberg2", "adaptive_heun"])
def test_checkpoint_and_symplectic_equal_backprop(name, method):
    """Same accepted steps: same outputs, gradients (y0, u, every parameter) to 1e-10 relative (dopri8: 1e-9).

    The step sizes are differentiated through the error estimate ``h Σ e_i k_i``, a sum of terms some 1e6 times
    larger than itself for dopri8 at rtol 1e-5, whose derivative rounds at about 1e-10 of the gradient: on the
    Hamiltonian field the two replays, which differ only in the order their stage cotangents add, are 1.4e-10
    apart, and backprop 4.5e-10 from either (1e-12 and below for the other methods and fields)."""
    ys_b, g_b, s_b = _grads(name, method, "backprop")
    for mode in ("checkpoint", "symplectic"):
        ys, g, s = _grads(name, method, mode)
        assert torch.equal(ys, ys_b)
        assert _rel(g, g_b) < (1e-9 if method == "dopri8" else 1e-10), (mode, _rel(g, g_b))
        assert s["steps_forward"] == s_b["steps_forward"] == s["steps_backward"]
        assert s["nfe_backward"] > 0


@pytest.mark.parametrize("method", ["dopri8", "fehlberg2", "adaptive_heun"])
def test_replays_with_the_step_sizes_held_equal_backprop(method):
    """With the step sizes constants (``steps="fixed"``, and ``"torchdiffeq"`` from a given first step) nothing
    rounds through an error estimate: the replays, which carry fehlberg2's and adaptive_heun's reused last stage
    back to the step that made it, equal backprop to 1e-13 (measured 1e-15), rejected steps included."""
    for steps in ("fixed", "torchdiffeq"):
        _, g_b, s_b = _grads("hamiltonian", method, Backprop(steps=steps))
        assert s_b["rejected_forward"] > 0
        for mode in (Checkpoint(steps=steps), Symplectic(steps=steps)):
            _, g, _ = _grads("hamiltonian", method, mode)
            assert _rel(g, g_b) < 1e-13, (steps, mode, _rel(g, g_b))


def test_torchdiffeq_backprop_also_differentiates_its_first_step():
    """Without a given first step, torchdiffeq's backprop differentiates its initial step-size selection (a
    tolerance-sized difference); against backprop through the same steps the replay stays exact."""
    _, g_b, _ = _grads("hamiltonian", "dopri5", "backprop", options={})
    _, g_c, _ = _grads("hamiltonian", "dopri5", "checkpoint", options={})
    assert _rel(g_c, g_b) < 1e-6


def test_gradients_match_finite_differences():
    """Central differences of the rk4 map (the map the modes differentiate) in a parameter and in y0."""
    field, y0, u = _field("cubic")
    for mode in ("checkpoint", "symplectic"):
        block = ODEBlock(field, method="rk4", step_size=0.125, gradient=mode)
        y = y0.clone().requires_grad_(True)
        p = next(iter(field.parameters()))
        gy, gp = torch.autograd.grad(block(y).pow(2).sum(), [y, p])
        eps = 1e-6
        with torch.no_grad():
            for idx in [(0, 0), (1, 2)]:
                e = torch.zeros_like(y0)
                e[idx] = eps
                fd = (block(y0 + e).pow(2).sum() - block(y0 - e).pow(2).sum()) / (2 * eps)
                assert abs(float(fd) - float(gy[idx])) < 1e-7 * max(1.0, abs(float(fd)))
            flat = p.view(-1)
            k = 1
            old = float(flat[k])
            flat[k] = old + eps
            up = block(y0).pow(2).sum()
            flat[k] = old - eps
            down = block(y0).pow(2).sum()
            flat[k] = old
            assert abs(float((up - down) / (2 * eps)) - float(gp.view(-1)[k])) < 1e-7 * max(1.0, float(gp.abs().max()))


def test_steps_across_jumps_and_stopping():
    """jumps=False lets adaptive steps straddle piece boundaries (several pieces in one replayed step); a
    stopping block replays each window. With the step sizes differentiated the three agree to 1e-7 only: a step
    across a jump of the field has an error estimate made of the jump, whose dependence on the step size the
    controller's derivative reads (measured 3e-9 apart; 1e-13 on a smooth field, test_step_sizes.py)."""
    for steps, tol in (("fixed", 1e-10), ("differentiated", 1e-7)):
        _, g_b, _ = _grads("nais", "dopri5", Backprop(steps=steps), jumps=False)
        _, g_c, _ = _grads("nais", "dopri5", Symplectic(steps=steps), jumps=False)
        assert _rel(g_c, g_b) < tol, steps
    field, y0, u = _field("hamiltonian")
    grads = {}
    for mode in ("backprop", "checkpoint"):
        block = ODEBlock(field, method="rk4", step_size=0.125, gradient=mode, stop=Stop(1e-3))
        grads[mode] = torch.autograd.grad(block(y0).pow(2).sum(), list(field.parameters()))
    assert _rel(grads["checkpoint"], grads["backprop"]) < 1e-10


@pytest.mark.parametrize(
    ("method", "gradient", "match"),
    [
        ("dopri5", "reversible", "exactly invertible step: method='alf'"),
        ("alf", "adjoint", "asynchronous leapfrog"),
        ("rk4", "exact", "`gradient` must be one of"),
    ],
)
def test_named_errors(method, gradient, match):
    field, _, _ = _field("hamiltonian")
    with pytest.raises(ValueError, match=match):
        ODEBlock(field, method=method, gradient=gradient)


@pytest.mark.parametrize("gradient", ["checkpoint", "symplectic"])
def test_the_replays_serve_every_runge_kutta_method_and_name_the_rest(gradient):
    """Every explicit Runge-Kutta method is replayed (dopri8, and fehlberg2 and adaptive_heun, which carry their
    last stage into the next step, too); torchdiffeq's multistep methods have no tableau to replay."""
    field, _, _ = _field("hamiltonian")
    for method in ("dopri8", "fehlberg2", "adaptive_heun"):
        assert ODEBlock(field, method=method, gradient=gradient).gradient.name == gradient
    t = torch.tensor([0.0, 1.0])
    with pytest.raises(ValueError, match="method='explicit_adams' has none \\(a multistep method\\).*'dopri8'"):
        odeint(lambda s, y: -y, torch.ones(2), t, method="explicit_adams", gradient=gradient, adjoint_params=())


def test_max_steps_and_nonfinite():
    field, y0, _ = _field("hamiltonian")
    with pytest.raises(SolverError, match="max_steps=3"):
        ODEBlock(field, method="dopri5", gradient="checkpoint", rtol=1e-9, atol=1e-9, options={"max_num_steps": 3})(y0)
    block = ODEBlock(field, method="rk4", step_size=0.125, gradient="symplectic")
    y = y0.clone().requires_grad_(True)
    out = block(y)
    with pytest.raises(SolverError, match="non-finite"):
        out.backward(torch.full_like(out, float("nan")))


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("kw", [dict(ADAPTIVE), {"step_size": 0.05}], ids=["adaptive", "fixed"])
def test_reversible_equals_backprop_through_alf(name, kw):
    """States rebuilt by the ALF inverse: the same gradients as backprop through the same loop (η = 1)."""
    ys_b, g_b, s_b = _grads(name, "alf", "backprop", **kw)
    ys_r, g_r, s_r = _grads(name, "alf", "reversible", **kw)
    assert torch.equal(ys_r, ys_b)
    assert _rel(g_r, g_b) < 1e-10
    assert s_r["steps_backward"] == s_r["steps_forward"] == s_b["steps_forward"]


def test_alf_is_second_order_and_finite_differences():
    field, y0, _ = _field("hamiltonian", L=1)
    ref = ODEBlock(field, method="dopri5", rtol=1e-12, atol=1e-12)(y0)
    with torch.no_grad():
        errs = [
            float((ODEBlock(field, method="alf", step_size=h, gradient="backprop")(y0) - ref).abs().max())
            for h in (0.1, 0.05)
        ]
    assert 3.0 < errs[0] / errs[1] < 5.0  # second order
    block = ODEBlock(field, method="alf", step_size=0.1, gradient="reversible")
    y = y0.clone().requires_grad_(True)
    (gy,) = torch.autograd.grad(block(y).pow(2).sum(), [y])
    eps = 1e-6
    e = torch.zeros_like(y0)
    e[1, 2] = eps
    with torch.no_grad():
        fd = (block(y0 + e).pow(2).sum() - block(y0 - e).pow(2).sum()) / (2 * eps)
    assert abs(float(fd) - float(gy[1, 2])) < 1e-7 * max(1.0, abs(float(fd)))


def test_alf_reconstruction_error_at_depth_1000():
    from cde_nets.solvers.steppers.alf import reconstruction_error

    for name in ("hamiltonian", "cubic"):
        field, y0, _ = _field(name, L=1)
        err = reconstruction_error(field, y0, 1.0, 1000)
        print(f"{name}: ALF reconstruction error after 1000 steps {err:.2e}")
        assert err < 1e-11


def test_alf_named_errors():
    field, y0, _ = _field("hamiltonian")
    with pytest.raises(ValueError, match="differ from 1/2"):
        ODEBlock(field, method="alf", gradient="reversible", options={"eta": 0.5})(y0)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['norm'\]"):
        ODEBlock(field, method="alf", gradient="reversible", options={"norm": "seminorm"})
    with pytest.raises(SolverError, match="max_steps=5"):
        ODEBlock(field, method="alf", gradient="reversible", options={"max_num_steps": 5})(y0)
