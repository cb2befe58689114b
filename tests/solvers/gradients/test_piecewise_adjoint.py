"""The piecewise adjoint: gradients equal to torchdiffeq's seminorm adjoint, cost linear in the pieces."""

from __future__ import annotations

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.blocks.stop import Stop
from cde_nets.fields import (
    MS1,
    MS2,
    MS3,
    NAIS,
    CubicFriction,
    CubicFrictionConv,
    Field,
    Hamiltonian,
    NAISConv,
    SecondOrder,
)
from cde_nets.fields.pieces import Pieces
from cde_nets.solvers import ADAPTIVE_METHODS, Adjoint, SolverError, SolverOptions, SolverStats, adapter
from cde_nets.solvers.gradients import adjoint as adjoint_module
from cde_nets.solvers.gradients import piecewise_adjoint as pa
from cde_nets.solvers.grids import aligned_grid

ADAPTIVE = {"rtol": 1e-5, "atol": 1e-7}


@pytest.fixture(autouse=True)
def _f64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _field(name: str, L: int, g: torch.Generator):
    """A small field of each kind, its initial state and block input (``None`` without one)."""
    b = 3
    if name.startswith("hamiltonian"):
        K, J = {
            "hamiltonian": ("full", "canonical"),
            "hamiltonian_h2": ("blockdiag", "structured"),
            "hamiltonian_learned": ("full", "learned"),
        }[name]
        return Hamiltonian(4, layers=L, K=K, J=J, generator=g), torch.randn(b, 4, generator=g), None
    if name == "cubic":
        return CubicFriction(3, layers=L, gamma=0.5, zero_init=False, generator=g), torch.randn(b, 3, generator=g), None
    if name == "cubic_conv":
        field = CubicFrictionConv(2, layers=L, gamma=0.5, zero_init=False, generator=g)
        return field, torch.randn(b, 2, 4, 4, generator=g), None
    if name == "second_order":
        return SecondOrder(2, layers=L, generator=g), torch.randn(b, 4, generator=g), None
    if name == "nais":
        return NAIS(3, 2, layers=L, generator=g), torch.randn(b, 3, generator=g), torch.randn(b, 2, generator=g)
    if name == "nais_conv":
        x = torch.randn(b, 2, 4, 4, generator=g)
        return NAISConv(2, layers=L, generator=g), x, torch.randn(b, 2, 4, 4, generator=g)
    cls = {"ms1": MS1, "ms2": MS2, "ms3": MS3}[name]
    return cls(4, layers=L, generator=g), torch.randn(b, 4, generator=g), None


FIELDS = [
    "hamiltonian",
    "hamiltonian_h2",
    "hamiltonian_learned",
    "cubic",
    "cubic_conv",
    "second_order",
    "nais",
    "nais_conv",
    "ms1",
    "ms2",
    "ms3",
]


def _gradients(name, L, method, piecewise, monkeypatch, times=None, **block_kw):
    """Loss gradients w.r.t. y0, u and every parameter, and the block's statistics, with either adjoint."""
    monkeypatch.setattr(adjoint_module, "PIECEWISE", piecewise)
    g = torch.Generator().manual_seed(len(name) + 10 * L)
    field, y0, u = _field(name, L, g)
    y0.requires_grad_(True)
    if u is not None:
        u.requires_grad_(True)
    # fixed steps of 1/8: one rk4 step of 1 would blow the cubic field's backward solve up
    # bosh3 is third order: a looser tolerance keeps its step counts near dopri5's
    kw = (
        {"step_size": 0.125}
        if method not in ADAPTIVE_METHODS
        else ({"rtol": 1e-4, "atol": 1e-6} if method == "bosh3" else dict(ADAPTIVE))
    )
    block = ODEBlock(field, method=method, **{"gradient": "adjoint", **kw, **block_kw})
    sol = block.solve(y0, u, t=times)
    if times is None:
        loss = sol.y.pow(2).sum()
    else:
        loss = (sol.ys.pow(2) * torch.linspace(1.0, 2.0, len(times)).view(-1, *[1] * y0.dim())).sum()
    inputs = [y0] + ([u] if u is not None else []) + list(field.parameters())
    grads = torch.autograd.grad(loss, inputs)
    return grads, sol.stats


def _assert_same(new, old, rtol=1e-10):
    for a, b in zip(new, old):
        scale = b.abs().max().clamp_min(1e-300)
        assert float((a - b).abs().max() / scale) < rtol, float((a - b).abs().max() / scale)


def _backward_stats(stats):
    return {k: stats[k] for k in ("nfe_backward", "steps_backward", "rejected_backward")}


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("method", ["dopri5", "bosh3", "euler", "rk4"])
def test_gradients_equal_torchdiffeq_adjoint(name, method, monkeypatch):
    """Every field, L = 1, 3, 8: gradients of y0, u and every parameter, and the backward step counts."""
    for L in (1, 3, 8):
        if name in ("cubic_conv", "nais_conv") and method in ("dopri5", "bosh3") and L == 8:
            continue  # the slowest cases; L = 1, 3 cover them
        new, s_new = _gradients(name, L, method, True, monkeypatch)
        old, s_old = _gradients(name, L, method, False, monkeypatch)
        _assert_same(new, old)
        assert _backward_stats(s_new) == _backward_stats(s_old)


@pytest.mark.parametrize("method", ["dopri5", "euler"])
def test_several_output_times(method, monkeypatch):
    times = [0.0, 0.3, 0.55, 1.0]  # 0.3 and 0.55 lie inside pieces; 0.5 and 0.625 are boundaries
    for name in ("hamiltonian", "nais"):
        new, s_new = _gradients(name, 8, method, True, monkeypatch, times=times)
        old, s_old = _gradients(name, 8, method, False, monkeypatch, times=times)
        _assert_same(new, old)
        assert _backward_stats(s_new) == _backward_stats(s_old)


def test_stopping_mode(monkeypatch):
    """Per-sample stopping: one solve per segment on the shrinking batch. Fixed steps: both adjoints alike."""
    stop = Stop(eps=0.3)
    new, _ = _gradients("nais", 8, "euler", True, monkeypatch, stop=stop)
    old, _ = _gradients("nais", 8, "euler", False, monkeypatch, stop=stop)
    _assert_same(new, old)


def test_backward_solve_starting_on_a_boundary_uses_the_piece_below(monkeypatch):
    """Output times every 0.25 lie on piece boundaries. torchdiffeq's adjoint evaluates the first stage of each
    backward solve at the boundary itself, i.e. with the piece above, not in force on the interval: a first-order
    error and rejected steps. The piecewise adjoint evaluates just below, as the solver does after a jump."""
    times = [0.0, 0.25, 0.5, 0.75, 1.0]
    truth, _ = _gradients(
        "nais", 8, "dopri5", True, monkeypatch, times=times, gradient="backprop", rtol=1e-11, atol=1e-13
    )
    new, s_new = _gradients("nais", 8, "dopri5", True, monkeypatch, times=times)
    old, s_old = _gradients("nais", 8, "dopri5", False, monkeypatch, times=times)

    def error(grads):
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads, truth))

    assert error(new) < 1e-5 < 1e-3 < error(old)
    assert s_new["nfe_backward"] < s_old["nfe_backward"] and s_new["rejected_backward"] < s_old["rejected_backward"]


def test_central_finite_differences():
    """rk4 with 16 steps per piece: the adjoint gradient agrees with central differences of the forward map to
    the method's O(h⁴)."""
    g = torch.Generator().manual_seed(3)
    field = Hamiltonian(2, layers=3, J="learned", generator=g)
    y0 = torch.randn(2, 2, generator=g, requires_grad=True)
    block = ODEBlock(field, method="rk4", step_size=1 / 48, gradient="adjoint")
    params = [y0, *field.parameters()]
    grads = torch.autograd.grad(block(y0).pow(3).sum(), params)
    eps = 1e-6
    with torch.no_grad():
        for p, gr in zip(params, grads):
            flat, gflat = p.view(-1), gr.reshape(-1)
            for i in range(flat.numel()):
                x = float(flat[i])
                flat[i] = x + eps
                up = float(block(y0).pow(3).sum())
                flat[i] = x - eps
                down = float(block(y0).pow(3).sum())
                flat[i] = x
                fd = (up - down) / (2 * eps)
                assert abs(fd - float(gflat[i])) <= 1e-6 * (1 + abs(fd)), (p.shape, i, fd, float(gflat[i]))


@pytest.mark.parametrize("method", ["dopri5", "euler"])
def test_backward_differentiates_one_piece_at_a_time(method, monkeypatch):
    """Every backward vector-Jacobian product is taken w.r.t. tensors no larger than one piece (or y): the
    torchdiffeq adjoint takes them w.r.t. the whole (L, ...) tensors, so this fails on it."""
    L, sizes = 8, []
    grad = torch.autograd.grad

    def recording(outputs, inputs, *args, **kwargs):
        sizes.append(max(x.numel() for x in inputs))
        return grad(outputs, inputs, *args, **kwargs)

    g = torch.Generator().manual_seed(0)
    field = Hamiltonian(4, layers=L, width=16, generator=g)
    y0 = torch.randn(2, 4, generator=g)
    block = ODEBlock(field, method=method, gradient="adjoint", **(ADAPTIVE if method == "dopri5" else {}))
    sol = block.solve(y0)
    monkeypatch.setattr(torch.autograd, "grad", recording)
    sol.y.sum().backward()
    piece = field.K.data[0].numel()
    assert field.K.data.numel() == L * piece and len(sizes) == sol.stats["nfe_backward"] > 0
    assert max(sizes) == piece


def test_seminorm_false_and_missing_jumps_fall_back(monkeypatch):
    """Without the seminorm, or when the adaptive backward solve does not stop on the boundaries, torchdiffeq's
    adjoint runs (the piecewise one would miss a boundary)."""
    calls = []
    original = pa.piecewise_adjoint
    monkeypatch.setattr(adjoint_module, "piecewise_adjoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    g = torch.Generator().manual_seed(1)
    field = Hamiltonian(4, layers=4, generator=g)
    y0 = torch.randn(3, 4, generator=g)
    ref = torch.autograd.grad(ODEBlock(field, gradient="adjoint", **ADAPTIVE)(y0).sum(), list(field.parameters()))
    assert calls == [1]
    for kw, rtol in (
        ({"gradient": Adjoint(seminorm=False), **ADAPTIVE}, 1e-3),
        ({"gradient": "adjoint", "solver": SolverOptions(**ADAPTIVE, jumps=False)}, 1e-2),
    ):  # other steps, other errors
        block = ODEBlock(field, **kw)
        grads = torch.autograd.grad(block(y0).sum(), list(field.parameters()))
        _assert_same(grads, ref, rtol=rtol)
    assert calls == [1]


@pytest.mark.parametrize("method", ["dopri5", "euler"])
def test_non_finite_backward_state_names_the_adjoint_solve(method):
    g = torch.Generator().manual_seed(2)
    field = Hamiltonian(4, layers=3, generator=g)
    block = ODEBlock(field, method=method, gradient="adjoint", **(ADAPTIVE if method == "dopri5" else {}))
    y = block(torch.randn(3, 4, generator=g))
    # dopri5 fails on its first step: NaN makes torchdiffeq's step size underflow
    with pytest.raises(SolverError, match=r"(non-finite|underflow) .* adjoint \(backward\) solve"):
        (y * float("nan")).sum().backward()


def test_max_steps_in_the_backward_solve():
    g = torch.Generator().manual_seed(2)
    field = Hamiltonian(4, layers=8, generator=g)
    y0 = torch.randn(3, 4, generator=g)
    stats = SolverStats(steps_backward=10)  # 8 forward steps pass; the backward solve hits 12 at once
    grid = aligned_grid(field.grid.boundaries.tolist(), None)
    from cde_nets.blocks.ode import _piecewise

    ys, _ = adapter.integrate(
        field,
        y0,
        torch.tensor([0.0, 1.0]),
        solver=SolverOptions("euler", max_steps=12),
        gradient=Adjoint(),
        params=list(field.parameters()),
        grid=grid,
        stats=stats,
        pieces=_piecewise(field),
    )
    with pytest.raises(SolverError, match=r"max_steps=12 .* adjoint \(backward\) solve"):
        ys[-1].sum().backward()


class _Boom(Exception):
    pass


class _Faulty(Field):
    """Raises its own errors in the backward solve; ``neighbour`` reads the previous piece instead."""

    def __init__(self, exc=None, neighbour=False):
        super().__init__(T=1.0, layers=4)
        self.state_shape = (2,)
        self.w = Pieces(self.grid, (2,), init=0.5)
        self.exc, self.neighbour = exc, neighbour

    def evaluate(self, l, y):
        if torch.is_grad_enabled() and self.exc is not None:
            raise self.exc
        return -y * self.w[max(l - 1, 0) if self.neighbour else l]


@pytest.mark.parametrize("exc", [_Boom("mine"), AssertionError("also mine")])
def test_a_field_error_in_the_backward_solve_propagates_unchanged(exc):
    field = _Faulty(exc)
    y = ODEBlock(field, gradient="adjoint", **ADAPTIVE)(torch.ones(1, 2))
    with pytest.raises(type(exc)) as info:
        y.sum().backward()
    assert info.value is exc
    assert all(p._unbound is None for p in field.modules() if isinstance(p, Pieces))


def test_reading_another_piece_is_refused():
    y = ODEBlock(_Faulty(neighbour=True), method="euler", gradient="adjoint")(torch.ones(1, 2))
    with pytest.raises(RuntimeError, match=r"read piece 2 .* piece 3 is in force"):
        y.sum().backward()
