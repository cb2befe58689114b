"""A failure names its cause: the backward solve's non-finite products, a tolerance or a precision the state's
dtype cannot give, a snapshot path that is a directory."""

import math
import re

import pytest
import torch
from torch import nn

from cde_nets import Adjoint, ODEBlock
from cde_nets.solvers.errors import SolverError
from cde_nets.train.trainer import Snapshots, Trainer

K = 0.7


class _Decay(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(-K, dtype=torch.float64))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.w * y


class _NaNSlopeBelowHalf(torch.autograd.Function):
    """The identity, whose vector-Jacobian product is NaN for ``t < 0.5``: a finite forward solve whose adjoint
    goes non-finite on the way back."""

    @staticmethod
    def forward(ctx, y, t):
        ctx.t = float(t)
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return (g * math.nan if ctx.t < 0.5 else g), None


class _BadBackward(_Decay):
    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.w * _NaNSlopeBelowHalf.apply(y, t)


@pytest.mark.parametrize("seminorm", [True, False])
@pytest.mark.parametrize("method", ["dopri5", "bosh3"])
def test_nan_only_in_the_backward_solve_is_named(method, seminorm):
    """It used to read "step size underflow (dt=0)"; the first non-finite product lies below t = 0.5."""
    block = ODEBlock(_BadBackward(), T=1.0, method=method, gradient=Adjoint(seminorm=seminorm))
    y0 = torch.ones(2, 1, dtype=torch.float64, requires_grad=True)
    loss = block(y0).sum()
    assert bool(torch.isfinite(loss))
    with pytest.raises(SolverError, match=r"backward solve turned non-finite: the vector-Jacobian product") as err:
        loss.backward()
    t = float(re.search(r"NaN/inf at t=([0-9.e+-]+)", str(err.value)).group(1))
    assert 0.0 <= t < 0.5
    assert "underflow" not in str(err.value)


@pytest.mark.parametrize("seminorm", [True, False])
def test_a_non_finite_incoming_gradient_is_named_as_the_state(seminorm):
    """A NaN loss gradient makes the adjoint state non-finite from the start: its products are NaN too, but the
    field's derivatives are not to blame."""
    block = ODEBlock(_Decay(), T=1.0, gradient=Adjoint(seminorm=seminorm))
    y = block(torch.ones(2, 1, dtype=torch.float64, requires_grad=True))
    with pytest.raises(SolverError, match=r"the state became non-finite \(NaN/inf\) in the adjoint") as err:
        (y * math.nan).sum().backward()
    assert "vector-Jacobian" not in str(err.value)


@pytest.mark.parametrize(
    ("dtype", "rtol", "eps"),
    [(torch.float64, 1e-20, "1.11e-16"), (torch.float32, 1e-9, "5.96e-08"), (torch.float32, 1e-20, "5.96e-08")],
)
def test_a_tolerance_below_the_dtype_resolution_is_refused(dtype, rtol, eps):
    """float32 with rtol = atol = 1e-20 used to fail as "non-finite value at t=nan" (its error norm overflowed)."""
    block = ODEBlock(_Decay().to(dtype), T=1.0, rtol=rtol, atol=rtol)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        ValueError, match=rf"`rtol`={rtol:g} is below the resolution of the {name} state \(unit roundoff {eps}\)"
    ):
        block(torch.ones(2, 1, dtype=dtype))


def test_an_adjoint_tolerance_below_the_dtype_resolution_is_refused():
    block = ODEBlock(_Decay().float(), T=1.0, rtol=1e-5, atol=1e-5, gradient=Adjoint(rtol=1e-9))
    with pytest.raises(ValueError, match=r"`Adjoint\(rtol=\)`=1e-09 is below the resolution of the float32 state"):
        block(torch.ones(2, 1))


def test_torchdiffeqs_default_tolerance_on_float32_is_allowed():
    """rtol = 1e-7 (torchdiffeq's default) lies above float32's unit roundoff 2^-24 ≈ 5.96e-8: not refused."""
    block = ODEBlock(_Decay().float(), T=1.0, rtol=1e-7, atol=1e-9)
    y = block(torch.ones(2, 1))
    assert abs(y[0, 0].item() - math.exp(-0.7)) < 1e-5


@pytest.mark.parametrize("method", ["dopri5", "bosh3", "alf"])
def test_half_precision_is_refused_by_adaptive_methods(method):
    """Even at rtol = atol = 1e-3 their error norms overflow float16 (it used to end as "t=nan")."""
    block = ODEBlock(_Decay().half(), T=1.0, method=method, rtol=1e-3, atol=1e-3, gradient="backprop")
    with pytest.raises(ValueError, match=rf"method='{method}' does not support float16 states"):
        block(torch.ones(2, 1, dtype=torch.float16))


def test_half_precision_fixed_steps_are_right():
    """rk4 in float16: y(1) = e^(−0.7) to float16's resolution (40 steps of rounding ~5e-4 each at most)."""
    block = ODEBlock(_Decay().half(), T=1.0, method="rk4", step_size=0.1)
    y = block(torch.ones(2, 1, dtype=torch.float16))
    assert y.dtype == torch.float16
    assert torch.allclose(y.double(), torch.full((2, 1), math.exp(-K), dtype=torch.float64), rtol=0, atol=2e-3)


def test_a_snapshot_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"snapshot `path` .* is an existing directory; name a file in it"):
        Snapshots(tmp_path)
    with pytest.raises(ValueError, match=r"is an existing directory"):
        Trainer(snapshots=str(tmp_path), progress=False)


def test_a_snapshot_directory_made_after_the_policy_is_refused_before_training(tmp_path):
    path = tmp_path / "run.pt"
    trainer = Trainer(snapshots=Snapshots(path), progress=False)
    path.mkdir()
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))
    with pytest.raises(ValueError, match=r"is an existing directory"):
        trainer.fit(model, (x, y, None, None), epochs=1, batch_size=4)
    assert torch.equal(model.weight, before)  # no step was taken
