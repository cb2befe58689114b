"""A sweep of bad inputs across the public API: each gets a named error (the argument and the fix) or a defined
result, never a silent wrong answer. Table-driven: one row per case, ``(id, thunk, exception, match)``."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

from cde_nets import Adjoint, ODEBlock, SDEBlock, SDESettings, Stop
from cde_nets import datasets as D
from cde_nets.blocks.models import Classifier, Readout, ZeroPad
from cde_nets.diagnostics import (
    continuous_bsm,
    discrete_bsm,
    energy_trajectory,
    hutchinson_trace,
    singular_value_pairing,
    symplecticity_defect,
)
from cde_nets.fields import MS1, NAIS, CubicFriction, CubicFrictionConv, Hamiltonian, NAISConv, SecondOrder
from cde_nets.fields.pieces import Pieces, TimeGrid


def H4() -> Hamiltonian:
    return Hamiltonian(4)


Case = tuple[str, Callable[[], object], type[BaseException], str]

BLOCKS: list[Case] = [
    (
        "ode-step-size-grid-too-large",
        lambda: ODEBlock(H4(), method="rk4", step_size=1e-7),
        ValueError,
        r"`step_size`=1e-07 takes 10000000 steps .* more than max_steps=100000",
    ),
    (
        "ode-stop-window-gone",
        lambda: ODEBlock(H4(), stop=dict(eps=1e-3, window=1e-5)),
        ValueError,
        r"`stop` has no `window` any more: .* Drop `window`",
    ),
    (
        "ode-linear-module",
        lambda: ODEBlock(nn.Linear(2, 2), T=1.0),
        TypeError,
        r"`field` is called as F\(t, y\), but Linear.forward",
    ),
    ("ode-no-T-for-plain-module", lambda: ODEBlock(nn.Tanh()), TypeError, r"`field` is called as F\(t, y\)"),
    (
        "ode-max-steps-bool",
        lambda: ODEBlock(H4(), options={"max_num_steps": True}),
        ValueError,
        r"`options\['max_num_steps'\]` must be a positive",
    ),
    (
        "ode-max-steps-zero",
        lambda: ODEBlock(H4(), options={"max_num_steps": 0}),
        ValueError,
        r"`options\['max_num_steps'\]` must be a positive",
    ),
    ("ode-rtol-negative", lambda: ODEBlock(H4(), rtol=-1.0), ValueError, r"`rtol` must be a finite number > 0"),
    ("ode-atol-nan", lambda: ODEBlock(H4(), atol=float("nan")), ValueError, r"`atol` must be a finite number > 0"),
    ("ode-unknown-method", lambda: ODEBlock(H4(), method="rk45"), ValueError, r"`method` 'rk45' is unknown"),
    ("ode-unknown-gradient", lambda: ODEBlock(H4(), gradient="magic"), ValueError, r"`gradient` must be one of"),
    ("ode-unknown-option", lambda: ODEBlock(H4(), options={"foo": 1}), ValueError, r"unknown option\(s\) \['foo'\]"),
    (
        "ode-T-mismatch",
        lambda: ODEBlock(Hamiltonian(4, layers=2, T=1.0), T=2.0),
        ValueError,
        r"`T`=2.0 differs from the field's T=1.0",
    ),
    ("ode-T-zero", lambda: ODEBlock(H4(), T=0.0), ValueError, r"`T` must be a finite number > 0"),
    ("ode-y0-list", lambda: ODEBlock(H4())([[0.0] * 4]), TypeError, r"`y0` must be a torch.Tensor"),
    ("ode-y0-shape", lambda: ODEBlock(H4())(torch.zeros(2, 3)), ValueError, r"`y0` has shape \(2, 3\)"),
    (
        "ode-y0-int",
        lambda: ODEBlock(H4())(torch.zeros(2, 4, dtype=torch.long)),
        TypeError,
        r"`y0` must be a floating-point tensor",
    ),
    ("ode-y0-nan", lambda: ODEBlock(H4())(torch.full((2, 4), float("nan"))), ValueError, r"`y0`"),
    (
        "ode-mixed-dtype",
        lambda: ODEBlock(H4())(torch.zeros(2, 4, dtype=torch.float64)),
        TypeError,
        r"`y0` is torch.float64 but the field's parameters are torch.float32",
    ),
    (
        "ode-u-for-field-without-input",
        lambda: ODEBlock(H4())(torch.zeros(2, 4), u=torch.zeros(2, 4)),
        TypeError,
        r"`u` was given but Hamiltonian takes no block input; drop `u`",
    ),
    (
        "ode-missing-u",
        lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3)),
        ValueError,
        r"NAIS needs its block input: pass `u=`",
    ),
    (
        "ode-u-batch",
        lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3), u=torch.zeros(3, 2)),
        ValueError,
        r"`u` has batch 3 but the state has batch 2",
    ),
    (
        "ode-u-shape",
        lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3), u=torch.zeros(2, 5)),
        ValueError,
        r"`u` has shape \(2, 5\), but NAIS expects \(batch, 2\)",
    ),
    (
        "ode-u-list",
        lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3), u=[[0.0, 0.0]] * 2),
        TypeError,
        r"`u` must be a torch.Tensor",
    ),
    (
        "ode-u-nan",
        lambda: ODEBlock(NAIS(3, 2))(torch.zeros(2, 3), u=torch.full((2, 2), float("nan"))),
        ValueError,
        r"`u`",
    ),
    (
        "ode-t-not-monotone",
        lambda: ODEBlock(H4()).solve(torch.zeros(1, 4), t=[0.5, 0.2, 0.7]),
        ValueError,
        r"`t` must be a 1-D strictly monotone sequence",
    ),
    (
        "ode-t-beyond-T",
        lambda: ODEBlock(H4()).solve(torch.zeros(1, 4), t=[0.0, 2.0]),
        ValueError,
        r"`t` must lie within \[0, T\]",
    ),
    (
        "ode-t-with-stop",
        lambda: ODEBlock(H4(), stop=Stop(eps=1.0)).solve(torch.zeros(1, 4), t=[0.0, 1.0]),
        ValueError,
        r"`t` and `stop` do not combine",
    ),
    ("stop-eps-zero", lambda: Stop(eps=0.0), ValueError, r"`eps` must be a finite number > 0"),
    ("stop-max-depth-float", lambda: Stop(eps=1e-3, max_depth=2.5), ValueError, r"`max_depth` must be a positive"),
    ("stop-not-a-dict", lambda: ODEBlock(H4(), stop=1e-3), TypeError, r"`stop` must be a cde_nets.Stop or a dict"),
    (
        "sde-rtol-without-adaptive",
        lambda: SDEBlock(H4(), rtol=1e-3),
        ValueError,
        r"`rtol`/`atol` control adaptive stepping",
    ),
    ("sde-y0-list", lambda: SDEBlock(H4())([[0.0] * 4]), TypeError, r"`y0` must be a torch.Tensor"),
    (
        "sde-t-off-grid",
        lambda: SDEBlock(H4(), step_size=0.25).solve(torch.zeros(1, 4), t=[0.3, 1.0]),
        ValueError,
        r"`t`=0.3 is not a point of the step grid",
    ),
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
    (
        "hamiltonian-init-std-negative",
        lambda: Hamiltonian(4, init_std=-1.0),
        ValueError,
        r"`init_std` must be a finite number >= 0",
    ),
    ("hamiltonian-init-std-nan", lambda: Hamiltonian(4, init_std=float("nan")), ValueError, r"`init_std`"),
    (
        "hamiltonian-J-nan",
        lambda: Hamiltonian(2, J=torch.full((2, 2), float("nan"))),
        ValueError,
        r"`J` must be a finite floating-point skew-symmetric matrix",
    ),
    (
        "hamiltonian-J-inf",
        lambda: Hamiltonian(2, J=torch.tensor([[0.0, float("inf")], [-float("inf"), 0.0]])),
        ValueError,
        r"`J` must be a finite",
    ),
    ("hamiltonian-J-not-skew", lambda: Hamiltonian(2, J=torch.eye(2)), ValueError, r"`J` must be skew-symmetric"),
    ("hamiltonian-J-shape", lambda: Hamiltonian(4, J=torch.zeros(2, 2)), ValueError, r"`J` has shape \(2, 2\)"),
    ("hamiltonian-K-kind", lambda: Hamiltonian(4, K="diag"), ValueError, r"`K` must be 'full'"),
    ("hamiltonian-blockdiag-odd", lambda: Hamiltonian(3, K="blockdiag"), ValueError, r"needs an even `dim`"),
    ("hamiltonian-layers-zero", lambda: Hamiltonian(4, layers=0), ValueError, r"`layers` must be a positive"),
    ("hamiltonian-T-negative", lambda: Hamiltonian(4, T=-1.0), ValueError, r"`T` must be a finite positive"),
    (
        "cubic-friction-init-std",
        lambda: __import__("cde_nets.fields", fromlist=["CubicFriction"]).CubicFriction(2, init_std=-1.0),
        ValueError,
        r"`init_std` must be a finite number >= 0",
    ),
    (
        "cubic-friction-gamma-negative",
        lambda: __import__("cde_nets.fields", fromlist=["CubicFriction"]).CubicFriction(2, gamma=-1.0),
        ValueError,
        r"`gamma` must be a finite number >= 0",
    ),
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


# Data sets, models, pieces, diagnostics, fields and blocks, one row per bad input.
API: list[Case] = [
    ("swiss-n=0", lambda: D.swiss_roll(n=0), ValueError, "`n` must be a positive multiple of 2, got 0\\."),
    ("swiss-n=-5", lambda: D.swiss_roll(n=-5), ValueError, "`n` must be a positive multiple of 2, got \\-5\\."),
    ("swiss-n=7", lambda: D.swiss_roll(n=7), ValueError, "`n` must be a positive multiple of 2, got 7\\."),
    (
        "swiss-dim=1",
        lambda: D.swiss_roll(n=100, dim=1),
        ValueError,
        "`dim` must be an int >= 2 to embed 2\\-D points, g",
    ),
    (
        "swiss-seed=str",
        lambda: D.swiss_roll(n=100, seed="a"),
        ValueError,
        "`seed` must be a non\\-negative int or a torch\\.Gen",
    ),
    (
        "moons-dtype-int",
        lambda: D.double_moons(n=100, dtype=torch.long),
        TypeError,
        "`dtype` must be a floating\\-point torch dtype \\(fe",
    ),
    (
        "circles-noise--1",
        lambda: D.concentric_circles(noise=-1.0),
        ValueError,
        "`noise` must be a finite standard deviation >= 0",
    ),
    (
        "circles-n_test--1",
        lambda: D.concentric_circles(n_test=-1),
        ValueError,
        "`n` must be a positive multiple of 2, got \\-1\\.",
    ),
    (
        "digits-test_fraction-0",
        lambda: D.digits(test_fraction=0.0),
        ValueError,
        "`test_fraction` must lie in \\(0, 1\\), got 0\\.0\\.",
    ),
    (
        "digits-test_fraction-1.5",
        lambda: D.digits(test_fraction=1.5),
        ValueError,
        "`test_fraction` must lie in \\(0, 1\\), got 1\\.5\\.",
    ),
    (
        "mnist-test_fraction-2",
        lambda: D.mnist_5k(test_fraction=2.0),
        ValueError,
        "`test_fraction` must lie in \\(0, 1\\), got 2\\.0\\.",
    ),
    ("hauser_bands-n=0", lambda: D.hauser_bands(n=0), ValueError, "`n` must be a positive multiple of 4, got 0\\."),
    (
        "zeropad-smaller",
        lambda: ZeroPad(2)(torch.zeros(3, 4)),
        ValueError,
        "input has 4 features/channels, more than the sta",
    ),
    ("readout-kind", lambda: Readout("softmax", 4, 2), ValueError, "`readout` must be 'linear', 'coordinate' or 'max"),
    (
        "readout-coord-n_out>dim",
        lambda: Readout("coordinate", 2, 3),
        ValueError,
        "`readout='coordinate'` needs n_out <= state size",
    ),
    (
        "classifier-n_out-0",
        lambda: Classifier(ODEBlock(Hamiltonian(4)), 2, 4, 0),
        ValueError,
        "`n_out` must be a positive integer, got 0\\.",
    ),
    (
        "classifier-in_features>state",
        lambda: Classifier(ODEBlock(Hamiltonian(4)), 6, 4, 2)(torch.zeros(2, 6)),
        ValueError,
        "input has 6 features/channels, more than the sta",
    ),
    ("pieces-layers-0", lambda: TimeGrid(1.0, 0), ValueError, "`layers` must be a positive integer \\(number of p"),
    (
        "pieces-init-shape",
        lambda: Pieces(TimeGrid(1.0, 2), (3,), init=torch.zeros(4)),
        ValueError,
        "`init` has shape \\(4,\\); expected one piece \\(3,\\) o",
    ),
    (
        "timegrid-T-nan",
        lambda: TimeGrid(float("nan"), 2),
        ValueError,
        "`T` must be a finite positive end time, got nan\\.",
    ),
    (
        "energy_traj-t-not-from-0",
        lambda: energy_trajectory(ODEBlock(Hamiltonian(4)), torch.zeros(1, 4), [0.5, 1.0]),
        ValueError,
        "`t` must start at 0 and end at or before T=1\\.0, ",
    ),
    (
        "energy_traj-non-ham",
        lambda: energy_trajectory(ODEBlock(CubicFriction(2)), torch.zeros(1, 2), [0.0, 1.0]),
        TypeError,
        "CubicFriction declares no energy; pass `energy=l",
    ),
    (
        "continuous_bsm-t-0",
        lambda: continuous_bsm(ODEBlock(Hamiltonian(4)), torch.zeros(1, 4), [0.0]),
        ValueError,
        "`t` must hold horizons in \\(0, T=1\\.0\\], got \\[0\\.0\\]\\.",
    ),
    (
        "continuous_bsm-J-shape",
        lambda: continuous_bsm(ODEBlock(Hamiltonian(4)), torch.zeros(1, 4), [1.0], J=torch.eye(3)),
        ValueError,
        "`J` has shape \\(3, 3\\), but Phi's matrices are \\(4,",
    ),
    (
        "discrete_bsm-layers-0",
        lambda: discrete_bsm(lambda l, y: y, torch.zeros(1, 2), layers=0),
        ValueError,
        "`layers` must be a positive integer when `step` ",
    ),
    (
        "discrete_bsm-3d",
        lambda: discrete_bsm([lambda y: y], torch.zeros(1, 2, 2)),
        ValueError,
        "`y0` must be \\(batch, n\\), got shape \\(1, 2, 2\\); fl",
    ),
    (
        "svp-odd",
        lambda: singular_value_pairing(torch.eye(3)),
        ValueError,
        "`Phi` must hold square matrices of even size, go",
    ),
    (
        "symplecticity-J-shape",
        lambda: symplecticity_defect(torch.eye(4)[None], torch.eye(2)),
        ValueError,
        "`J` has shape \\(2, 2\\), but Phi's matrices are \\(4,",
    ),
    (
        "hutchinson-probes-0",
        lambda: hutchinson_trace(lambda y: y, torch.zeros(2, 3), probes=0),
        ValueError,
        "`probes` must be an integer >= 2 \\(the standard e",
    ),
    (
        "sde-paths-1.5",
        lambda: SDEBlock(Hamiltonian(4), settings=SDESettings(paths=1.5)),
        ValueError,
        "`paths` must be a positive integer \\(Brownian pat",
    ),
    (
        "sde-seed--1",
        lambda: SDEBlock(Hamiltonian(4), seed=-1),
        ValueError,
        "`seed` must be a non\\-negative integer or None, g",
    ),
    (
        "sde-noise-at-eval-str",
        lambda: SDEBlock(Hamiltonian(4), settings=SDESettings(channels=0)),
        ValueError,
        "`channels` must be a positive integer \\(noise cha",
    ),
    ("ode-T-str", lambda: ODEBlock(Hamiltonian(4), T="1"), TypeError, "`T` must be a positive number, got '1'\\."),
    ("ode-field-None", lambda: ODEBlock(None), TypeError, "`field` must be an nn\\.Module with forward\\(t, y\\),"),
    (
        "ode-options-not-dict",
        lambda: ODEBlock(Hamiltonian(4), options=[1]),
        TypeError,
        "`options` must be a dict of torchdiffeq options,",
    ),
    (
        "ode-adjoint_method-bad",
        lambda: ODEBlock(Hamiltonian(4), gradient=Adjoint(method="xx")),
        ValueError,
        "`adjoint_method` 'xx' is unknown; adaptive: \\['ad",
    ),
    (
        "ode-adjoint_rtol-neg",
        lambda: ODEBlock(Hamiltonian(4), gradient=Adjoint(rtol=-1)),
        ValueError,
        "`rtol` must be a finite number > 0, got ",
    ),
    (
        "ode-y0-0-dim",
        lambda: ODEBlock(Hamiltonian(4))(torch.tensor(1.0)),
        ValueError,
        "`y0` has shape \\(\\), but Hamiltonian expects \\(batc",
    ),
    (
        "ode-y0-complex",
        lambda: ODEBlock(Hamiltonian(4))(torch.zeros(2, 4, dtype=torch.complex64)),
        TypeError,
        "`y0` must be a floating\\-point tensor, got torch\\.",
    ),
    (
        "ode-t-2d",
        lambda: ODEBlock(Hamiltonian(4)).solve(torch.zeros(1, 4), t=[[0.0, 1.0]]),
        ValueError,
        "`t` must be a 1\\-D strictly monotone sequence o",
    ),
    (
        "ode-t-one-time",
        lambda: ODEBlock(Hamiltonian(4)).solve(torch.zeros(1, 4), t=[0.5]),
        ValueError,
        "`t` must be a 1\\-D strictly monotone sequence o",
    ),
    (
        "ode-t-str",
        lambda: ODEBlock(Hamiltonian(4)).solve(torch.zeros(1, 4), t="abc"),
        TypeError,
        "`t` must be a 1\\-D sequence of times, got str\\.",
    ),
    (
        "ode-t-nan",
        lambda: ODEBlock(Hamiltonian(4)).solve(torch.zeros(1, 4), t=[0.0, float("nan")]),
        ValueError,
        "`t` holds a non\\-finite time \\(NaN or inf\\): `t\\[1\\]`=nan",
    ),
    (
        "ode-t-negative",
        lambda: ODEBlock(Hamiltonian(4)).solve(torch.zeros(1, 4), t=[-1.0, 1.0]),
        ValueError,
        "`t` must lie within \\[0, T\\] = \\[0, 1\\.0\\], got \\[\\-1\\.0",
    ),
    (
        "ode-event-not-callable",
        lambda: ODEBlock(H4()).solve(torch.zeros(2, 4), event=1.0),
        TypeError,
        r"`event` must be a callable g\(t, y\) -> \(batch,\), got float",
    ),
    (
        "ode-t-end-shape",
        lambda: ODEBlock(H4()).solve(torch.zeros(2, 4), t_end=torch.ones(3)),
        ValueError,
        r"`t_end` must be a float tensor of shape \(batch,\) = \(2,\)",
    ),
    (
        "ode-t-end-outside",
        lambda: ODEBlock(H4()).solve(torch.zeros(2, 4), t_end=torch.tensor([0.5, 2.0])),
        ValueError,
        r"`t_end\[1\]`=2 lies outside \[0, T\] = \[0, 1\]",
    ),
    ("stop-eps-str", lambda: Stop(eps="a"), TypeError, "`eps` must be a positive number, got 'a'\\."),
    (
        "activation-unknown",
        lambda: Hamiltonian(4, activation="swish2"),
        ValueError,
        "`activation` 'swish2' is unknown; use one of \\['i",
    ),
    (
        "second_order-order-0",
        lambda: SecondOrder(2, order=0),
        ValueError,
        "`order` must be a positive integer \\(1 = first or",
    ),
    (
        "second_order-hidden-0",
        lambda: SecondOrder(2, hidden=0),
        ValueError,
        "`hidden` must be a positive integer \\(width of th",
    ),
    (
        "conv-friction-kernel-even",
        lambda: CubicFrictionConv(2, kernel_size=2),
        ValueError,
        "`kernel_size` must be a positive odd integer \\(sa",
    ),
    (
        "nais-conv-kernel-even",
        lambda: NAISConv(2, kernel_size=4),
        ValueError,
        "`kernel_size` must be a positive odd integer \\(sa",
    ),
    (
        "nais-conv-kernel-bool",
        lambda: NAISConv(2, kernel_size=True),
        ValueError,
        "`kernel_size` must be a positive odd integer \\(sa",
    ),
    (
        "conv-friction-kernel-bool",
        lambda: CubicFrictionConv(2, kernel_size=True),
        ValueError,
        "`kernel_size` must be a positive odd integer \\(sa",
    ),
    (
        "nais-delta-big",
        lambda: NAIS(3, 2, eps=0.1, delta=5.0),
        ValueError,
        "`delta` must lie in \\(0, 2\\(1 − eps\\)\\] = \\(0, 1\\.8\\] f",
    ),
    ("ms1-odd", lambda: MS1(3), ValueError, "MS1 splits y = \\(p, q\\) and needs an even `dim`, g"),
    (
        "K_mask-shape",
        lambda: Hamiltonian(4, K_mask=torch.ones(3, 3)),
        ValueError,
        "`K_mask` has shape \\(3, 3\\), expected \\(4, 4\\) or \\(1",
    ),
    (
        "J_mask-asym",
        lambda: Hamiltonian(4, J_mask=torch.triu(torch.ones(4, 4))),
        ValueError,
        "`J_mask` must be symmetric so that the masked J ",
    ),
    (
        "J-str-unknown",
        lambda: Hamiltonian(4, J="random"),
        ValueError,
        "`J` must be 'canonical', 'structured', 'learned'",
    ),
    ("friction-mu", lambda: CubicFriction(2, mu=0.5), ValueError, "`mu` must be > 1 \\(eq\\. R57\\), got 0\\.5\\."),
]


@pytest.mark.parametrize(("thunk", "exc", "match"), [c[1:] for c in API], ids=[c[0] for c in API])
def test_bad_api_input_raises_a_named_error(thunk, exc, match):
    with pytest.raises(exc, match=match):
        thunk()


# The command line: each bad invocation exits with status 2 and names the option, before any work starts.
CLI: list[tuple[str, list[str], str]] = [
    ("unknown-experiment", ["nonsense", "--tiny"], r"unknown reproduction 'nonsense'; choose one of"),
    ("threads-zero", ["blog", "--tiny", "--threads", "0"], r"--threads must be a positive integer"),
    ("threads-negative", ["blog", "--tiny", "--threads", "-2"], r"--threads must be a positive integer"),
    ("threads-not-int", ["blog", "--tiny", "--threads", "two"], r"argument --threads: invalid int value"),
    (
        "resume-without-snapshots",
        ["blog", "--tiny", "--resume", "--no-snapshots"],
        r"--resume needs the snapshots",
    ),
    ("quick-and-tiny", ["blog", "--tiny", "--quick"], r"not allowed with argument"),
    ("seed-not-int", ["blog", "--seed", "x"], r"argument --seed: invalid int value"),
    ("seed-negative", ["blog", "--tiny", "--seed", "-1"], r"--seed must be an integer in \[0, 2\*\*32\), got -1"),
    ("seed-too-large", ["blog", "--tiny", "--seed", str(2**32)], r"--seed must be an integer in \[0, 2\*\*32\)"),
    ("distributed-seed-negative", ["distributed", "--tiny", "--seed", "-1"], r"--seed must be an integer in"),
    ("out-is-a-file", ["blog", "--tiny", "--out", "{file}"], r"`--out` .* is a file; name a folder"),
    ("out-in-use", ["blog", "--tiny", "--out", "{busy}"], r"is in use by another run \(process \d+\)"),
]


@pytest.mark.parametrize(("argv", "match"), [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_bad_command_line_is_refused_before_any_work(argv, match, tmp_path, capsys):
    import os

    from cde_nets.experiments.__main__ import main

    (tmp_path / "file").write_text("x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / ".lock").write_text(str(os.getppid()))  # a live process holds it
    argv = [a.format(file=tmp_path / "file", busy=busy) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not list(busy.glob("*.json")) and (busy / ".lock").read_text() == str(os.getppid())


def test_a_stale_lock_is_taken_over_and_released(tmp_path):
    from cde_nets.train.snapshots import RunLock

    (tmp_path / ".lock").write_text("999999999")  # no such process
    with RunLock(tmp_path):
        assert (tmp_path / ".lock").read_text() != "999999999"
    assert not (tmp_path / ".lock").exists()


@pytest.mark.parametrize("mode", ["plain", "stopping", "memory_free"])
def test_discrete_nan_parameter_is_named(mode):
    from cde_nets import discretize
    from cde_nets.solvers.errors import SolverError

    f = Hamiltonian(4, layers=4)
    with torch.no_grad():
        f.K.data[0, 0, 0] = float("nan")
    kw = {"stopping": dict(stop=Stop(eps=1e-3)), "memory_free": dict(momentum=(0.9, 1.0), memory_free=True)}
    net = discretize(f, "momentum" if mode == "memory_free" else "euler", **kw.get(mode, {}))
    with pytest.raises(SolverError, match=r"parameter `field\.K\.data` holds NaN/inf"):
        net(torch.randn(3, 4))


def test_discrete_blow_up_is_located_at_its_layer():
    from cde_nets import discretize
    from cde_nets.solvers.errors import SolverError

    net = discretize(CubicFriction(4, layers=3), "euler")
    x = 100 * torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(SolverError, match=r"non-finite \(NaN/inf\) at layer \d of 3 \(Ruseckas residual"):
        net(x)
