"""Reversible Runge-Kutta methods (McCallum & Foster 2024, arXiv:2410.11648) against ALF (MALI) and checkpointing.

Two parts. **Memory and time against the steps**: an MLP field, fixed steps of ``T / n`` for ``n`` = 100, 1 000 and
10 000; the bytes saved for backward (:class:`cde_nets.diagnostics.SavedTensorMemory`) and the forward + backward
CPU time (one thread) of ``reversible_rk4`` with ``gradient="reversible"``, ``alf`` with ``"reversible"`` and
``rk4`` with ``"checkpoint"``.

**Stability** on the linear oscillator ``x'' + δ x' + x = 0`` (closed form), step 0.1 up to ``T = 300``: the
global error of the forward solve and the error of the start rebuilt by the inverse steps from the end (what the
reversible gradient walks on), for ALF (η = 1) and the reversible method on rk4 and dopri5 with couplings
λ = 0.999 and 0.9. Linearised, the reversible step has the eigenvalues ``R(hμ)`` and ``λ R(−hμ)`` (exactly
``e^{hμ}`` and ``λ e^{−hμ}`` for an exact base): the second, parasitic one decays forwards only where
``h Re μ > ln λ`` (for the damped oscillator, ``h Re μ = −δh/2``: λ = 0.999 is not enough, λ = 0.9 is), and the
inverse steps grow it by ``1/λ`` each, so the rebuild amplifies rounding by about ``λ^{−n}`` over ``n`` steps.
``python -m cde_nets.benchmarks.reversible_rk [--tiny]``.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np
import torch
from torch import nn

from cde_nets import ODEBlock
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.solvers.steppers.alf import alf_inverse, alf_step
from cde_nets.solvers.steppers.reversible_rk import base_of, rev_inverse, rev_step

from .common import write

F64 = torch.float64
# (label, method, gradient)
CASES = (
    ("reversible_rk4 reversible", "reversible_rk4", "reversible"),
    ("alf reversible", "alf", "reversible"),
    ("rk4 checkpoint", "rk4", "checkpoint"),
)


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, g: torch.Generator):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(0.5 * torch.randn(p.shape, generator=g))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)


def _memory(steps_list: tuple[int, ...], dim: int, batch: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    field = _MLP(dim, 2 * dim, g).double()
    y0 = torch.randn(batch, dim, generator=g, dtype=F64)
    rows = []
    for _, method, gradient in CASES:  # warm-up: the first solve of a process pays one-off initialisation
        ODEBlock(field, 1.0, method=method, step_size=0.5, gradient=gradient)(y0).sum()
    for label, method, gradient in CASES:
        for n in steps_list:
            block = ODEBlock(field, 1.0, method=method, step_size=1.0 / n, gradient=gradient)
            field.zero_grad()
            mem = SavedTensorMemory(exclude=[*field.parameters(), y0])
            t0 = time.process_time()  # one thread: CPU time, which a loaded machine's preemption does not inflate
            with mem:
                sol = block.solve(y0)
            t1 = time.process_time()
            sol.y.square().mean().backward()
            t2 = time.process_time()
            rows.append(
                dict(
                    case=label,
                    steps=n,
                    saved_bytes=mem.peak_bytes,
                    forward_s=t1 - t0,
                    backward_s=t2 - t1,
                    us_per_step=1e6 * (t2 - t0) / n,
                    nfe_forward=sol.stats["nfe_forward"],
                    nfe_backward=sol.stats["nfe_backward"],
                )
            )
    return rows


def _oscillator(damping: float) -> tuple[torch.Tensor, object]:
    a = torch.tensor([[0.0, 1.0], [-1.0, -damping]], dtype=F64)
    return a, lambda t, y: a @ y


def _stability(horizons: tuple[float, ...], h: float) -> list[dict]:
    rows = []
    y0 = torch.tensor([1.0, 0.0], dtype=F64)
    for damping in (0.0, 0.2):
        a, f = _oscillator(damping)
        solvers = [("alf", None, None)] + [
            (m, m, lam) for m in ("reversible_rk4", "reversible_dopri5") for lam in (0.999, 0.9)
        ]
        for name, method, lam in solvers:
            tab = None if method is None else base_of(method)
            for T in horizons:
                n = round(T / h)
                exact = torch.linalg.matrix_exp(a * T) @ y0
                with torch.no_grad():
                    if tab is None:
                        z, v = y0, f(0.0, y0)
                        for k in range(n):
                            z, v = alf_step(f, z, v, k * h, h, 1.0)
                        err = float((z - exact).abs().max())
                        for k in range(n - 1, -1, -1):
                            z, v = alf_inverse(f, z, v, k * h, h, 1.0)
                        rebuilt = z
                    else:
                        y = z = y0
                        for k in range(n):
                            y, z = rev_step(f, tab, lam, y, z, k * h, (k + 1) * h)
                        err = float((y - exact).abs().max())
                        for k in range(n - 1, -1, -1):
                            y, z = rev_inverse(f, tab, lam, y, z, k * h, (k + 1) * h)
                        rebuilt = y
                rows.append(
                    dict(
                        damping=damping,
                        solver=name if lam is None else f"{name} λ={lam}",
                        T=T,
                        steps=n,
                        global_error=err,
                        rebuild_error=float((rebuilt - y0).abs().max()),
                        parasitic_stable=None if lam is None else bool(-damping * h / 2 > math.log(lam)),
                    )
                )
    return rows


def run(tiny: bool = False, out_dir=None) -> dict:
    steps_list = (5, 10) if tiny else (100, 1000, 10000)
    dim, batch = (2, 2) if tiny else (16, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        memory = _memory(steps_list, dim, batch)
    finally:
        torch.set_num_threads(threads)
    summary = {}
    for label, _, _ in CASES:
        r = [x for x in memory if x["case"] == label]
        s = np.array([x["steps"] for x in r], dtype=float)
        m = np.array([x["saved_bytes"] for x in r], dtype=float)
        summary[label] = {
            "bytes_per_step": float(np.polyfit(s, m, 1)[0]),
            "ratio_max_to_min_steps": float(m[-1] / max(m[0], 1.0)),
            "us_per_step_at_most_steps": r[-1]["us_per_step"],
        }
    stability = _stability((0.5, 1.0) if tiny else (10.0, 100.0, 300.0), 0.1)
    payload = {
        "setting": f"memory: MLP {dim}-{2 * dim}-{dim} tanh, batch {batch}, float64, T=1, fixed steps; stability: "
        "x'' + δx' + x = 0, x(0)=1, x'(0)=0, step 0.1",
        "goal": "reversible memory flat (ratio_max_to_min_steps == 1); checkpoint linear; rebuild at rounding",
        "rows": memory,
        "summary": summary,
        "stability": stability,
        "load_average": os.getloadavg(),
    }
    write("reversible_rk", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    res = run(tiny=p.parse_args().tiny)
    print("| case | steps | saved for backward (KiB) | fwd s | bwd s | µs/step |\n|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['case']} | {r['steps']} | {r['saved_bytes'] / 1024:.1f} | {r['forward_s']:.2f} | "
            f"{r['backward_s']:.2f} | {r['us_per_step']:.0f} |"
        )
    print("\n| δ | solver | T | global error | rebuild error |\n|---|---|---|---|---|")
    for r in res["stability"]:
        print(f"| {r['damping']} | {r['solver']} | {r['T']:g} | {r['global_error']:.2e} | {r['rebuild_error']:.2e} |")


if __name__ == "__main__":
    main()
