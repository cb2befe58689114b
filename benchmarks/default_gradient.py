"""The measurement behind ``ODEBlock``'s default gradient: ``Backprop()``, ``Checkpoint()`` and ``Adjoint()``
through the block, from the ode_demo spiral to a convolutional field.

Cases (float32, one gradient of ``mean y(T)²`` — the spiral: ``mean |ys − data|`` over its 10 output times —
with respect to the field's parameters):

- ``spiral``: torchdiffeq's ``examples/ode_demo.py`` model, ``Linear(2, 50) → tanh → Linear(50, 2)`` on ``y³``,
  20 windows of 10 times over ``[0, 0.225]``;
- ``small``: an MLP ``2 → 64 → 2`` (tanh), batch 512, ``T = 1``;
- ``medium``: an MLP ``64 → 256 → 64``, batch 256;
- ``large``: a convolutional field ``conv3x3(16 → 16) → tanh → conv3x3(16 → 16)`` on 16 × 28 × 28 maps,
  batch 64 (each state 3.2 MB).

Each at ``dopri5`` (``rtol = atol = 1e-6``) and at ``rk4`` with ``step_size = T / 10`` (the spiral steps through
its output times as well: 18 steps). Time: CPU time (``time.process_time``) of forward + backward, one thread,
the three gradients interleaved (backprop, checkpoint, adjoint, backprop, ...), medians; the ratios to backprop
are what the run measures, since the machine is shared. Memory: the peak bytes of tensors saved for backward
over the forward *and* the backward pass (:class:`~cde_nets.diagnostics.SavedTensorMemory`; parameters and
inputs excluded), so the checkpoint's replayed step and the adjoint's vector-Jacobian products count as well as
the forward's graph.
``graph_bytes_per_state_eval``: backprop's saved bytes over (field evaluations × state bytes), the field's
graph per evaluation in units of the state, which the default's rule
(:func:`~cde_nets.solvers.gradients.default_gradient`) leaves out: it reads shapes only; ``default``: the
gradient that rule picks for the row.

``python -m cde_nets.benchmarks.default_gradient [--tiny]`` writes ``benchmarks/results/default_gradient.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from cde_nets import ODEBlock
from cde_nets.diagnostics import SavedTensorMemory

from .common import MLPField, interleaved_medians, write
from .torchdiffeq_dropin import SpiralField

GRADIENTS = ("backprop", "checkpoint", "adjoint")
SOLVERS = {"dopri5": dict(method="dopri5", rtol=1e-6, atol=1e-6), "rk4": dict(method="rk4")}


class _Conv(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1), nn.Tanh(), nn.Conv2d(channels, channels, 3, padding=1)
        )

    def forward(self, t, y):
        return self.net(y)


def _spiral_data(batch: int, size: int, window: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ode_demo's data: ``y' = (y³) A`` from ``(2, 0)`` on the first ``size`` of its 1000 times over [0, 25];
    ``batch`` windows of ``window`` times."""
    from cde_nets import odeint

    a = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]])
    t = torch.linspace(0.0, 25.0, 1000)[:size]
    with torch.no_grad():
        data = odeint(lambda t, y: (y**3) @ a, torch.tensor([[2.0, 0.0]]), t)[:, 0]
    g = torch.Generator().manual_seed(0)
    s = torch.randperm(size - window, generator=g)[:batch]
    return data[s], torch.stack([data[s + i] for i in range(window)]), t[:window]


def _cases(tiny: bool) -> dict[str, Callable[[], tuple[nn.Module, torch.Tensor, float]]]:
    def mlp(dim: int, width: int, batch: int) -> Callable[[], tuple[nn.Module, torch.Tensor, float]]:
        def make():
            torch.manual_seed(0)
            return MLPField(dim, width), torch.randn(batch, dim), 1.0

        return make

    def conv(channels: int, side: int, batch: int) -> Callable[[], tuple[nn.Module, torch.Tensor, float]]:
        def make():
            torch.manual_seed(0)
            return _Conv(channels), torch.randn(batch, channels, side, side), 1.0

        return make

    def spiral() -> tuple[nn.Module, torch.Tensor, float]:
        torch.manual_seed(0)
        return SpiralField(), torch.empty(0), float(torch.linspace(0.0, 25.0, 1000)[9])

    if tiny:
        return {"spiral": spiral, "large": conv(2, 6, 2)}
    return {"spiral": spiral, "small": mlp(2, 64, 512), "medium": mlp(64, 256, 256), "large": conv(16, 28, 64)}


def _measure(case: str, make, solver: str, tiny: bool) -> dict:
    field, y0, T = make()
    params = list(field.parameters())
    kw = dict(SOLVERS[solver])
    if solver == "rk4":
        kw["step_size"] = T / (2 if tiny else 10)
    blocks = {g: ODEBlock(field, T=T, gradient=g, **kw) for g in GRADIENTS}
    t = None
    if case == "spiral":
        y0, ys, t = _spiral_data(4, 20) if tiny else _spiral_data(20, 1000)

        def loss(block: ODEBlock):
            return block.solve(y0, t=t).ys.sub(ys).abs().mean()
    else:

        def loss(block: ODEBlock):
            return block(y0).square().mean()

    def step(block: ODEBlock) -> list[torch.Tensor]:
        return list(torch.autograd.grad(loss(block), params))

    row: dict = {
        "case": case,
        "solver": solver,
        "state_bytes": y0.numel() * y0.element_size(),
        "batch": y0.shape[0],
        "default": ODEBlock(field, T=T, **kw).gradient_for(y0, t).name,
    }
    grads = {}
    for g, block in blocks.items():
        mem = SavedTensorMemory(exclude=[*params, y0])
        with mem:
            sol = block.solve(y0, t=t)
            out = sol.ys.sub(ys).abs().mean() if case == "spiral" else sol.y.square().mean()
            grads[g] = torch.autograd.grad(out, params)
        row[f"{g}_peak_bytes"] = mem.peak_bytes
        row[f"{g}_nfe_forward"] = sol.stats["nfe_forward"]
        row[f"{g}_nfe_backward"] = sol.stats["nfe_backward"]
        if g == "backprop":
            row["steps"] = sol.stats["steps_forward"]
            row["rejected"] = sol.stats["rejected_forward"]
    ref = torch.cat([x.reshape(-1) for x in grads["backprop"]])
    for g in GRADIENTS[1:]:
        diff = torch.cat([x.reshape(-1) for x in grads[g]]) - ref
        row[f"{g}_rel_diff_from_backprop"] = float(diff.norm() / ref.norm())
    nfe = row["backprop_nfe_forward"]
    row["graph_bytes_per_state_eval"] = row["backprop_peak_bytes"] / (nfe * row["state_bytes"])
    big = case == "large"
    times = interleaved_medians(
        [lambda b=b: step(b) for b in blocks.values()],
        repeat=1 if tiny else (7 if big else 15),
        warmup=0 if tiny else 1,
        number=1 if tiny or big else 3,
        clock=time.process_time,
    )
    for g, s in zip(GRADIENTS, times):
        row[f"{g}_s"] = s
        row[f"{g}_over_backprop"] = s / times[0]
        row[f"{g}_memory_over_backprop"] = row[f"{g}_peak_bytes"] / row["backprop_peak_bytes"]
    return row


def run(tiny: bool = False, out_dir=None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        # tiny: each code path once (the spiral's output times at dopri5, a convolution at rk4)
        pairs = [("spiral", "dopri5"), ("large", "rk4")] if tiny else [(c, s) for c in _cases(False) for s in SOLVERS]
        cases = _cases(tiny)
        rows = [_measure(case, cases[case], solver, tiny) for case, solver in pairs]
        payload = {
            "setting": "ODEBlock, float32, one gradient with respect to the parameters; dopri5 rtol = atol = 1e-6, "
            "rk4 ten steps; CPU-time medians of interleaved backprop / checkpoint / adjoint, one thread; memory = "
            "peak bytes saved for backward over forward and backward (SavedTensorMemory)",
            "rows": rows,
            "load_average": os.getloadavg(),
            "time_s": time.perf_counter() - start,
        }
        write("default_gradient", payload, out_dir)
    finally:
        torch.set_num_threads(threads)
    return payload


def _kib(b: float) -> str:
    return f"{b / 1024:.0f} KiB" if b < 2**20 else f"{b / 2**20:.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print(
        "| case | solver | default | steps | backprop ms | checkpoint / backprop | adjoint / backprop | "
        "backprop memory | checkpoint memory | adjoint memory | graph per eval / state |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['case']} | {r['solver']} | {r['default']} | {r['steps']} | {1e3 * r['backprop_s']:.1f} | "
            f"{r['checkpoint_over_backprop']:.2f} | {r['adjoint_over_backprop']:.2f} | "
            f"{_kib(r['backprop_peak_bytes'])} | {_kib(r['checkpoint_peak_bytes'])} | "
            f"{_kib(r['adjoint_peak_bytes'])} | {r['graph_bytes_per_state_eval']:.1f} |"
        )
    print(f"{res['time_s']:.0f} s; load average {res['load_average']}")


if __name__ == "__main__":
    main()
