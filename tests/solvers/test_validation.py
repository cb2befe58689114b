"""Both doors of the library, ``odeint`` (torchdiffeq's API) and ``ODEBlock``, refuse the same bad input with the
same named error (:mod:`cde_nets.solvers.validation`): tolerances, states, times, a field's output and an event
function's output."""

import math

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, odeint, odeint_event
from cde_nets.solvers.errors import Reason, SolverError

F64 = torch.float64
T01 = torch.tensor([0.0, 1.0], dtype=F64)


class Decay(nn.Module):
    """``y' = −y``: ``y(1) = e^{−1} y(0)``."""

    def forward(self, t, y):
        return -y


class BlowsUp(nn.Module):
    """``y' = −y`` until ``t = 0.52``, NaN after it."""

    def forward(self, t, y):
        return torch.where(t > 0.52, torch.full_like(y, math.nan), -y)


class Out(nn.Module):
    """A field returning a fixed wrong output."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, t, y):
        return self.make(y)


def odeint_door(field, y0, t=T01, **kw):
    return odeint(field, y0[0], torch.as_tensor(t, dtype=F64), **kw)[-1]


def block_door(field, y0, t=None, **kw):
    step = kw.pop("options", {}).get("step_size")
    block = ODEBlock(field, T=1.0, step_size=step, **kw)
    return block(y0) if t is None else block.solve(y0, t=t).y


DOORS = {"odeint": odeint_door, "ODEBlock": block_door}
Y0 = torch.ones(1, 3, dtype=F64)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("name", ["rtol", "atol"])
def test_a_negative_tolerance_is_refused_by_name(door, name):
    with pytest.raises(ValueError, match=rf"`{name}` must be a finite number > ?=? ?0, got -1\.0"):
        DOORS[door](Decay(), Y0, **{name: -1.0})


def test_tolerance_tensors_and_zero_rtol_keep_working_and_a_bad_element_is_named():
    y0 = torch.ones(3, dtype=F64)
    exact = math.exp(-1.0)
    # rtol = 0 asks for absolute error only (torchdiffeq's meaning)
    assert abs(float(odeint(Decay(), y0, T01, rtol=0.0, atol=1e-10)[-1, 0]) - exact) < 1e-8
    atol = torch.full((3,), 1e-10, dtype=F64)
    assert abs(float(odeint(Decay(), y0, T01, rtol=1e-8, atol=atol)[-1, 2]) - exact) < 1e-7
    pair = (y0, 2 * y0[:2])
    out = odeint(lambda t, y: (-y[0], -y[1]), pair, T01, rtol=(1e-8, 1e-8), atol=(1e-10, 1e-10))
    assert abs(float(out[1][-1, 1]) - 2 * exact) < 1e-7
    with pytest.raises(ValueError, match=r"`atol` must hold finite numbers >= 0, got -1 at index \(1,\)"):
        odeint(Decay(), y0, T01, atol=torch.tensor([1e-9, -1.0, 1e-9], dtype=F64))
    with pytest.raises(ValueError, match=r"`rtol` must be a finite number >= 0, got -1"):
        odeint(lambda t, y: (-y[0], -y[1]), pair, T01, rtol=(1e-8, -1.0))
    with pytest.raises(ValueError, match=r"`rtol`=0 and `atol`=0 together"):
        odeint(Decay(), y0, T01, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(
    ("method", "options", "at", "evaluation"),
    [
        # torchdiffeq's rk4 (the 3/8 rule) at h = 0.1: steps start at k/10, stages at +0, +h/3, +2h/3, +h; the
        # first time past 0.52 is the second stage of the sixth step, t = 0.5333, evaluation 5·4 + 2
        ("rk4", {"step_size": 0.1}, r"0\.533333", "22"),
        ("dopri5", {}, r"0\.5[2-9]\d*", r"\d+"),
    ],
)
def test_a_field_that_turns_non_finite_midway_is_located(door, method, options, at, evaluation):
    kw = dict(method=method, options=options)
    pattern = rf"the field first returned a non-finite value at t={at}, evaluation {evaluation}\. "
    with pytest.raises(SolverError, match=pattern) as info:
        DOORS[door](BlowsUp(), Y0, **kw)
    assert info.value.reason is Reason.NONFINITE


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_time_is_refused_by_name(door, bad):
    # rk4 steps once to the end time: before the check, [0, inf] returned inf silently (dopri5 ran for ever)
    with pytest.raises(ValueError, match=r"`t` holds a non-finite time \(NaN or inf\): `t\[1\]`=(inf|nan)"):
        DOORS[door](Decay(), Y0, t=[0.0, bad], method="rk4", options={"step_size": 0.5})


@pytest.mark.parametrize("door", DOORS)
def test_a_field_output_of_the_wrong_shape_is_named_with_both_shapes(door):
    who = "`func`" if door == "odeint" else "the field Out"
    state = r"\(3,\)" if door == "odeint" else r"\(1, 3\)"
    with pytest.raises(ValueError, match=rf"{who} returned shape \(2,\) for a state y of shape {state}"):
        DOORS[door](Out(lambda y: torch.ones(2, dtype=F64)), Y0)
    with pytest.raises(TypeError, match=rf"{who} returned tuple; .* must return a tensor of y's shape"):
        DOORS[door](Out(lambda y: (-y,)), Y0)


def test_a_tuple_state_needs_a_tuple_of_its_parts_shapes():
    pair = (torch.ones(3, dtype=F64), torch.ones(2, dtype=F64))
    with pytest.raises(TypeError, match=r"`func` returned Tensor; for a tuple state of 2 tensors"):
        odeint(lambda t, y: -y[0], pair, T01)
    with pytest.raises(ValueError, match=r"`func` returned shape \(3,\) for part 1 of the state, of shape \(2,\)"):
        odeint(lambda t, y: (-y[0], -y[0]), pair, T01)


@pytest.mark.parametrize("door", DOORS)
def test_an_integer_state_is_refused_with_the_cast_that_fixes_it(door):
    with pytest.raises(TypeError, match=r"`y0` must be a floating-point tensor, got torch.int64; call `.float\(\)`"):
        DOORS[door](Decay(), torch.ones(1, 3, dtype=torch.long))


def test_an_event_function_of_the_wrong_kind_is_named():
    y0, t0 = torch.ones(2, dtype=F64), torch.tensor(0.0, dtype=F64)
    fall = lambda t, y: -torch.ones_like(y)  # noqa: E731
    with pytest.raises(TypeError, match=r"`event_fn` returned float; it must return a real tensor"):
        odeint_event(fall, y0, t0, event_fn=lambda t, y: 0.5 - float(t))
    with pytest.raises(ValueError, match=r"`event_fn` returned shape \(0,\)"):
        odeint_event(fall, y0, t0, event_fn=lambda t, y: y[:0])
    with pytest.raises(ValueError, match=r"`event` returned shape \(1, 3\); it must return a real tensor of shape "):
        ODEBlock(Decay(), T=1.0).solve(Y0, event=lambda t, y: y - 0.5)


def test_several_events_at_once_end_at_the_first_as_in_torchdiffeq():
    """torchdiffeq takes an event function of several values as several events, the first to change sign ending
    the solve: ``y' = −1`` from ``(1, 2)`` with ``g = y`` stops at ``t* = y0[0]``, so ``dt*/dy0 = (1, 0)``."""
    y0 = torch.tensor([1.0, 2.0], dtype=F64, requires_grad=True)
    t_event, sol = odeint_event(
        lambda t, y: -torch.ones_like(y), y0, torch.tensor(0.0, dtype=F64), event_fn=lambda t, y: y, atol=1e-12
    )
    assert abs(float(t_event.detach()) - 1.0) < 1e-9
    (grad,) = torch.autograd.grad(t_event, y0)
    torch.testing.assert_close(grad, torch.tensor([1.0, 0.0], dtype=F64), rtol=0, atol=1e-9)


def test_odeint_refuses_a_step_size_with_a_grid_constructor():
    """torchdiffeq takes one of them and ignores the other; here both is refused by name (it was ignored too)."""
    y0, t = torch.ones(2, dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)
    options = dict(step_size=0.1, grid_constructor=lambda f, y, t: torch.linspace(0.0, 1.0, 3, dtype=t.dtype))
    with pytest.raises(ValueError, match="`step_size` and `grid_constructor` are exclusive"):
        odeint(lambda t, y: -y, y0, t, method="rk4", options=options)
