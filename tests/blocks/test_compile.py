"""torch.compile (default backend, inductor) gives eager's numbers in discrete mode: every field, every scheme
family, per-sample stopping and the memory-free momentum backward, outputs and gradients within 1e-5 relative
(float32). torch 2.13's inductor mis-lowers ``torch.add(y, F, alpha=h)`` after a matmul (off by 6 on an H1 net), so
the schemes write ``y + h * F``; this file would catch such a pattern coming back.

Compilation is slow (a C++ compilation per kernel): the nets are small (two layers, tiny batches), compiled once
each, and every assert shares the compiled results. The per-sample stopping net has data-dependent batch sizes
(graph breaks by design).
"""

import os

import pytest
import torch
from torch import nn

from cde_nets import Stop, discretize
from cde_nets.fields import (
    MS1,
    MS2,
    MS3,
    NAIS,
    CubicFriction,
    CubicFrictionConv,
    Hamiltonian,
    NAISConv,
    SecondOrder,
)


class TimeDependent(nn.Module):
    """A plain module ``F(t, y) = cos(t) tanh(W y + b)``: stages must see their own time."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, t, y):
        return torch.cos(t) * torch.tanh(self.lin(y))


# Each net costs 10-20 s of CPU (inductor writes and compiles C++ per kernel), so by default one net per scheme family
# (Runge-Kutta, split, momentum, lags) and per kind of field behaviour (piecewise, separable, learned coefficients,
# block input, plain time-dependent module) plus per-sample stopping; CDE_NETS_COMPILE_ALL=1 adds every other field
# (MS1, MS2, MS3, convolutional friction and NAIS, SecondOrder) and the memory-free backward (all pass).
ALL = os.environ.get("CDE_NETS_COMPILE_ALL") == "1"


def _cases(g):
    """``(name, net, y0, u)``; one layer where the scheme allows (compile time grows with the number of kernels)."""
    one, two = dict(layers=1, generator=g), dict(layers=2, generator=g)
    vec = lambda: torch.randn(3, 4, generator=g) * 0.5  # noqa: E731
    img = lambda: torch.randn(2, 2, 3, 3, generator=g) * 0.5  # noqa: E731
    cases = [
        ("H1 euler", discretize(Hamiltonian(4, **one), "euler"), vec(), None),
        ("H2 verlet", discretize(Hamiltonian(4, K="blockdiag", J="structured", **one), "verlet"), vec(), None),
        (
            "friction momentum",
            discretize(CubicFriction(4, zero_init=False, **one), "momentum", momentum=(0.5, 1.0)),
            vec(),
            None,
        ),
        ("NAIS lm2", discretize(NAIS(4, 3, **two), "lm2"), vec(), torch.randn(3, 3, generator=g)),
        ("plain module rk4", discretize(TimeDependent(), "rk4", T=1.0, steps=1), vec(), None),
    ]
    if ALL:
        cases += [
            ("H1 learned J midpoint", discretize(Hamiltonian(4, J="learned", **two), "midpoint"), vec(), None),
            ("MS1 symplectic_euler_qp", discretize(MS1(4, **two), "symplectic_euler_qp"), vec(), None),
            ("MS2 euler", discretize(MS2(4, **two), "euler"), vec(), None),
            ("MS3 symplectic_euler", discretize(MS3(4, **two), "symplectic_euler"), vec(), None),
            ("friction conv ck", discretize(CubicFrictionConv(2, zero_init=False, **two), "ck"), img(), None),
            ("NAISConv dense", discretize(NAISConv(2, **two), "dense"), img(), torch.randn(2, 2, 3, 3, generator=g)),
            ("SecondOrder momentum", discretize(SecondOrder(2, **two), "momentum"), vec(), None),
        ]
    return cases


def _stopping_cases(g):
    """Per-sample stopping on a projected NAIS field, with a tuple state (and, with CDE_NETS_COMPILE_ALL=1, the
    memory-free momentum backward)."""
    field = NAIS(4, 3, layers=1, T=0.5, eps=0.2, init_std=0.8, generator=g).project_()
    u = torch.randn(4, 3, generator=g) * torch.tensor([[0.01], [0.3], [1.0], [3.0]])
    cases = [
        (
            "NAIS momentum stop",
            discretize(field, "momentum", momentum=(0.5, 1.0), stop=Stop(1e-2, max_depth=30)),
            torch.zeros(4, 4),
            u,
        ),
    ]
    if ALL:
        memory_free = discretize(
            CubicFriction(4, zero_init=False, layers=3, generator=g), "momentum", momentum=(0.8, 1.0), memory_free=True
        )
        cases.append(("friction momentum memory-free", memory_free, torch.randn(3, 4, generator=g), None))
    return cases


class _All(nn.Module):
    """Runs every net of ``cases`` in one forward, so one compilation covers them all."""

    def __init__(self, cases):
        super().__init__()
        self.names = [c[0] for c in cases]
        self.nets = nn.ModuleList(c[1] for c in cases)

    def forward(self, y0s, us):
        return [net(y0) if u is None else net(y0, u) for net, y0, u in zip(self.nets, y0s, us)]


def _run(model, y0s, us):
    """Outputs and the gradients of a fixed projection of them w.r.t. ``y0``, ``u`` and every parameter."""
    model.zero_grad()
    y0s = [y.clone().requires_grad_(True) for y in y0s]
    us = [None if u is None else u.clone().requires_grad_(True) for u in us]
    outs = model(y0s, us)
    loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], [y.grad for y in y0s], [None if u is None else u.grad for u in us], grads


def _close(a, b, what):
    rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert rel < 1e-5, f"{what}: compiled differs from eager by {rel:.2e} (relative)"


@pytest.fixture(scope="module")
def compiled_runs():
    """Each net compiled on its own (one graph each: inductor's time grows faster than linearly with the size of a
    graph, so one graph for all nets takes minutes); every container of a group shares one forward code object, so
    the recompile limit is raised for the duration."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 64
    try:
        results = {}
        for key, make in (("plain", _cases), ("stopping", _stopping_cases)):
            cases = make(torch.Generator().manual_seed(1))
            model = _All(cases)
            y0s, us = [c[2] for c in cases], [c[3] for c in cases]
            eager = _run(model, y0s, us)
            # the stopping net's batch shrinks as samples finish: dynamic shapes compile once, not once per size
            dynamic = key == "stopping"
            compiled = [_run(torch.compile(_All([c]), dynamic=dynamic), [c[2]], [c[3]]) for c in cases]
            compiled = tuple([r[i][0] for r in compiled] for i in range(3)) + (
                {
                    n.replace("_orig_mod.nets.0", f"nets.{j}"): g
                    for j, r in enumerate(compiled)
                    for n, g in r[3].items()
                },
            )
            results[key] = (model.names, eager, compiled)
            if key == "plain":  # one graph per net, forward and backward: compiled, not run eagerly
                assert counters["stats"]["unique_graphs"] == len(cases) and not counters["graph_break"], dict(counters)
    finally:
        torch._dynamo.config.recompile_limit = limit
    return results


@pytest.mark.slow
@pytest.mark.parametrize("key", ["plain", "stopping"])
def test_compiled_discrete_nets_equal_eager(compiled_runs, key):
    names, eager, compiled = compiled_runs[key]
    (out_e, gy_e, gu_e, gp_e), (out_c, gy_c, gu_c, gp_c) = eager, compiled
    for i, name in enumerate(names):
        _close(out_c[i], out_e[i], f"{name}: output")
        _close(gy_c[i], gy_e[i], f"{name}: gradient w.r.t. y0")
        if gu_e[i] is not None:
            _close(gu_c[i], gu_e[i], f"{name}: gradient w.r.t. u")
    assert gp_c.keys() == gp_e.keys() and len(gp_e) > 0
    for n in gp_e:
        _close(gp_c[n], gp_e[n], f"gradient of {n}")


def test_the_stopping_net_stops_at_different_depths():
    """The stopping case above is not vacuous: its samples take different depths."""
    (_, net, y0, u), *_ = _stopping_cases(torch.Generator().manual_seed(1))
    depths = net.solve(y0, u).depths.tolist()
    assert len(set(depths)) == 4 and max(depths) < 30
