"""``torch.compile`` of a model holding continuous blocks gives eager's outputs and gradients (float32, 1e-5
relative): the solver loops run eagerly inside the compiled model, everything around them is compiled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, SDEBlock, Stop
from cde_nets.fields import NAIS, CubicFriction, Hamiltonian, SecondOrder

FIELDS = {
    "hamiltonian": lambda: Hamiltonian(4, layers=3),
    "cubic_friction": lambda: CubicFriction(4, layers=2),
    "second_order": lambda: SecondOrder(2, layers=2),
}
MODES = {
    "rk4": dict(method="rk4", step_size=0.1, gradient="backprop"),
    "dopri5-backprop": dict(rtol=1e-5, atol=1e-6, gradient="backprop"),
    "dopri5-adjoint": dict(rtol=1e-5, atol=1e-6, gradient="adjoint"),
    "stopping": dict(rtol=1e-5, atol=1e-6, stop=Stop(eps=0.5)),
}


def _run(model: nn.Module, *args: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    out = model(*args)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(FIELDS))
def test_compiled_continuous_model_equals_eager(name, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ODEBlock(FIELDS[name](), **MODES[mode]), nn.Tanh())
    x = torch.randn(8, 4)
    out_c, g_c = _run(torch.compile(model), x)
    out_e, g_e = _run(model, x)
    assert _close(out_c, out_e)
    assert all(_close(a, b) for a, b in zip(g_c, g_e))


class _WithInput(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.embed, self.block = nn.Linear(2, 3), block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.embed(x)
        return self.block(torch.zeros_like(u), u=u)


@pytest.mark.parametrize("gradient", ["adjoint", "backprop"])
def test_compiled_nais_and_sde_blocks_equal_eager(gradient):
    torch.manual_seed(0)
    x = torch.randn(6, 2)
    for block in (
        ODEBlock(NAIS(3, 3, layers=2), rtol=1e-5, atol=1e-6, gradient=gradient),
        SDEBlock(NAIS(3, 3, layers=2), noise="additive", seed=4, step_size=0.25, gradient=gradient),
    ):
        model = _WithInput(block)
        compiled = torch.compile(model)
        if isinstance(block, SDEBlock):
            block.reseed()
        out_c, g_c = _run(compiled, x)
        if isinstance(block, SDEBlock):
            block.reseed()  # the same Brownian path for the eager call
        out_e, g_e = _run(model, x)
        assert _close(out_c, out_e)
        assert all(_close(a, b) for a, b in zip(g_c, g_e))
