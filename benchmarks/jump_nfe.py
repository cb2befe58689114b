"""NFE of a 16-piece Hamiltonian block at rtol 1e-3, both gradient modes, with and without ``jump_t``.

``python -m cde_nets.benchmarks.jump_nfe [--tiny]`` writes ``benchmarks/results/jump_nfe.json``.
"""

from __future__ import annotations

import argparse

import torch

from cde_nets import ODEBlock, SolverOptions
from cde_nets.fields import Hamiltonian

from .common import median_time, write


def run(tiny: bool = False, out_dir=None) -> dict:
    field = Hamiltonian(4, layers=16, T=1.0, init_std=1.0, generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(8 if tiny else 256, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        ref = ODEBlock(field, rtol=1e-12, atol=1e-12)(y0)
    rows = []
    for rtol in (1e-3,) if tiny else (1e-3, 1e-6, 1e-9):
        for gradient, jumps in (("adjoint", True), ("adjoint", False), ("backprop", True), ("backprop", False)):
            block = ODEBlock(field, gradient=gradient, solver=SolverOptions(rtol=rtol, atol=rtol, jumps=jumps))
            with torch.no_grad():
                err = (block(y0) - ref).abs().max().item()

            def step(block=block):
                field.zero_grad()
                sol = block.solve(y0)
                sol.y.square().mean().backward()
                return sol.stats

            t = median_time(step, repeat=1 if tiny else 5, warmup=0 if tiny else 1)
            stats = step().as_dict()
            rows.append({"rtol": rtol, "gradient": gradient, "jumps": jumps, **stats, "max_error": err, "time_s": t})
    payload = {
        "setting": "Hamiltonian dim 4, 16 pieces, T=1, dopri5, rtol=atol, float64, batch 256; max error of "
        "y(T) against rtol=1e-12",
        "rows": rows,
    }
    write("jump_nfe", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    res = run(a.tiny)
    print(
        "| rtol | gradient | jump_t | NFE fwd | NFE bwd | steps fwd (rej.) | steps bwd (rej.) | max error | time ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['rtol']:.0e} | {r['gradient']} | {r['jumps']} | {r['nfe_forward']} | {r['nfe_backward']} | "
            f"{r['steps_forward']} ({r['rejected_forward']}) | {r['steps_backward']} ({r['rejected_backward']}) | "
            f"{r['max_error']:.1e} | {1e3 * r['time_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
