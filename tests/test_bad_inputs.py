"""A sweep of bad inputs across the public API: each gets a named error (the argument and the fix) or a defined
result, never a silent wrong answer. Table-driven: one row per case, ``(id, thunk, exception, match)``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, SDEBlock, Stop
from cde_nets.fields import NAIS, Hamiltonian


def H4() -> Hamiltonian:
    return Hamiltonian(4)


Case = tuple[str, Callable[[], object], type[BaseException], str]

BLOCKS: list[Case] = [
    ("ode-step-size-grid-too-large", lambda: ODEBlock(H4(), method="rk4", step_size=1e-7), ValueError,
     r"`step_size`=1e-07 takes 10000000 steps .* more than max_steps=100000"),
    ("ode-stop-window-too-small", lambda: ODEBlock(H4(), stop=Stop(eps=1e-3, window=1e-5)), ValueError,
     r"`stop.window`=1e-05 makes 100000 windows"),
    ("ode-linear-module", lambda: ODEBlock(nn.Linear(2, 2), T=1.0), TypeError,
     r"`field` is called as F\(t, y\), but Linear.forward"),
    ("ode-no-T-for-plain-module", lambda: ODEBlock(nn.Tanh()), TypeError, r"`field` is called as F\(t, y\)"),
    ("ode-max-steps-bool", lambda: ODEBlock(H4(), max_steps=True), ValueError, r"`max_steps` must be a positive"),
    ("ode-max-steps-zero", lambda: ODEBlock(H4(), max_steps=0), ValueError, r"`max_steps` must be a positive"),
    ("ode-rtol-negative", lambda: ODEBlock(H4(), rtol=-1.0), ValueError, r"`rtol` must be a finite number > 0"),
    ("ode-atol-nan", lambda: ODEBlock(H4(), atol=float("nan")), ValueError, r"`atol` must be a finite number > 0"),
    ("ode-unknown-method", lambda: ODEBlock(H4(), method="rk45"), ValueError, r"`method` 'rk45' is unknown"),
    ("ode-unknown-gradient", lambda: ODEBlock(H4(), gradient="magic"), ValueError, r"`gradient` must be one of"),
    ("ode-unknown-option", lambda: ODEBlock(H4(), options={"foo": 1}), ValueError, r"unknown option\(s\) \['foo'\]"),
    ("ode-T-mismatch", lambda: ODEBlock(Hamiltonian(4, layers=2, T=1.0), T=2.0), ValueError,
     r"`T`=2.0 differs from the field's T=1.0"),
    ("ode-T-zero", lambda: ODEBlock(H4(), T=0.0), ValueError, r"`T` must be a finite number > 0"),
    ("ode-y0-list", lambda: ODEBlock(H4())([[0.0] * 4]), TypeError, r"`y0` must be a torch.Tensor"),
    ("ode-y0-shape", lambda: ODEBlock(H4())(torch.zeros(2, 3)), ValueError, r"`y0` has shape \(2, 3\)"),
    ("ode-y0-int", lambda: ODEBlock(H4())(torch.zeros(2, 4, dtype=torch.long)), TypeError,
     r"`y0` must be a floating-point tensor"),
    ("ode-y0-nan", lambda: ODEBlock(H4())(torch.full((2, 4), float("nan"))), ValueError, r"`y0`"),
    ("ode-mixed-dtype", lambda: ODEBlock(H4())(torch.zeros(2, 4, dtype=torch.float64)), TypeError,
     r"`y0` is torch.float64 but the field's parameters are torch.float32"),
    ("ode-u-for-field-without-input", lambda: ODEBlock(H4())(torch.zeros(2, 4), u=torch.zeros(2, 4)), TypeError,
     r"`u` was given but Hamiltonian takes no block input; drop `u`"),
    ("ode-missing-u", lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3)), ValueError,
     r"NAIS needs its block input: pass `u=`"),
    ("ode-u-batch", lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3), u=torch.zeros(3, 2)), ValueError,
     r"`u` has batch 3 but the state has batch 2"),
    ("ode-u-shape", lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3), u=torch.zeros(2, 5)), ValueError,
     r"`u` has shape \(2, 5\), but NAIS expects \(batch, 2\)"),
    ("ode-u-list", lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3), u=[[0.0, 0.0]] * 2), TypeError,
     r"`u` must be a torch.Tensor"),
    ("ode-u-nan", lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3), u=torch.full((2, 2), float("nan"))), ValueError,
     r"`u`"),
    ("ode-t-decreasing", lambda: ODEBlock(H4()).solve(torch.zeros(1, 4), t=[0.5, 0.2]), ValueError,
     r"`t` must be a 1-D strictly increasing"),
    ("ode-t-beyond-T", lambda: ODEBlock(H4()).solve(torch.zeros(1, 4), t=[0.0, 2.0]), ValueError,
     r"`t` must lie within \[0, T\]"),
    ("ode-t-with-stop", lambda: ODEBlock(H4(), stop=Stop(eps=1.0)).solve(torch.zeros(1, 4), t=[0.0, 1.0]),
     ValueError, r"`t` and `stop` do not combine"),
    ("stop-eps-zero", lambda: Stop(eps=0.0), ValueError, r"`eps` must be a finite number > 0"),
    ("stop-max-depth-float", lambda: Stop(eps=1e-3, max_depth=2.5), ValueError, r"`max_depth` must be a positive"),
    ("stop-not-a-dict", lambda: ODEBlock(H4(), stop=1e-3), TypeError, r"`stop` must be a cde_nets.Stop or a dict"),
    ("sde-rtol-without-adaptive", lambda: SDEBlock(H4(), rtol=1e-3), ValueError,
     r"`rtol`/`atol` control adaptive stepping"),
    ("sde-y0-list", lambda: SDEBlock(H4())([[0.0] * 4]), TypeError, r"`y0` must be a torch.Tensor"),
    ("sde-t-off-grid", lambda: SDEBlock(H4(), step_size=0.25).solve(torch.zeros(1, 4), t=[0.3, 1.0]), ValueError,
     r"`t`=0.3 is not a point of the step grid"),
]


@pytest.mark.parametrize(("thunk", "exc", "match"), [c[1:] for c in BLOCKS], ids=[c[0] for c in BLOCKS])
def test_bad_input_raises_a_named_error(thunk, exc, match):
    with pytest.raises(exc, match=match):
        thunk()


@pytest.mark.parametrize(
    "make",
    [
        lambda f: ODEBlock(f),
        lambda f: ODEBlock(f, method="rk4"),
        lambda f: ODEBlock(f, stop=Stop(eps=1e-3)),
        lambda f: SDEBlock(f, noise="diagonal"),
    ],
    ids=["adaptive", "fixed", "stopping", "sde"],
)
def test_an_empty_batch_gives_an_empty_result_with_every_parameter_in_the_graph(make):
    """An empty data-parallel shard: a ``(0, n)`` result, and a backward that reaches every parameter."""
    block = make(Hamiltonian(4, layers=2))
    y = block(torch.zeros(0, 4))
    assert y.shape == (0, 4)
    y.sum().backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) == 0.0 for p in block.parameters())


FIELDS: list[Case] = [
    ("hamiltonian-width-zero", lambda: Hamiltonian(4, width=0), ValueError, r"`width` must be a positive integer"),
    ("hamiltonian-dim-bool", lambda: Hamiltonian(True), ValueError, r"`dim` must be a positive integer"),
    ("hamiltonian-init-std-negative", lambda: Hamiltonian(4, init_std=-1.0), ValueError,
     r"`init_std` must be a finite number >= 0"),
    ("hamiltonian-init-std-nan", lambda: Hamiltonian(4, init_std=float("nan")), ValueError, r"`init_std`"),
    ("hamiltonian-J-nan", lambda: Hamiltonian(2, J=torch.full((2, 2), float("nan"))), ValueError,
     r"`J` must be a finite floating-point skew-symmetric matrix"),
    ("hamiltonian-J-inf", lambda: Hamiltonian(2, J=torch.tensor([[0.0, float("inf")], [-float("inf"), 0.0]])),
     ValueError, r"`J` must be a finite"),
    ("hamiltonian-J-not-skew", lambda: Hamiltonian(2, J=torch.eye(2)), ValueError, r"`J` must be skew-symmetric"),
    ("hamiltonian-J-shape", lambda: Hamiltonian(4, J=torch.zeros(2, 2)), ValueError, r"`J` has shape \(2, 2\)"),
    ("hamiltonian-K-kind", lambda: Hamiltonian(4, K="diag"), ValueError, r"`K` must be 'full'"),
    ("hamiltonian-blockdiag-odd", lambda: Hamiltonian(3, K="blockdiag"), ValueError, r"needs an even `dim`"),
    ("hamiltonian-layers-zero", lambda: Hamiltonian(4, layers=0), ValueError, r"`layers` must be a positive"),
    ("hamiltonian-T-negative", lambda: Hamiltonian(4, T=-1.0), ValueError, r"`T` must be a finite positive"),
    ("cubic-friction-init-std", lambda: __import__("cde_nets.fields", fromlist=["CubicFriction"]).CubicFriction(
        2, init_std=-1.0), ValueError, r"`init_std` must be a finite number >= 0"),
    ("cubic-friction-gamma-negative", lambda: __import__("cde_nets.fields", fromlist=["CubicFriction"]).CubicFriction(
        2, gamma=-1.0), ValueError, r"`gamma` must be a finite number >= 0"),
    ("nais-init-std", lambda: NAIS(3, 2, init_std=-0.5), ValueError, r"`init_std` must be a finite number >= 0"),
    ("nais-eps", lambda: NAIS(3, 2, eps=0.7), ValueError, r"`eps` must lie in \(0, 0.5\)"),
    ("nais-dim", lambda: NAIS(0, 2), ValueError, r"`dim` must be a positive integer"),
]


@pytest.mark.parametrize(("thunk", "exc", "match"), [c[1:] for c in FIELDS], ids=[c[0] for c in FIELDS])
def test_bad_field_arguments_raise_named_errors(thunk, exc, match):
    with pytest.raises(exc, match=match):
        thunk()


def test_relative_drift_of_zero_energies_is_refused_not_huge():
    from cde_nets.diagnostics import relative_drift

    E = torch.tensor([[0.0, 0.0], [1e-17, -2e-17]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"relative drift is undefined: the initial energies are zero"):
        relative_drift(E)
    assert relative_drift(torch.tensor([[2.0], [2.5]], dtype=torch.float64)) == pytest.approx(0.25)


def _nan_field() -> Hamiltonian:
    f = Hamiltonian(4, layers=2)
    with torch.no_grad():
        f.K.data[0, 0, 0] = float("nan")
    return f


@pytest.mark.parametrize(
    "make",
    [
        lambda f: ODEBlock(f, method="rk4"),
        lambda f: ODEBlock(f),
        lambda f: ODEBlock(f, stop=Stop(eps=1e-3)),
        lambda f: ODEBlock(f, gradient="backprop"),
        lambda f: SDEBlock(f),
    ],
    ids=["fixed", "adaptive", "stopping", "backprop", "sde"],
)
def test_a_nan_parameter_is_named_not_passed_on(make):
    """A NaN weight: fixed-step solves returned all NaN and adaptive ones reported 'step size underflow'."""
    from cde_nets.solvers.errors import SolverError

    with pytest.raises(SolverError, match=r"parameter `(field\.)?K\.data` holds NaN/inf"):
        make(_nan_field())(torch.randn(3, 4))


def test_a_blow_up_is_located_in_time():
    from cde_nets.fields import CubicFriction
    from cde_nets.solvers.errors import SolverError

    f = CubicFriction(4, layers=2)
    with pytest.raises(SolverError, match=r"non-finite value at t=0\.\d+ \(piece 0 of 2\)"):
        ODEBlock(f, method="rk4")(100 * torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
