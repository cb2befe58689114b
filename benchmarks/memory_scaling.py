"""Adjoint against backprop: time and memory held for backward at 10, 100 and 1000 steps (issue 7, item 3).

Goal: the adjoint's memory is flat (1000 steps <= 1.2x the memory of 10); backprop's grows linearly, and the
slope (bytes per step) is reported. Memory is the peak of tensors saved for backward
(:class:`cde_nets.diagnostics.SavedTensorMemory`). ``python -m cde_nets.benchmarks.memory_scaling [--tiny]``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from cde_nets import ODEBlock
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.fields import Hamiltonian

from .common import median_time, write


def run(tiny: bool = False, out_dir=None) -> dict:
    dim, batch = (4, 16) if tiny else (64, 256)
    steps_list = (10, 20) if tiny else (10, 100, 1000)
    g = torch.Generator().manual_seed(0)
    field = Hamiltonian(dim, layers=10, T=1.0, generator=g)
    y0 = torch.randn(batch, dim, generator=g)
    rows = []
    for gradient in ("adjoint", "backprop"):
        for steps in steps_list:
            block = ODEBlock(field, method="rk4", step_size=1.0 / steps, gradient=gradient)

            def step(block=block):
                field.zero_grad()
                block(y0).square().mean().backward()

            mem = SavedTensorMemory(exclude=list(field.parameters()) + [y0])
            with mem:
                y = block(y0)
            y.square().mean().backward()
            t = median_time(step, repeat=1 if tiny else 3, warmup=0 if tiny else 1)
            rows.append({"gradient": gradient, "steps": steps, "saved_bytes": mem.peak_bytes, "time_s": t,
                         "nfe_forward": block.stats["nfe_forward"], "nfe_backward": block.stats["nfe_backward"]})
    summary = {}
    for gradient in ("adjoint", "backprop"):
        r = [x for x in rows if x["gradient"] == gradient]
        s = np.array([x["steps"] for x in r], dtype=float)
        m = np.array([x["saved_bytes"] for x in r], dtype=float)
        summary[gradient] = {"bytes_per_step": float(np.polyfit(s, m, 1)[0]),
                             "ratio_max_to_min_steps": float(m[-1] / max(m[0], 1.0))}
    payload = {"setting": f"Hamiltonian dim {dim}, batch {batch}, rk4, T=1", "rows": rows, "summary": summary,
               "goal": "adjoint ratio_max_to_min_steps <= 1.2; backprop linear"}
    write("memory_scaling", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| gradient | steps | saved for backward (MiB) | time ms |\n|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['gradient']} | {r['steps']} | {r['saved_bytes'] / 2**20:.3f} | {1e3 * r['time_s']:.1f} |")
    for k, v in res["summary"].items():
        print(f"{k}: {v['bytes_per_step'] / 1024:.1f} KiB per step, 1000/10 steps memory ratio "
              f"{v['ratio_max_to_min_steps']:.2f}")


if __name__ == "__main__":
    main()
