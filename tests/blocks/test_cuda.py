"""On a CUDA device every model gives the CPU's numbers and every tensor the library makes stays on the device.

Each run is built once in float64 on the CPU and deep-copied to ``cuda``; both copies take the same input and
backward pass. The outputs and every parameter's gradient agree to 1e-9 (relative, float64: only the summation
order of the device's kernels differs), the output and the gradients live on the device, and a TorchFunctionMode
records every floating-point tensor a factory function makes during the device's forward and backward: none with at
least one state's worth of entries may land on the CPU (tiny float64 time grids may, as the dtype test allows).
The whole file is skipped where no CUDA device is present (CI's machines); it runs on a lent GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from factory_record import Record
from torch import nn

from cde_nets import ContinuousFlow, ODEBlock, SDEBlock, Stop, discretize, odeint
from cde_nets.fields import NAIS, CubicFriction, Hamiltonian, SecondOrder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BATCH, DIM = 7, 4
CUDA = torch.device("cuda")


def _on_host(made):
    return [
        (name, device, shape)
        for name, _, device, shape in made
        if device.type == "cpu" and (len(shape) > 1 or (shape or (1,))[0] >= BATCH * DIM)
    ]


class TimeMLP(nn.Module):
    def __init__(self, dim: int = 2, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 1, hidden), nn.Tanh(), nn.Linear(hidden, dim))

    def forward(self, t, z):
        return self.net(torch.cat([z, t.expand(z.shape[0], 1)], 1))


class DropIn(nn.Module):
    """torchdiffeq's call on a tuple state through ``cde_nets.odeint``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, y):
        t = torch.linspace(0.0, 1.0, 3, dtype=y.dtype, device=y.device)
        f = lambda t, s: (torch.tanh(self.lin(s[0])), -s[1] * s[0].pow(2).sum(1, keepdim=True))  # noqa: E731
        z, w = odeint(f, (y, torch.ones(len(y), 1, dtype=y.dtype, device=y.device)), t, rtol=1e-8, atol=1e-10)
        return torch.cat([z[-1], w[-1]], 1)


class LogProb(nn.Module):
    def __init__(self, trace: str):
        super().__init__()
        self.flow = ContinuousFlow(TimeMLP(DIM), T=1.0, trace=trace, rtol=1e-8, atol=1e-10)

    def forward(self, x):
        gen = torch.Generator(device=x.device).manual_seed(0)
        return self.flow.log_prob(x, generator=gen)


def _runs():
    torch.manual_seed(0)
    ham = lambda: Hamiltonian(DIM, layers=3)  # noqa: E731
    y = torch.randn(BATCH, DIM)
    u = torch.randn(BATCH, 2)
    tight = dict(rtol=1e-9, atol=1e-11)
    runs = [
        ("dopri5 default", ODEBlock(ham(), **tight), (y,)),
        ("dopri5 adjoint", ODEBlock(ham(), gradient="adjoint", **tight), (y,)),
        ("dopri5 backprop", ODEBlock(ham(), gradient="backprop", **tight), (y,)),
        ("dopri5 symplectic adjoint", ODEBlock(ham(), gradient="symplectic", **tight), (y,)),
        ("per-sample steps", ODEBlock(ham(), controller="per_sample", gradient="backprop", **tight), (y,)),
        ("gl4 continuous", ODEBlock(ham(), method="gl4", step_size=0.05), (y,)),
        ("stopping", ODEBlock(ham(), stop=Stop(eps=0.5), **tight), (y,)),
        ("nais with input", ODEBlock(NAIS(DIM, 2), **tight), (y, u)),
        ("cubic friction", ODEBlock(CubicFriction(DIM, layers=3), **tight), (y,)),
        ("second order", ODEBlock(SecondOrder(DIM // 2, layers=2), **tight), (y,)),
        ("euler net", discretize(ham(), "euler"), (y,)),
        ("yoshida4 net", discretize(Hamiltonian(DIM, layers=3, K="blockdiag", J="structured"), "yoshida4"), (y,)),
        ("gl4 net", discretize(ham(), "gl4"), (y,)),
        ("momentum net", discretize(CubicFriction(DIM, layers=3), "momentum"), (y,)),
        ("stopping net", discretize(ham(), "euler", stop=Stop(eps=1e-3, max_depth=5)), (y,)),
        ("odeint tuple state", DropIn(), (y,)),
        ("flow, exact trace", LogProb("exact"), (y,)),
    ]
    return [(name, block.double(), tuple(a.double() for a in args)) for name, block, args in runs]


RUNS = _runs()


def _forward_backward(block, args):
    args = tuple(a.clone().requires_grad_(True) for a in args)
    out = block(*args)
    (out * torch.linspace(1.0, 2.0, out.shape[-1], dtype=out.dtype, device=out.device)).sum().backward()
    grads = [p.grad for p in block.parameters() if p.grad is not None] + [a.grad for a in args]
    return out, grads


@pytest.mark.parametrize(("name", "block", "args"), RUNS, ids=[r[0] for r in RUNS])
def test_device_gives_the_cpu_numbers_and_stays_on_the_device(name, block, args):
    host = copy.deepcopy(block)
    device = copy.deepcopy(block).to(CUDA)
    out_h, grads_h = _forward_backward(host, args)
    rec = Record()
    with rec:
        out_d, grads_d = _forward_backward(device, tuple(a.to(CUDA) for a in args))
    assert out_d.device.type == CUDA.type and out_d.dtype == torch.float64
    torch.testing.assert_close(out_d.cpu(), out_h, rtol=1e-9, atol=1e-10)
    assert len(grads_d) == len(grads_h) > 0
    for gd, gh in zip(grads_d, grads_h):
        assert gd.device.type == CUDA.type
        torch.testing.assert_close(gd.cpu(), gh, rtol=1e-8, atol=1e-10)
    assert not _on_host(rec.made), _on_host(rec.made)[:5]


def test_hutchinson_on_the_device_is_unbiased_and_reproducible():
    """The device draws its own probes (a CUDA generator's stream differs from the CPU's), so the estimate is
    checked against the exact trace instead: 2048 copies of one point, each with its own probe, average to the exact
    log p within 3 standard errors, and the same generator seed gives the same numbers."""
    torch.manual_seed(0)
    exact = LogProb("exact").double().to(CUDA)
    hutch = LogProb("hutchinson").double().to(CUDA)
    hutch.load_state_dict(exact.state_dict())
    x = torch.randn(1, DIM, dtype=torch.float64, device=CUDA).expand(2048, DIM)
    with torch.no_grad():
        ref = exact(x[:1])
        est = hutch(x)
        again = hutch(x)
    assert est.device.type == CUDA.type
    torch.testing.assert_close(est, again, rtol=0, atol=0)
    se = est.std() / len(est) ** 0.5
    assert se > 0 and abs(est.mean() - ref[0]) < 3 * se


def test_sde_block_runs_on_the_device_in_float32():
    torch.manual_seed(0)
    block = SDEBlock(Hamiltonian(DIM, layers=3), noise="diagonal", seed=0).to(CUDA)
    y = torch.randn(BATCH, DIM, device=CUDA, requires_grad=True)
    rec = Record()
    with rec:
        out = block(y)
        out.sum().backward()
    assert out.device.type == CUDA.type and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert y.grad is not None and y.grad.device.type == CUDA.type
    assert not _on_host(rec.made), _on_host(rec.made)[:5]


def test_float32_and_half_modules_follow_the_input_on_the_device():
    torch.manual_seed(0)
    block = ODEBlock(Hamiltonian(DIM, layers=3), rtol=1e-4, atol=1e-6).to(CUDA)
    y = torch.randn(BATCH, DIM, device=CUDA)
    out32 = block(y)
    assert out32.device.type == CUDA.type and out32.dtype == torch.float32
    net = discretize(Hamiltonian(DIM, layers=3), "euler").to(CUDA)
    ref = net(y)
    half = copy.deepcopy(net).half()(y.half())
    assert half.dtype == torch.float16 and half.device.type == CUDA.type
    torch.testing.assert_close(half.float(), ref, rtol=2e-2, atol=2e-2)


def test_a_grid_constructor_serves_times_on_the_device():
    """A grid made on the host (float64) and cut to device times: the fixed-step solve runs on the device and
    equals the same solve on the CPU (the grid was compared with the device's times across devices)."""
    from cde_nets.solvers.grids import grid_constructor

    torch.manual_seed(0)
    f = nn.Linear(2, 2).double()
    y0 = torch.randn(4, 2, dtype=torch.float64)
    grid = torch.linspace(0.0, 1.0, 11, dtype=torch.float64)
    opts = {"grid_constructor": grid_constructor(grid)}
    t = torch.tensor([0.0, 0.35, 1.0], dtype=torch.float64)
    cpu = odeint(lambda s, y: f(y), y0, t, method="rk4", options=opts)
    g = copy.deepcopy(f).to(CUDA)
    dev = odeint(lambda s, y: g(y), y0.to(CUDA), t.to(CUDA), method="rk4", options=opts)
    assert dev.device.type == "cuda"
    torch.testing.assert_close(dev.cpu(), cpu, rtol=1e-12, atol=1e-14)
