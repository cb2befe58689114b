"""``cde_nets.odeint`` against ``torchdiffeq.odeint``, called the same way: a forward grid and the spiral training
of torchdiffeq's ``examples/ode_demo.py``.

- Forward grid: an MLP field ``tanh(y W₁ᵀ + b₁) W₂ᵀ + b₂`` (width 64), dopri5 at torchdiffeq's defaults
  (rtol 1e-7, atol 1e-9), float32, ``t = linspace(0, 1, 10)``, over state dim {2, 64} × batch {20, 512}: median
  seconds of the forward solve (no graph) and of forward + backward (``gradient`` torchdiffeq's: backprop).
- Spiral: ``y' = (y³) A``, ``A = [[−0.1, 2], [−2, −0.1]]``, ``y(0) = (2, 0)`` on 1000 times in ``[0, 25]``; the
  model ``Linear(2, 50) → tanh → Linear(50, 2)`` on ``y³`` (weights ``N(0, 0.1²)``, biases 0), RMSprop at 1e-3,
  batches of 20 windows of 10 times, the loss ``mean |pred − data|``; 200 iterations from the same seed with each
  ``odeint``, run side by side (one iteration of each in turn): total and median times and the loss curves
  (their largest difference), in float32 (the example's) and float64. Ours runs twice: at its default gradient,
  which differentiates every step size (the derivative of the computed solution), and with
  ``gradient=Backprop(steps="torchdiffeq")``, torchdiffeq's backprop (only the first step size differentiated).
  The fast path computes torchdiffeq's values and, in that setting, its gradients bit for bit
  (:mod:`solvers.steppers.rk_stages`), so those curves are equal, not merely close; the default's gradients differ by
  ``O(tol)`` and its curve drifts from torchdiffeq's as a one-ulp difference would (about 1e-3 in float32 under
  RMSprop).
- The same spiral ported to ``ODEBlock`` (its defaults: rtol 1e-6, atol 1e-8) with each gradient method: time,
  memory saved for backward, losses — the measurement behind the block's default gradient.

Goals: time ratio ours / torchdiffeq ≤ 0.8 forward and forward+backward; losses with torchdiffeq's gradient
equal to 1e-5.
``python -m cde_nets.benchmarks.torchdiffeq_dropin [--tiny]`` writes ``benchmarks/results/torchdiffeq_dropin.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torchdiffeq
from torch import nn

from cde_nets import ODEBlock, odeint
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.solvers.gradients import Backprop

from .common import MLPField, interleaved_medians, write

Odeint = Callable[..., torch.Tensor]
# the spiral race: ours at its default gradient, ours with torchdiffeq's backprop, torchdiffeq
IMPLS: dict[str, Odeint] = {
    "ours": odeint,
    "ours_torchdiffeq_steps": partial(odeint, gradient=Backprop(steps="torchdiffeq")),
    "torchdiffeq": torchdiffeq.odeint,
}


def _fwd(impl: Odeint, f: nn.Module, y0: torch.Tensor, t: torch.Tensor) -> Callable[[], object]:
    def go():
        with torch.no_grad():
            return impl(f, y0, t)

    return go


def _fwd_bwd(impl: Odeint, f: nn.Module, y0: torch.Tensor, t: torch.Tensor) -> Callable[[], object]:
    def go():
        f.zero_grad()
        impl(f, y0, t).square().mean().backward()

    return go


def _grid(tiny: bool) -> list[dict]:
    rows = []
    cases = [(2, 20)] if tiny else [(2, 20), (2, 512), (64, 20), (64, 512)]
    for dim, batch in cases:
        torch.manual_seed(0)
        f = MLPField(dim)
        y0 = torch.randn(batch, dim)
        t = torch.linspace(0.0, 1.0, 10)

        repeat = 3 if tiny else 31
        for mode, make in (("forward", _fwd), ("forward+backward", _fwd_bwd)):
            calls = [make(impl, f, y0, t) for impl in (odeint, torchdiffeq.odeint)]
            ours, theirs = interleaved_medians(calls, repeat=repeat, warmup=1)
            with torch.no_grad():
                diff = float((odeint(f, y0, t) - torchdiffeq.odeint(f, y0, t)).abs().max())
            rows.append(
                dict(
                    dim=dim,
                    batch=batch,
                    mode=mode,
                    ours_s=ours,
                    torchdiffeq_s=theirs,
                    ratio=ours / theirs,
                    max_abs_diff=diff,
                )
            )
    return rows


class SpiralField(nn.Module):
    """torchdiffeq's ode_demo field: ``dy/dt = net(y³)``, an MLP 2-50-2 with weights N(0, 0.1²)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 50), nn.Tanh(), nn.Linear(50, 2))
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.1)
                nn.init.zeros_(m.bias)

    def forward(self, t, y):
        return self.net(y**3)


_A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]])


def _spiral(impl: Odeint, dtype: torch.dtype, data_size: int = 1000, window: int = 10, batch: int = 20):
    """One training iteration of ode_demo with ``impl`` per call (its own data, model, optimiser and sampler,
    from the same seeds): returns the loss."""
    t = torch.linspace(0.0, 25.0, data_size, dtype=dtype)
    with torch.no_grad():
        data = impl(lambda t, y: (y**3) @ _A.to(dtype), torch.tensor([[2.0, 0.0]], dtype=dtype), t, method="dopri5")
    return spiral_iteration(impl, data, t, window, batch, dtype)


def spiral_iteration(
    impl: Odeint, data: torch.Tensor, t: torch.Tensor, window: int, batch: int, dtype: torch.dtype = torch.float32
) -> Callable[[], float]:
    """ode_demo's training iteration on ``data`` (the true trajectory at the times ``t``): a minibatch of
    ``batch`` windows of ``window`` times, the mean absolute error of ``impl``'s solve from their starts, one
    RMSprop step (lr 1e-3); model, optimiser and sampler from the same seeds for every ``impl``. Returns the
    loss."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = SpiralField().to(dtype)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)

    def iteration() -> float:
        s = torch.from_numpy(rng.choice(np.arange(len(t) - window), batch, replace=False))
        y0, ys = data[s], torch.stack([data[s + i] for i in range(window)])
        opt.zero_grad()
        loss = (impl(model, y0, t[:window]) - ys).abs().mean()
        loss.backward()
        opt.step()
        return loss.item()

    return iteration


def _spiral_race(iters: int, dtype: torch.dtype) -> dict:
    """The three trainings side by side, one iteration of each in turn (ours, ours with torchdiffeq's steps,
    torchdiffeq, ours, ...): total and median times and each of ours' loss curve's largest difference from
    torchdiffeq's; the top-level keys are the default's, ``torchdiffeq_steps`` holds the same keys for
    ``gradient=Backprop(steps="torchdiffeq")``."""
    runs = {name: _spiral(impl, dtype) for name, impl in IMPLS.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(iters):
        for name, iteration in runs.items():
            start = time.perf_counter()
            losses[name].append(iteration())
            times[name].append(time.perf_counter() - start)

    def against_torchdiffeq(name: str) -> dict:
        ours, theirs = losses[name], losses["torchdiffeq"]
        diffs = [abs(a - b) for a, b in zip(ours, theirs)]
        return dict(
            ours_s=sum(times[name]),
            ratio=sum(times[name]) / sum(times["torchdiffeq"]),
            median_iteration_ratio=float(np.median(times[name]) / np.median(times["torchdiffeq"])),
            max_loss_diff=max(diffs),
            losses_equal=ours == theirs,
            first_loss_diff=diffs[0],
            final_loss_ours=ours[-1],
        )

    return dict(
        iterations=iters,
        torchdiffeq_s=sum(times["torchdiffeq"]),
        final_loss_torchdiffeq=losses["torchdiffeq"][-1],
        **against_torchdiffeq("ours"),
        torchdiffeq_steps=against_torchdiffeq("ours_torchdiffeq_steps"),
    )


def _block_port(gradient: str, iters: int, data_size: int = 1000, window: int = 10, batch: int = 20) -> dict:
    """The spiral ported to ``ODEBlock`` at its own defaults (dopri5, rtol 1e-6, atol 1e-8) with ``gradient``:
    training time, bytes saved for backward in one iteration, the last 20 losses' mean, and the whole
    trajectory's error ``mean |pred − data|`` from ``y(0)`` after training (ode_demo's test loss)."""
    t = torch.linspace(0.0, 25.0, data_size)
    with torch.no_grad():
        data = odeint(lambda t, y: (y**3) @ _A, torch.tensor([[2.0, 0.0]]), t)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = SpiralField()
    block = ODEBlock(model, T=float(t[window - 1]), gradient=gradient)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    losses, peak = [], 0
    start = time.perf_counter()
    for it in range(iters):
        s = torch.from_numpy(rng.choice(np.arange(data_size - window), batch, replace=False))
        y0, ys = data[s], torch.stack([data[s + i] for i in range(window)])
        opt.zero_grad()
        mem = SavedTensorMemory(exclude=[*model.parameters(), y0])
        with mem if it == 0 else contextlib.nullcontext():
            loss = (block.solve(y0, t=t[:window]).ys - ys).abs().mean()
        peak = max(peak, mem.peak_bytes)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        test = (odeint(model, data[0], t) - data).abs().mean().item()
    return dict(
        gradient=gradient,
        time_s=elapsed,
        saved_bytes_first_iteration=peak,
        last20_loss=float(np.mean(losses[-20:])),
        trajectory_loss=test,
    )


def run(tiny: bool = False, out_dir=None) -> dict:
    torch.set_num_threads(1)
    rows = _grid(tiny)
    iters = 3 if tiny else 200
    spiral = {str(dtype).removeprefix("torch."): _spiral_race(iters, dtype) for dtype in (torch.float32, torch.float64)}
    port = [_block_port(g, iters) for g in ("adjoint", "backprop", "checkpoint", "symplectic")]
    res = dict(
        block_port=port,
        load_average=os.getloadavg(),
        setting="MLP width 64, dopri5 rtol 1e-7 atol 1e-9, float32, one thread; ode_demo spiral, 200 iterations, "
        "ours at its default gradient (every step size differentiated) and with Backprop(steps='torchdiffeq') "
        "(spiral[dtype]['torchdiffeq_steps'])",
        goal="ratio <= 0.8 forward and forward+backward; losses with Backprop(steps='torchdiffeq') equal to 1e-5",
        rows=rows,
        spiral=spiral,
    )
    write("torchdiffeq_dropin_tiny" if tiny else "torchdiffeq_dropin", res, out_dir)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    res = run(tiny=parser.parse_args().tiny)
    for r in res["rows"]:
        print(f"dim {r['dim']:3d} batch {r['batch']:4d} {r['mode']:17s} ours/torchdiffeq {r['ratio']:.3f}")
    for r in res["block_port"]:
        print(
            f"ODEBlock port, {r['gradient']:10s}: {r['time_s']:.1f} s, "
            f"{r['saved_bytes_first_iteration'] / 1024:.0f} KiB, "
            f"last-20 loss {r['last20_loss']:.4f}, trajectory loss {r['trajectory_loss']:.4f}"
        )
    for dtype, s in res["spiral"].items():
        for label, r in (("default", s), ("steps='torchdiffeq'", s["torchdiffeq_steps"])):
            print(
                f"spiral {dtype} {s['iterations']} it, {label}: ours/torchdiffeq {r['ratio']:.3f} (median "
                f"iteration {r['median_iteration_ratio']:.3f}), max |Δloss| {r['max_loss_diff']:.2e}"
            )


if __name__ == "__main__":
    main()
