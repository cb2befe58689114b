"""Adjoint cost against the number of parameter pieces: the piecewise adjoint, torchdiffeq's, and backprop.

Field: Hamiltonian ``y' = J Kᵀ tanh(K y + b)`` with ``L`` pieces, Euler with one step per piece, one thread.
Forward + backward time of ``ODEBlock`` with the piecewise adjoint (``gradient="adjoint"``), with torchdiffeq's
``odeint_adjoint`` over all pieces (the adapter's reference path), and with ``gradient="backprop"``.

Goals: the piecewise adjoint is linear in ``L`` (time per piece at 1000 pieces within 1.2x of that at 10) and at
most 3x backprop at 1000 pieces. ``python -m cde_nets.benchmarks.adjoint_pieces [--tiny]`` writes
``benchmarks/results/adjoint_pieces.json``.
"""

from __future__ import annotations

import argparse

import torch

from cde_nets import ODEBlock
from cde_nets.fields import Hamiltonian
from cde_nets.solvers.gradients import adjoint as adjoint_module

from .common import median_time, write

MODES = ("new_adjoint", "old_adjoint", "backprop")


def _timer(block: ODEBlock, y0: torch.Tensor, mode: str, last: list):
    """A forward+backward run that keeps its solution in ``last`` (for its counts)."""

    def fwd_bwd():
        adjoint_module.PIECEWISE = mode != "old_adjoint"
        try:
            last[:] = [block.solve(y0)]
            last[0].y.square().mean().backward()
        finally:
            adjoint_module.PIECEWISE = True

    return fwd_bwd


def _case(dim: int, batch: int, pieces: int, repeat: int, warmup: int) -> dict:
    g = torch.Generator().manual_seed(pieces)
    field = Hamiltonian(dim, layers=pieces, generator=g)
    y0 = torch.randn(batch, dim, generator=g)
    row: dict = {"dim": dim, "batch": batch, "pieces": pieces}
    for mode in MODES:
        block = ODEBlock(field, method="euler", gradient="backprop" if mode == "backprop" else "adjoint")
        last: list = []
        fn = _timer(block, y0, mode, last)
        # the old adjoint is quadratic: fewer repeats keep the full run within minutes
        reps = repeat if mode != "old_adjoint" or pieces < 1000 else max(1, repeat // 3)
        row[f"{mode}_s"] = median_time(fn, reps, warmup if mode != "old_adjoint" else min(warmup, 1))
        row[f"{mode}_nfe_backward"] = last[0].stats["nfe_backward"]
        field.zero_grad(set_to_none=True)
    row["new_over_backprop"] = row["new_adjoint_s"] / row["backprop_s"]
    row["old_over_backprop"] = row["old_adjoint_s"] / row["backprop_s"]
    row["old_over_new"] = row["old_adjoint_s"] / row["new_adjoint_s"]
    for mode in MODES:
        row[f"{mode}_ms_per_piece"] = 1e3 * row[f"{mode}_s"] / pieces
    return row


def run(tiny: bool = False, out_dir=None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        repeat, warmup = (1, 0) if tiny else (5, 1)
        sizes = ((16, 64),) if tiny else ((64, 256), (16, 64))
        counts = (4, 8) if tiny else (10, 100, 1000)
        rows = [_case(dim, batch, L, repeat, warmup) for dim, batch in sizes for L in counts]
    finally:
        torch.set_num_threads(threads)
    linearity = {}
    for dim, batch in sizes:
        mine = [r for r in rows if r["dim"] == dim and r["batch"] == batch]
        lo, hi = mine[0], mine[-1]
        linearity[f"dim={dim} batch={batch}"] = {
            mode: hi[f"{mode}_ms_per_piece"] / lo[f"{mode}_ms_per_piece"] for mode in MODES
        }
    payload = {
        "setting": "Hamiltonian J Kᵀ tanh(Ky + b), Euler one step per piece, float32, 1 thread, fwd+bwd of "
        "mean(y(T)²); median of repeats",
        "goal": "new adjoint <= 3x backprop at the most pieces; time per piece, most / fewest pieces, <= 1.2",
        "rows": rows,
        "per_piece_growth": linearity,
    }
    write("adjoint_pieces", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| dim | batch | pieces | new adjoint s | old adjoint s | backprop s | new / backprop | old / backprop |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['dim']} | {r['batch']} | {r['pieces']} | {r['new_adjoint_s']:.3f} | {r['old_adjoint_s']:.3f} | "
            f"{r['backprop_s']:.3f} | {r['new_over_backprop']:.2f} | {r['old_over_backprop']:.2f} |"
        )
    for case, growth in res["per_piece_growth"].items():
        print(case, "time per piece, most / fewest pieces:", {k: round(v, 2) for k, v in growth.items()})


if __name__ == "__main__":
    main()
