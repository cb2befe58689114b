"""Every tensor the library creates follows the input's dtype: float64 inputs under a float32 default and float32
inputs under a float64 default. A TorchFunctionMode records the dtype of every tensor made by a factory function
(zeros, ones, empty, full, tensor, eye, arange, linspace, rand*) with at least one sample's worth of entries; time
grids are float64 by design (they are compared with piece boundaries) and are allowed only when tiny (<= 1-D,
fewer entries than the batch of 7 state rows × state size)."""

from __future__ import annotations

import pytest
import torch
from factory_record import Record

from cde_nets import ODEBlock, SDEBlock, Stop, discretize
from cde_nets.fields import NAIS, CubicFriction, Hamiltonian

BATCH, DIM = 7, 4


def _runs(dtype: torch.dtype):
    """``(name, block, args)``: the modules are built (under the default dtype) and converted before recording."""

    def ham():
        return Hamiltonian(DIM, layers=3).to(dtype)

    def friction():
        return CubicFriction(DIM, layers=3).to(dtype)

    y0 = torch.randn(BATCH, DIM).to(dtype)
    u = torch.randn(BATCH, 2).to(dtype)
    return [
        ("dopri5 adjoint", ODEBlock(ham(), rtol=1e-4, atol=1e-6), (y0,)),
        ("rk4 backprop", ODEBlock(ham(), method="rk4", gradient="backprop"), (y0,)),
        ("checkpoint", ODEBlock(ham(), rtol=1e-4, atol=1e-6, gradient="checkpoint"), (y0,)),
        ("stopping", ODEBlock(ham(), rtol=1e-4, atol=1e-6, stop=Stop(eps=0.5)), (y0,)),
        ("nais u", ODEBlock(NAIS(DIM, 2).to(dtype), rtol=1e-4, atol=1e-6), (y0, u)),
        ("sde", SDEBlock(ham(), noise="diagonal", seed=0).to(dtype), (y0,)),
        ("euler net", discretize(ham(), "euler"), (y0,)),
        ("momentum net", discretize(friction(), "momentum").to(dtype), (y0,)),
        ("lm2 net", discretize(friction(), "lm2").to(dtype), (y0,)),
        ("stopping net", discretize(ham(), "euler", stop=Stop(eps=1e-3, max_depth=5)), (y0,)),
    ]


def _wrong(made, dtype):
    return [
        (name, dt, shape)
        for name, dt, _, shape in made
        if dt != dtype and not (dt == torch.float64 and len(shape) <= 1 and (shape or (1,))[0] < BATCH * DIM)
    ]


@pytest.mark.parametrize(
    ("default", "dtype"),
    [(torch.float32, torch.float64), (torch.float64, torch.float32)],
    ids=["float64-under-float32-default", "float32-under-float64-default"],
)
def test_created_tensors_follow_the_input_dtype(default, dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        torch.manual_seed(0)
        for name, block, args in _runs(dtype):
            rec = Record()
            with rec:
                out = block(*args)
                out.sum().backward()
            assert out.dtype == dtype, name
            assert not _wrong(rec.made, dtype), (name, _wrong(rec.made, dtype)[:5])
    finally:
        torch.set_default_dtype(old)
