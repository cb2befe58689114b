"""What a looser stage tolerance buys and costs: gl4 under ``Newton(tol=...)`` against its default (to rounding).

The default solves the stage equations to rounding (:mod:`solvers.steppers.implicit`), which is what keeps a symplectic
method's energy error bounded over long runs; every iteration costs one batched evaluation of the ``s`` stages.
An absolute tolerance ``tol`` on the stage increment stops earlier. Per tolerance, on the non-separable H1 field
of the long conservation study (Galimberti et al. 2023, eq. H8, ``R⁴``, canonical ``J``, tanh, float64):

- **drift**: ``steps`` steps of ``h = 0.1`` from 16 random states: the fitted secular slope of ``|H(y_n) − H(y_0)|``
  (:func:`~cde_nets.diagnostics.energy_error_fit`, Hann-weighted, worst sample) as a fraction of rk4's at the same
  step, the error's maximum over its first-1 % maximum, and evaluations per step;
- **cost**: one step of a chain of 10 (each from the last one's output, as in a solve or a stack of layers) of gl4
  against one of rk4, dim 4 and 64, batch 256, CPU time of one thread, the tolerances and rk4 interleaved.

``python -m cde_nets.benchmarks.implicit_tolerance [--tiny]`` writes ``benchmarks/results/implicit_tolerance.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from cde_nets.blocks.gathering import gathered
from cde_nets.diagnostics.long_run import long_run_energy
from cde_nets.fields import Hamiltonian
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.schemes import GL4, get_scheme
from cde_nets.solvers.steppers.implicit import Newton

from .common import interleaved_medians, write

TOLERANCES: tuple[float | None, ...] = (None, 1e-13, 1e-12, 1e-11, 1e-10)
CHAIN = 10


def _h1(dim: int, seed: int = 0) -> Hamiltonian:
    return Hamiltonian(dim, T=1.0, K="full", generator=torch.Generator().manual_seed(seed)).double()


def drift(tiny: bool) -> list[dict]:
    steps, f = (200 if tiny else 100_000), _h1(4)
    y0 = torch.randn(2 if tiny else 16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rk4 = long_run_energy(f, "rk4", y0, 0.1, steps)
    rows = []
    for tol in TOLERANCES:
        run = long_run_energy(f, GL4(Newton(tol=tol)), y0, 0.1, steps)
        fit = run["fit"]
        rows.append(
            {
                "tol": tol,
                "steps": steps,
                "nfe_per_step": run["nfe"] / steps,
                "slope": fit["slope"],
                "slope_over_rk4": abs(fit["slope"] / rk4["fit"]["slope"]),
                "max_over_first_percent": fit["ratio"],
                "wall_s": run["wall_s"],
                "rk4_wall_s": rk4["wall_s"],
            }
        )
    return rows


def _chain(sch, bound, y0: torch.Tensor) -> int:
    """``CHAIN`` steps, each from the last one's output; the evaluations of the last."""
    state = (y0,)
    for _ in range(CHAIN):
        state = sch.step(bound, 0, state, 0.1, None, 0.0)
    return sch.evaluations(0)


def cost(tiny: bool) -> list[dict]:
    rows = []
    for dim in (4,) if tiny else (4, 64):
        f, batch = _h1(dim), 16 if tiny else 256
        y0 = torch.randn(batch, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        bound = BoundField(f)
        schemes = [get_scheme("rk4").for_field(f)] + [GL4(Newton(tol=tol)).for_field(f) for tol in TOLERANCES]

        with torch.no_grad(), gathered(f):  # as in a block's call: the field's constants built once
            nfe = [_chain(sch, bound, y0) for sch in schemes]
            medians = interleaved_medians(
                [lambda s=s, b=bound, y=y0: _chain(s, b, y) for s in schemes],
                repeat=3 if tiny else 25,
                clock=time.process_time,
            )
        rk4 = medians[0]
        for tol, t, n in zip(TOLERANCES, medians[1:], nfe[1:]):
            rows.append({"dim": dim, "batch": batch, "tol": tol, "gl4_over_rk4": t / rk4, "last_step_nfe": n})
    return rows


def run(tiny: bool = False, out_dir=None) -> dict:
    start = time.perf_counter()
    torch.set_num_threads(1)
    payload = {
        "setting": "gl4 with Newton(tol) on the H1 field (R^4, h = 0.1, float64): energy drift over 1e5 steps from 16 "
        "states against rk4's; chained step cost against rk4 at dim 4 and 64, batch 256 (CPU time, one thread)",
        "goal": "drift slope <= 1e-3 of rk4's at every tolerance reported; the cost each tolerance buys",
        "rows": drift(tiny),
        "cost": cost(tiny),
    }
    payload["time_s"] = time.perf_counter() - start
    payload["load_average"] = os.getloadavg()
    write("implicit_tolerance", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| tol | NFE / step | drift slope / rk4's | max / first-1 % max | gl4 / rk4, dim 4 | dim 64 |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        c = {c["dim"]: c["gl4_over_rk4"] for c in res["cost"] if c["tol"] == r["tol"]}
        ratios = " | ".join(f"{c[d]:.2f}" if d in c else "—" for d in (4, 64))
        print(
            f"| {r['tol'] or 'rounding'} | {r['nfe_per_step']:.2f} | {r['slope_over_rk4']:.1e} | "
            f"{r['max_over_first_percent']:.3f} | {ratios} |"
        )


if __name__ == "__main__":
    main()
