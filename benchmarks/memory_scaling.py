"""Adjoint against backprop: time and memory held for backward at 10, 100 and 1000 steps; and
the memory-free discrete nets (:mod:`cde_nets.blocks.invertible`) against their stored activations at 10 and 1000
layers.

Goals: the adjoint's memory is flat (1000 steps <= 1.2x the memory of 10); backprop's grows linearly, and the
slope (bytes per step) is reported. Memory-free discrete nets: 1000 layers <= 1.2x the memory of 10, and the
memory-free H2-DNN's forward + backward within 2x the time of its stored-activation backward. Memory is the peak of
tensors saved for backward (:class:`cde_nets.diagnostics.SavedTensorMemory`).
``python -m cde_nets.benchmarks.memory_scaling [--tiny]``.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.fields import MS1, CubicFriction, Hamiltonian
from cde_nets.solvers.schemes import LM2

from .common import interleaved_medians, median_time, write

# memory-free discrete nets: name -> (field of dim n and L layers, scheme, discretize options)
DISCRETE = {
    "H2-DNN": (
        lambda n, L, g: Hamiltonian(n, layers=L, K="blockdiag", J="structured", generator=g),
        "symplectic_euler",
        {},
    ),
    "MS1": (lambda n, L, g: MS1(n, layers=L, generator=g), "symplectic_euler_qp", {}),
    "H verlet": (lambda n, L, g: Hamiltonian(n, layers=L, K="blockdiag", generator=g), "verlet", {}),
    "momentum": (
        lambda n, L, g: CubicFriction(n, layers=L, zero_init=False, generator=g),
        "momentum",
        {"momentum": (0.99, 1.0)},
    ),
    "lm2": (lambda n, L, g: CubicFriction(n, layers=L, zero_init=False, generator=g), LM2(k0=1.0), {}),
    "alf": (lambda n, L, g: Hamiltonian(n, layers=L, generator=g), "alf", {}),
}


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
                sol = block.solve(y0)
            sol.y.square().mean().backward()
            t = median_time(step, repeat=1 if tiny else 3, warmup=0 if tiny else 1)
            rows.append(
                {
                    "gradient": gradient,
                    "steps": steps,
                    "saved_bytes": mem.peak_bytes,
                    "time_s": t,
                    "nfe_forward": sol.stats["nfe_forward"],
                    "nfe_backward": sol.stats["nfe_backward"],
                }
            )
    summary = {}
    for gradient in ("adjoint", "backprop"):
        r = [x for x in rows if x["gradient"] == gradient]
        s = np.array([x["steps"] for x in r], dtype=float)
        m = np.array([x["saved_bytes"] for x in r], dtype=float)
        summary[gradient] = {
            "bytes_per_step": float(np.polyfit(s, m, 1)[0]),
            "ratio_max_to_min_steps": float(m[-1] / max(m[0], 1.0)),
        }
    discrete, discrete_summary = _discrete(dim, batch, (10, 20) if tiny else (10, 1000), tiny)
    payload = {
        "setting": f"Hamiltonian dim {dim}, batch {batch}, rk4, T=1",
        "rows": rows,
        "summary": summary,
        "discrete": discrete,
        "discrete_summary": discrete_summary,
        "goal": "adjoint ratio_max_to_min_steps <= 1.2; backprop linear; memory-free discrete: "
        "memory_ratio <= 1.2, H2-DNN time_ratio_to_stored <= 2",
    }
    write("memory_scaling", payload, out_dir)
    return payload


def _fwd_bwd(net, y0: torch.Tensor) -> None:
    net.zero_grad()
    net(y0).square().mean().backward()


def _discrete(dim: int, batch: int, depths: tuple[int, int], tiny: bool) -> tuple[list[dict], dict]:
    """Saved bytes of each memory-free net and of its stored-activation twin at both depths; forward + backward
    times of the two at the larger depth, interleaved."""
    rows, summary = [], {}
    for name, (make, scheme, kw) in DISCRETE.items():
        times = {}
        for L in depths:
            g = torch.Generator().manual_seed(0)
            field = make(dim, L, g)
            y0 = 0.5 * torch.randn(batch, dim, generator=g)
            nets = {free: discretize(field, scheme, memory_free=free, **kw) for free in (False, True)}
            for free, net in nets.items():
                mem = SavedTensorMemory(exclude=list(net.parameters()) + [y0])
                with mem:
                    y = net(y0)
                y.square().mean().backward()
                rows.append(
                    {
                        "net": name,
                        "scheme": net.scheme.name,
                        "layers": L,
                        "memory_free": free,
                        "saved_bytes": mem.peak_bytes,
                    }
                )

            if L == depths[-1]:
                steps = [functools.partial(_fwd_bwd, nets[free], y0) for free in (False, True)]
                times = dict(zip((False, True), interleaved_medians(steps, repeat=1 if tiny else 5, warmup=1)))
        for r in rows:
            if r["net"] == name and r["layers"] == depths[-1]:
                r["time_s"] = times[r["memory_free"]]
        free = {r["layers"]: r["saved_bytes"] for r in rows if r["net"] == name and r["memory_free"]}
        stored = {r["layers"]: r["saved_bytes"] for r in rows if r["net"] == name and not r["memory_free"]}
        summary[name] = {
            "memory_ratio": free[depths[-1]] / max(free[depths[0]], 1),
            "stored_over_free_memory": stored[depths[-1]] / max(free[depths[-1]], 1),
            "time_ratio_to_stored": times[True] / times[False],
        }
    return rows, summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| gradient | steps | saved for backward (MiB) | time ms |\n|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['gradient']} | {r['steps']} | {r['saved_bytes'] / 2**20:.3f} | {1e3 * r['time_s']:.1f} |")
    for k, v in res["summary"].items():
        print(
            f"{k}: {v['bytes_per_step'] / 1024:.1f} KiB per step, 1000/10 steps memory ratio "
            f"{v['ratio_max_to_min_steps']:.2f}"
        )
    print("\n| net | layers | memory-free | saved for backward (KiB) | fwd+bwd ms |\n|---|---|---|---|---|")
    for r in res["discrete"]:
        t = f"{1e3 * r['time_s']:.1f}" if "time_s" in r else "—"
        print(f"| {r['net']} | {r['layers']} | {r['memory_free']} | {r['saved_bytes'] / 1024:.1f} | {t} |")
    for k, v in res["discrete_summary"].items():
        print(
            f"{k}: memory-free memory, most / fewest layers {v['memory_ratio']:.2f}; stored / memory-free "
            f"{v['stored_over_free_memory']:.0f}x; time memory-free / stored {v['time_ratio_to_stored']:.2f}"
        )


if __name__ == "__main__":
    main()
