"""A field whose output is not the state's shape is refused on the first evaluation, in every mode, by name."""

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, SDEBlock, SDESettings, discretize


class WrongWidth(nn.Module):
    """F(t, y) with 3 outputs for a 2-dimensional state."""

    def __init__(self, out: int = 3):
        super().__init__()
        self.lin = nn.Linear(2, out)

    def forward(self, t, y):
        return self.lin(y)


class OneRow(nn.Module):
    """F(t, y) of shape (1, 2): it would broadcast over the batch into a silently wrong answer."""

    def forward(self, t, y):
        return y[:1]


y0 = torch.randn(5, 2)
MODES = {
    "adaptive": lambda f: ODEBlock(f, T=1.0)(y0),
    "adaptive backprop": lambda f: ODEBlock(f, T=1.0, gradient="backprop")(y0),
    "adaptive adjoint": lambda f: ODEBlock(f, T=1.0)(y0.clone().requires_grad_()),
    "fixed": lambda f: ODEBlock(f, T=1.0, method="rk4", step_size=0.25)(y0),
    "checkpoint": lambda f: ODEBlock(f, T=1.0, gradient="checkpoint")(y0.clone().requires_grad_()),
    "alf": lambda f: ODEBlock(f, T=1.0, method="alf", gradient="reversible")(y0),
    "event": lambda f: ODEBlock(f, T=1.0).solve(y0, event=lambda t, y: y[:, 0] - 10.0),
    "t_end": lambda f: ODEBlock(f, T=1.0).solve(y0, t_end=torch.full((5,), 0.5)),
    "discrete": lambda f: discretize(f, "euler", T=1.0, steps=4)(y0),
    "sde": lambda f: SDEBlock(f, T=1.0, step_size=0.25, settings=SDESettings(channels=2))(y0),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("field", [WrongWidth, OneRow])
def test_wrong_output_shape_is_named(mode, field):
    with pytest.raises(
        ValueError,
        match=rf"the field {field.__name__} returned shape \((5|1), (3|2)\) for a state y "
        r"of shape \(5, 2\); F\(t, y\) must return y's shape \(5, 2\)",
    ):
        MODES[mode](field())


def test_non_tensor_output_is_named():
    class Pair(nn.Module):
        def forward(self, t, y):
            return y, y

    with pytest.raises(TypeError, match="the field Pair returned tuple; F"):
        ODEBlock(Pair(), T=1.0)(y0)


def test_right_shape_still_solves_exactly():
    class Linear(nn.Module):
        def forward(self, t, y):
            return -y

    y = torch.randn(3, 2, dtype=torch.float64)
    out = ODEBlock(Linear(), T=1.0, rtol=1e-10, atol=1e-12)(y)
    torch.testing.assert_close(out, y * torch.exp(torch.tensor(-1.0, dtype=torch.float64)), rtol=1e-8, atol=1e-10)
