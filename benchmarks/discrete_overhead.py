"""Discrete mode against a hand-written loop of the same layer equations, and against torchdiffeq's fixed grid.

H1, H2, momentum, cubic-friction and NAIS nets, and a weight-shared NAIS block that stops per sample; 64 layers,
(dim, batch) in {(4, 256), (64, 1024)}, forward and forward+backward. Goal: <= 1.1x the hand loop. Each sample
times a run of calls of about 50 ms, the functions taking turns; medians of 15 samples.
``python -m cde_nets.benchmarks.discrete_overhead [--tiny]``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cde_nets import ODEBlock, Stop, discretize
from cde_nets.fields import NAIS, CubicFriction, Hamiltonian

from .common import interleaved_medians, write

# The hand loops unbind each (L, ...) parameter once per call, as a careful hand-written loop would: indexing
# ``param[l]`` inside the loop costs a full (L, ...) zero gradient per layer in backward (O(L²) in depth).


def hand_h1(f, y):
    J, h = f.J, f.grid.h
    for K, b in zip(f.K.data.unbind(0), f.b.data.unbind(0)):
        y = y + h * (torch.tanh(y @ K.T + b) @ K) @ J.T
    return y


def hand_h2(f, y):
    n, h = f.dim // 2, f.grid.h
    p, q = y[:, :n], y[:, n:]
    for Kp, Kq, bp, bq in zip(*(t.data.unbind(0) for t in (f.K_p, f.K_q, f.b_p, f.b_q))):
        p = p - h * torch.tanh(q @ Kq.T + bq) @ Kq
        q = q + h * torch.tanh(p @ Kp.T + bp) @ Kp
    return torch.cat([p, q], 1)


def hand_friction(f, x):
    h, g = f.grid.h, f.gamma
    for W, b in zip(f.W.data.unbind(0), f.b.data.unbind(0)):
        x = x + h * (x @ W.T + b - g * x * x * x)
    return x


def hand_momentum(net, x):
    f, h = net.field, net.field.grid.h
    v = torch.zeros_like(x)
    m, eta = torch.sigmoid(net.a).unbind(0), F.softplus(net.b).unbind(0)
    for l, (W, b) in enumerate(zip(f.W.data.unbind(0), f.b.data.unbind(0))):
        v = m[l] * v + eta[l] * h * (x @ W.T + b - f.gamma * x * x * x)
        x = x + v
    return x


def hand_nais(f, x, u):
    """NAIS-Net, one piece per layer (eq. N3): x + h tanh(A_l x + B_l u + b_l), A_l = −R_lᵀR_l − εI."""
    eye = f.eps * torch.eye(f.dim, dtype=x.dtype)
    for R, B, b in zip(*(t.data.unbind(0) for t in (f.R, f.B, f.b))):
        x = x + f.grid.h * torch.tanh(x @ (-(R.T @ R) - eye).T + u @ B.T + b)
    return x


def hand_nais_stopping(f, x, u, steps, eps):
    """Weight-shared NAIS block with per-sample stopping (N §5.3), the way one would write it by hand: A and
    B u + b once, the convergence test ‖x_{i+1} − x_i‖ < eps each step, finished rows moved out of the batch."""
    R, B, b = f.R.data[0], f.B.data[0], f.b.data[0]
    A = -(R.T @ R) - f.eps * torch.eye(f.dim, dtype=R.dtype)
    c = u @ B.T + b
    idx, done_rows, done_x = torch.arange(len(x)), [], []
    for _ in range(steps):
        nxt = x + f.grid.h * torch.tanh(x @ A.T + c)
        with torch.no_grad():
            done = torch.linalg.vector_norm(nxt - x, dim=1) < eps
        x = nxt
        if bool(done.any()):
            done_rows.append(idx[done])
            done_x.append(x[done])
            keep = ~done
            idx, x, c = idx[keep], x[keep], c[keep]
            if not len(idx):
                break
    rows = torch.cat(done_rows + [idx])
    return torch.cat(done_x + [x])[torch.argsort(rows)]


def _cases(dim: int, batch: int, layers: int) -> tuple[torch.Tensor, list]:
    """``y0`` and ``(name, ours, hand, field for torchdiffeq or None)``, each taking the state only."""
    g = torch.Generator().manual_seed(dim)
    h1 = Hamiltonian(dim, layers=layers, T=1.0, generator=g)
    h2 = Hamiltonian(dim, layers=layers, T=1.0, K="blockdiag", generator=g)
    fr = CubicFriction(dim, layers=layers, gamma=0.5, zero_init=False, generator=g)
    mom = discretize(CubicFriction(dim, layers=layers, zero_init=False, generator=g), "momentum")
    nais = NAIS(dim, dim, layers=layers, T=1.0, generator=g)
    nais_net = discretize(nais, "euler")
    shared = NAIS(dim, dim, layers=1, T=1.0 / layers, generator=g)
    # eps = 1e-300: no sample converges, so the stopping loop runs all `layers` steps of the shared piece
    stopping = discretize(shared, "euler", stop=Stop(eps=1e-300, max_depth=layers))
    y0 = torch.randn(batch, dim, generator=g)
    u = torch.randn(batch, dim, generator=g)
    return y0, [
        ("H1", discretize(h1, "euler"), lambda y: hand_h1(h1, y), h1),
        ("H2", discretize(h2, "symplectic_euler"), lambda y: hand_h2(h2, y), None),
        ("cubic friction", discretize(fr, "euler"), lambda y: hand_friction(fr, y), fr),
        ("momentum", mom, lambda y: hand_momentum(mom, y), None),
        ("NAIS", lambda y: nais_net(y, u), lambda y: hand_nais(nais, y, u), None),
        (
            "NAIS shared, per-sample stopping",
            lambda y: stopping(y, u),
            lambda y: hand_nais_stopping(shared, y, u, layers, 1e-300),
            None,
        ),
    ]


def _calls(fn, target: float = 0.05) -> int:
    """How many calls of ``fn`` take about ``target`` seconds."""
    t0 = time.perf_counter()
    fn()
    return max(1, round(target / max(time.perf_counter() - t0, 1e-6)))


def _timed(fn, y0: torch.Tensor, backward: bool):
    if not backward:
        return lambda: fn(y0)
    return lambda: fn(y0).square().mean().backward()


def run(tiny: bool = False, out_dir=None) -> dict:
    layers = 4 if tiny else 64
    repeat, warmup = (1, 0) if tiny else (15, 3)
    rows = []
    for dim, batch in ((4, 8),) if tiny else ((4, 256), (64, 1024)):
        y0, cases = _cases(dim, batch, layers)
        for name, net, hand, field in cases:
            for mode in ("forward", "forward+backward"):
                backward = mode != "forward"
                fns = [_timed(net, y0, backward), _timed(hand, y0, backward)]
                if field is not None:  # torchdiffeq's fixed-grid Euler on the same field and grid
                    fns.append(_timed(ODEBlock(field, method="euler", gradient="backprop"), y0, backward))
                with torch.set_grad_enabled(backward):
                    t = interleaved_medians(fns, repeat, warmup, number=1 if tiny else _calls(fns[1]))
                row = {
                    "net": name,
                    "dim": dim,
                    "batch": batch,
                    "layers": layers,
                    "mode": mode,
                    "ours_s": t[0],
                    "hand_s": t[1],
                    "ratio_hand": t[0] / t[1],
                }
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
        print(
            f"| {r['net']} | {r['dim']}, {r['batch']} | {r['mode']} | {1e3 * r['ours_s']:.2f} | "
            f"{1e3 * r['hand_s']:.2f} | {r['ratio_hand']:.3f} | {td} |"
        )


if __name__ == "__main__":
    main()
