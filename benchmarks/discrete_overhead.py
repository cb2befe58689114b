"""Discrete mode against a hand-written loop of the same layer equations, and against torchdiffeq's fixed grid.

Issue 7, item 1: H1, H2, momentum and cubic-friction nets, 64 layers, (dim, batch) in {(4, 256), (64, 1024)},
forward and forward+backward. Goal: <= 1.1x the hand loop. ``python -m benchmarks.discrete_overhead [--tiny]``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from cde_nets import ODEBlock, discretize
from cde_nets.fields import CubicFriction, Hamiltonian

from .common import interleaved_medians, write


def hand_h1(f, y):
    J, h = f.J, f.grid.h
    for l in range(f.layers):
        K, b = f.K.data[l], f.b.data[l]
        y = y + h * (torch.tanh(y @ K.T + b) @ K) @ J.T
    return y


def hand_h2(f, y):
    n, h = f.dim // 2, f.grid.h
    p, q = y[:, :n], y[:, n:]
    for l in range(f.layers):
        Kp, Kq = f.K_p.data[l], f.K_q.data[l]
        p = p - h * torch.tanh(q @ Kq.T + f.b_q.data[l]) @ Kq
        q = q + h * torch.tanh(p @ Kp.T + f.b_p.data[l]) @ Kp
    return torch.cat([p, q], 1)


def hand_friction(f, x):
    h, g = f.grid.h, f.gamma
    for l in range(f.layers):
        x = x + h * (x @ f.W.data[l].T + f.b.data[l] - g * x * x * x)
    return x


def hand_momentum(net, x):
    f, h = net.field, net.field.grid.h
    v = torch.zeros_like(x)
    for l in range(f.layers):
        v = torch.sigmoid(net.a[l]) * v + F.softplus(net.b[l]) * h * f.evaluate(l, x)
        x = x + v
    return x


def run(tiny: bool = False, out_dir=None) -> dict:
    layers = 4 if tiny else 64
    repeat, warmup = (1, 0) if tiny else (15, 3)
    rows = []
    for dim, batch in ((4, 8),) if tiny else ((4, 256), (64, 1024)):
        g = torch.Generator().manual_seed(dim)
        h1 = Hamiltonian(dim, layers=layers, T=1.0, generator=g)
        h2 = Hamiltonian(dim, layers=layers, T=1.0, K="blockdiag", generator=g)
        fr = CubicFriction(dim, layers=layers, gamma=0.5, zero_init=False, generator=g)
        mom = discretize(CubicFriction(dim, layers=layers, zero_init=False, generator=g), "momentum")
        y0 = torch.randn(batch, dim, generator=g)
        cases = [("H1", discretize(h1, "euler"), lambda y, f=h1: hand_h1(f, y), h1),
                 ("H2", discretize(h2, "symplectic_euler"), lambda y, f=h2: hand_h2(f, y), None),
                 ("cubic friction", discretize(fr, "euler"), lambda y, f=fr: hand_friction(f, y), fr),
                 ("momentum", mom, lambda y, n=mom: hand_momentum(n, y), None)]
        for name, net, hand, field in cases:
            for mode in ("forward", "forward+backward"):
                def wrap(fn):
                    if mode == "forward":
                        return lambda: fn(y0)
                    return lambda: fn(y0).square().mean().backward()

                fns = [wrap(net), wrap(hand)]
                if field is not None:  # torchdiffeq's fixed-grid Euler on the same field and grid
                    block = ODEBlock(field, method="euler", gradient="backprop")
                    fns.append(wrap(block))
                with torch.set_grad_enabled(mode != "forward"):
                    t = interleaved_medians(fns, repeat, warmup)
                row = {"net": name, "dim": dim, "batch": batch, "layers": layers, "mode": mode,
                       "ours_s": t[0], "hand_s": t[1], "ratio_hand": t[0] / t[1]}
                if field is not None:
                    row.update(torchdiffeq_euler_s=t[2], ratio_torchdiffeq_to_hand=t[2] / t[1])
                rows.append(row)
    payload = {"goal": "ratio_hand <= 1.1", "rows": rows}
    write("discrete_overhead", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| net | dim, batch | mode | ours ms | hand ms | ours / hand | torchdiffeq euler / hand |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        td = f"{r['ratio_torchdiffeq_to_hand']:.2f}" if "ratio_torchdiffeq_to_hand" in r else "—"
        print(f"| {r['net']} | {r['dim']}, {r['batch']} | {r['mode']} | {1e3 * r['ours_s']:.2f} | "
              f"{1e3 * r['hand_s']:.2f} | {r['ratio_hand']:.3f} | {td} |")


if __name__ == "__main__":
    main()
