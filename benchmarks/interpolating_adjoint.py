"""The interpolating adjoint (``gradient="interpolating"``) against the other gradient methods: memory by the number
of steps, time on an MLP field, and the gradient's error on a stiff Van der Pol batch where the backsolve adjoint
fails.

- memory: the bytes saved for backward (:class:`cde_nets.diagnostics.SavedTensorMemory`) by an rk4 solve of
  ``N`` steps, MLP field 4 → 32 → 4, batch 16: the plain variant keeps the cubic Hermite coefficients of every
  step (4 states a step), ``checkpoints=True`` one state a step, ``checkpoints=k`` one every ``k`` steps; the
  slope in bytes per step is fitted;
- time: one gradient of the parameters and ``y0``, MLP field 2 → 64 → 2, batch 64, dopri5 at 1e-6, one thread,
  CPU-time medians of interleaved runs;
- Van der Pol: ``x'' = μ (1 − x²) x' − x``, a batch of 8 with ``μ`` from 1 to 25 (a parameter), ``y0 = (2, 0)``,
  outputs at ``t = 1, 2``, dopri5 at ``rtol = atol = 1e-5``: each method's relative error from backprop at the
  same tolerance and from the ODE's gradient (backprop at ``rtol = atol = 1e-10``), or why it failed.

``python -m cde_nets.benchmarks.interpolating_adjoint [--tiny]`` writes
``benchmarks/results/interpolating_adjoint.json``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
from torch import nn

from cde_nets import odeint
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.solvers.gradients import GRADIENTS, Interpolating

from .common import interleaved_medians, write

F64 = torch.float64
MEMORY = {
    "interpolating": Interpolating(),
    "interpolating_checkpoints": Interpolating(checkpoints=True),
    "interpolating_checkpoints_10": Interpolating(checkpoints=10),
    "checkpoint": "checkpoint",
    "adjoint": "adjoint",
    "backprop": "backprop",
}
TIMED = ("interpolating", "interpolating_checkpoints", "adjoint", "backprop", "checkpoint")


class MLP(nn.Module):
    """``F(t, y) = W2 tanh(W1 y + b1) + b2``."""

    def __init__(self, dim: int, width: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1, self.l2 = nn.Linear(dim, width).double(), nn.Linear(width, dim).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) / math.sqrt(p.shape[-1]))

    def forward(self, t, y):
        return self.l2(torch.tanh(self.l1(y)))


class VdP(nn.Module):
    def __init__(self, mu: torch.Tensor):
        super().__init__()
        self.mu = nn.Parameter(mu)

    def forward(self, t, y):
        x, v = y[..., 0], y[..., 1]
        return torch.stack([v, self.mu * (1 - x * x) * v - x], -1)


def _memory(tiny: bool) -> tuple[list[dict], dict]:
    field = MLP(4, 32)
    y0 = torch.randn(16, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    rows = []
    for name, gradient in MEMORY.items():
        for steps in (5, 10) if tiny else (10, 100, 1000):
            y = y0.clone().requires_grad_()
            mem = SavedTensorMemory(exclude=[*field.parameters(), y])
            t = torch.tensor([0.0, 1.0], dtype=F64)
            with mem:
                ys = odeint(field, y, t, method="rk4", options=dict(step_size=1.0 / steps), gradient=gradient)
            ys[-1].square().mean().backward()
            rows.append({"gradient": name, "steps": steps, "saved_bytes": mem.peak_bytes})
    state = y0.numel() * y0.element_size()
    slopes = {}
    for name in MEMORY:
        r = [x for x in rows if x["gradient"] == name]
        s = np.array([x["steps"] for x in r], dtype=float)
        m = np.array([x["saved_bytes"] for x in r], dtype=float)
        slope = float(np.polyfit(s, m, 1)[0])
        slopes[name] = {"bytes_per_step": slope, "states_per_step": slope / state}
    return rows, slopes


def _grad(func: nn.Module, y0: torch.Tensor, t: torch.Tensor, gradient, **kw) -> torch.Tensor:
    y = y0.clone().requires_grad_()
    ys = odeint(func, y, t, gradient=gradient, **kw)
    params = [p for p in func.parameters()]
    grads = torch.autograd.grad(ys[1:].square().sum(), [*params, y])
    return torch.cat([g.reshape(-1) for g in grads])


def _timing(tiny: bool) -> list[dict]:
    func = MLP(2, 8 if tiny else 64)
    y0 = torch.randn(8 if tiny else 64, 2, generator=torch.Generator().manual_seed(2), dtype=F64)
    t = torch.tensor([0.0, 1.0], dtype=F64)
    kw = dict(rtol=1e-6, atol=1e-8, method="dopri5")
    gradients = {n: MEMORY[n] for n in TIMED}
    ref = _grad(func, y0, t, "backprop", **kw)
    times = interleaved_medians(
        [lambda g=g: _grad(func, y0, t, g, **kw) for g in gradients.values()],
        repeat=1 if tiny else 7,
        warmup=0 if tiny else 1,
        clock=time.process_time,
    )
    rows = []
    for (name, g), s in zip(gradients.items(), times):
        err = float((_grad(func, y0, t, g, **kw) - ref).norm() / ref.norm())
        rows.append({"gradient": name, "time_s": s, "rel_diff_from_backprop": err})
    backprop = next(x["time_s"] for x in rows if x["gradient"] == "backprop")
    for r in rows:
        r["over_backprop"] = r["time_s"] / backprop
    return rows


def _van_der_pol(tiny: bool) -> list[dict]:
    mu = torch.linspace(1.0, 25.0, 8, dtype=F64)
    y0 = torch.stack([torch.full((8,), 2.0, dtype=F64), torch.zeros(8, dtype=F64)], -1)
    T = 0.2 if tiny else 2.0
    t = torch.tensor([0.0, T / 2, T], dtype=F64)
    kw = dict(rtol=1e-5, atol=1e-5, method="dopri5")
    ode = _grad(VdP(mu.clone()), y0, t, "backprop", rtol=1e-10, atol=1e-10, method="dopri5")
    base = _grad(VdP(mu.clone()), y0, t, "backprop", **kw)
    # tiny: the backsolve adjoint (seconds to underflow) and forward mode (one solve per parameter) left out
    names = ("backprop", "checkpoint", "reversible", "interpolating") if tiny else tuple(GRADIENTS)
    methods: dict = {n: n for n in names}
    methods["interpolating_checkpoints"] = Interpolating(checkpoints=True)
    rows = []
    for name, g in methods.items():
        row: dict = {"gradient": name}
        start = time.perf_counter()
        try:
            got = _grad(VdP(mu.clone()), y0, t, g, **kw)
        except Exception as exc:  # a refusal or a failed backward solve: recorded, not raised
            row.update(failed=type(exc).__name__, reason=str(getattr(exc, "reason", "")), message=str(exc)[:200])
        else:
            row.update(
                finite=bool(torch.isfinite(got).all()),
                rel_error_from_backprop=float((got - base).norm() / base.norm()),
                rel_error_from_ode=float((got - ode).norm() / ode.norm()),
            )
        row["time_s"] = time.perf_counter() - start
        rows.append(row)
    rows.append(
        {"gradient": "backprop (same tolerance)", "rel_error_from_ode": float((base - ode).norm() / ode.norm())}
    )
    return rows


def run(tiny: bool = False, out_dir=None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        rows, slopes = _memory(tiny)
        payload = {
            "setting": "memory: rk4 over [0, 1], MLP 4 -> 32 -> 4, batch 16, float64, bytes saved for backward; "
            "time: MLP 2 -> 64 -> 2, batch 64, dopri5 1e-6/1e-8, one thread, CPU-time medians; Van der Pol: "
            "batch 8, mu 1..25, y0 (2, 0), outputs at 1 and 2, dopri5 rtol = atol = 1e-5, errors from backprop at "
            "that tolerance and from backprop at 1e-10 (the ODE's gradient)",
            "rows": rows,
            "slopes": slopes,
            "timing": _timing(tiny),
            "van_der_pol": _van_der_pol(tiny),
            "time_s": time.perf_counter() - start,
        }
        write("interpolating_adjoint", payload, out_dir)
    finally:
        torch.set_num_threads(threads)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| gradient | steps | saved bytes |\n|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['gradient']} | {r['steps']} | {r['saved_bytes']} |")
    for name, s in res["slopes"].items():
        print(f"{name}: {s['bytes_per_step']:.0f} bytes/step ({s['states_per_step']:.2f} states)")
    print("| gradient | ms | / backprop | rel. diff. |\n|---|---|---|---|")
    for r in res["timing"]:
        print(
            f"| {r['gradient']} | {1e3 * r['time_s']:.1f} | {r['over_backprop']:.2f} | "
            f"{r['rel_diff_from_backprop']:.1e} |"
        )
    for r in res["van_der_pol"]:
        print(r)


if __name__ == "__main__":
    main()
