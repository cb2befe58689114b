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


@pytest.mark.slow
def test_compiled_flow_equals_eager_and_reports_its_terms():
    """A model around a ContinuousFlow (a logit preprocessing, as FFJORD's) compiles with inductor: the solve runs
    eagerly inside it, so log p, the integrated regularisers and the gradients are eager's, on every call."""
    from cde_nets import ContinuousFlow, integrated_terms

    class Field(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, t, z):
            return torch.tanh(self.lin(z))

    class Density(nn.Module):
        def __init__(self):
            super().__init__()
            self.flow = ContinuousFlow(Field(), trace="hutchinson", regularisers=("kinetic", "jacobian"), rtol=1e-5)

        def forward(self, y):
            x = torch.logit(y)
            return self.flow(x) - (nn.functional.softplus(x) + nn.functional.softplus(-x)).sum(1)

    torch.manual_seed(0)
    model = Density()
    compiled = torch.compile(model)
    y = torch.rand(8, 3) * 0.8 + 0.1
    runs = []
    for m in (compiled, model, compiled):
        model.zero_grad()
        torch.manual_seed(1)  # the same Hutchinson probe
        with integrated_terms() as terms:
            lp = m(y)
        (-lp.mean() + terms["kinetic"] + terms["jacobian"]).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        runs.append((lp.detach(), float(terms["kinetic"].detach()), terms.nfe_forward, grads))
    for run in (runs[0], runs[2]):
        assert _close(run[0], runs[1][0]) and run[1] == pytest.approx(runs[1][1], rel=1e-6) and run[2] == runs[1][2]
        assert all(_close(a, b) for a, b in zip(run[3], runs[1][3]))
