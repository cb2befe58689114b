"""Implicit Runge-Kutta methods: a stiff problem against dopri5, and the cost of a gl4 step against an rk4 step.

- Stiff: Van der Pol ``x'' − μ (1 − x²) x' + x = 0`` with ``μ = 1000`` from ``(x, x') = (2, 0)`` over ``[0, 20]``
  (the slow branch; eigenvalue ≈ −3000 at the start), float64. The fixed-step implicit methods at 20–80 steps
  against torchdiffeq's dopri5 at rtol 1e-6 / 1e-8: steps, NFE, time and the relative error of ``(x, x')(T)``
  against scipy's Radau at rtol 1e-10, atol 1e-12.
- Cost: one step of ``gl4`` (stages to rounding with the default ``Newton("auto")``, IFT backward; and with
  ``Newton("simplified")``) against one of ``rk4`` on the H1 field, dim 4 and 64, batch 256, float64: forward time
  and forward+backward CPU time (loss ``Σ y₁²``, gradients to ``y_0`` and the parameters); targets
  ``gl4 forward ≤ 3 × rk4 forward`` and ``gl4 backward ≤ 2 × gl4 forward``. Also per step of a chain of 10 steps
  (each from the last one's output, as in a solve or a stack of layers: gl4 then starts from the previous step's
  collocation polynomial and simplified Newton reuses the chain's factored matrix, and rk4's field constants are
  already built), with each chained step's evaluations.

``python -m cde_nets.benchmarks.implicit_methods [--tiny]`` writes ``benchmarks/results/implicit_methods.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from torch import nn

from cde_nets import ODEBlock
from cde_nets.fields import Hamiltonian
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.implicit import Newton
from cde_nets.solvers.schemes import GL4, get_scheme

from .common import interleaved_medians, write


class VanDerPol(nn.Module):
    def __init__(self, mu: float):
        super().__init__()
        self.mu = mu

    def forward(self, t, y):
        x, v = y[:, :1], y[:, 1:]
        return torch.cat([v, self.mu * (1 - x**2) * v - x], 1)


def _reference(mu: float, T: float) -> np.ndarray:
    from scipy.integrate import solve_ivp

    sol = solve_ivp(
        lambda t, y: [y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]],
        (0.0, T),
        [2.0, 0.0],
        method="Radau",
        rtol=1e-10,
        atol=1e-12,
    )
    return sol.y[:, -1]


def stiff(tiny: bool) -> list[dict]:
    mu, T = (10.0, 2.0) if tiny else (1000.0, 20.0)
    ref = _reference(mu, T)
    y0 = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    field = VanDerPol(mu)
    runs: list[tuple[str, dict]] = [
        (m, {"step_size": T / n})
        for m in ("radauIIA5", "radauIIA3", "gl4", "trbdf2", "sdirk2", "implicit_euler")
        for n in ((20,) if tiny else (20, 40, 80))
    ]
    runs += [("dopri5", {"rtol": r, "atol": r}) for r in ((1e-6,) if tiny else (1e-6, 1e-8))]
    rows = []
    for method, kw in runs:
        block = ODEBlock(field, T=T, method=method, max_steps=1_000_000, **kw)
        start = time.perf_counter()
        with torch.no_grad():
            sol = block.solve(y0)
            y = sol.y[0].numpy()
        wall = time.perf_counter() - start
        rows.append(
            {
                "problem": f"van der pol mu={mu:g}",
                "method": method,
                **{k: v for k, v in kw.items() if k != "atol"},
                "steps": sol.stats["steps_forward"] + sol.stats["rejected_forward"],
                "nfe": sol.stats["nfe_forward"],
                "time_s": wall,
                "rel_error": float(np.abs(y - ref).max() / np.abs(ref).max()),
            }
        )
    return rows


def _step_fns(sch, bound, y0: torch.Tensor, params: list):
    """One step forward (no graph) and forward + backward (to ``y0`` and ``params``)."""

    def fwd():
        with torch.no_grad():
            return sch.step(bound, 0, (y0,), 0.1, None, 0.0)

    def fwd_bwd():
        y = y0.clone().requires_grad_(True)
        loss = sch.step(bound, 0, (y,), 0.1, None, 0.0)[0].square().sum()
        torch.autograd.grad(loss, [y, *params])

    def chain():  # CHAIN steps, each from the last one's output: an implicit step starts from its prediction
        state = (y0,)
        with torch.no_grad():
            for _ in range(CHAIN):
                state = sch.step(bound, 0, state, 0.1, None, 0.0)

    return [fwd, fwd_bwd, chain]


CHAIN = 10


def _chain_nfe(sch, bound, y0: torch.Tensor) -> list[int]:
    """The evaluations of each step of a chain (Newton iterations included)."""
    state, nfe = (y0,), []
    with torch.no_grad():
        for _ in range(CHAIN):
            state = sch.step(bound, 0, state, 0.1, None, 0.0)
            nfe.append(sch.evaluations(0))
    return nfe


def cost(tiny: bool) -> list[dict]:
    rows = []
    for dim in (4,) if tiny else (4, 64):
        batch = 16 if tiny else 256
        f = Hamiltonian(dim, generator=torch.Generator().manual_seed(0)).double()
        y0 = torch.randn(batch, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        bound, times, fns = BoundField(f), {}, []
        schemes = {"rk4": get_scheme("rk4"), "gl4": get_scheme("gl4"), "gl4_simplified": GL4(Newton("simplified"))}
        for name, sch in schemes.items():
            schemes[name] = sch = sch.for_field(f)
            fns += _step_fns(sch, bound, y0, list(f.parameters()))
        # run alternately, so that the load of a shared machine hits every method alike; CPU time, which a loaded
        # machine's preemption does not inflate (a 20 ms step is preempted far more often than a 0.2 ms one)
        medians = interleaved_medians(fns, repeat=3 if tiny else 25, warmup=1 if tiny else 2, clock=time.process_time)
        for i, (name, sch) in enumerate(schemes.items()):
            times[name] = (medians[3 * i], medians[3 * i + 1], medians[3 * i + 2] / CHAIN)
            sch.step(bound, 0, (y0,), 0.1, None, 0.0)
            times[name + "_nfe"] = sch.evaluations(0)
            chained = _chain_nfe(sch, bound, y0)
            times[name + "_chain_nfe"] = chained
        (rf, rfb, rc), (gf, gfb, gc), (pf, pfb, pc) = times["rk4"], times["gl4"], times["gl4_simplified"]
        rows.append(
            {
                "dim": dim,
                "batch": batch,
                "rk4_forward_s": rf,
                "rk4_forward_backward_s": rfb,
                "gl4_forward_s": gf,
                "gl4_forward_backward_s": gfb,
                "gl4_nfe_per_step": times["gl4_nfe"],
                "gl4_over_rk4_forward": gf / rf,
                "gl4_backward_over_forward": (gfb - gf) / gf,
                "gl4_simplified_forward_s": pf,
                "gl4_simplified_forward_backward_s": pfb,
                "gl4_simplified_nfe_per_step": times["gl4_simplified_nfe"],
                "gl4_simplified_over_rk4_forward": pf / rf,
                "gl4_simplified_backward_over_forward": (pfb - pf) / pf,
                "chain": CHAIN,
                "rk4_chain_step_s": rc,
                "gl4_chain_step_s": gc,
                "gl4_chain_nfe_per_step": times["gl4_chain_nfe"],
                "gl4_chain_over_rk4_chain": gc / rc,
                "gl4_simplified_chain_step_s": pc,
                "gl4_simplified_chain_nfe_per_step": times["gl4_simplified_chain_nfe"],
                "gl4_simplified_chain_over_rk4_chain": pc / rc,
            }
        )
    return rows


def run(tiny: bool = False, out_dir=None) -> dict:
    start = time.perf_counter()
    payload = {
        "setting": "stiff: Van der Pol mu=1000 on [0, 20] from (2, 0), float64, error vs scipy Radau rtol 1e-10; "
        "cost: one step h=0.1 on the H1 field, batch 256, float64",
        "goal": "gl4 forward <= 3x rk4 forward; gl4 backward <= 2x gl4 forward",
        "rows": stiff(tiny),
        "cost": cost(tiny),
    }
    payload["time_s"] = time.perf_counter() - start
    payload["load_average"] = os.getloadavg()
    write("implicit_methods", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| method | setting | steps | NFE | time s | rel. error |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        setting = f"h = {r['step_size']:g}" if "step_size" in r else f"rtol {r['rtol']:.0e}"
        print(f"| {r['method']} | {setting} | {r['steps']} | {r['nfe']} | {r['time_s']:.3f} | {r['rel_error']:.1e} |")
    print("\n| dim | Newton | rk4 fwd ms | gl4 fwd ms | gl4 NFE | gl4/rk4 fwd | gl4 bwd/fwd | chained gl4/rk4 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["cost"]:
        for kind, key in (("auto", "gl4"), ("simplified", "gl4_simplified")):
            print(
                f"| {r['dim']} | {kind} | {1e3 * r['rk4_forward_s']:.2f} | {1e3 * r[key + '_forward_s']:.2f} | "
                f"{r[key + '_nfe_per_step']} | {r[key + '_over_rk4_forward']:.2f} | "
                f"{r[key + '_backward_over_forward']:.2f} | {r[key + '_chain_over_rk4_chain']:.2f} |"
            )


if __name__ == "__main__":
    main()
