"""Forward against reverse mode by the number of parameters: the time of one gradient of an MLP field 2 → w → 2.

Forward sensitivity (``gradient="forward"``) costs one tangent solve per parameter; backprop, checkpointed replay
and the adjoint one backward pass whatever their number. The crossover is the parameter count where forward mode
stops being the fastest. dopri5 at rtol 1e-6, batch 8, ``y0`` not differentiated, one thread, interleaved medians.

``python -m cde_nets.benchmarks.forward_sensitivity [--tiny]`` writes ``benchmarks/results/forward_sensitivity.json``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from cde_nets import odeint

from .common import interleaved_medians, write

MODES = ("forward", "backprop", "checkpoint", "adjoint")
WIDTHS = (2, 4, 8, 16, 32, 64, 128, 256, 400)  # p = 5w + 2: 12 ... 2002 parameters


class MLP(nn.Module):
    """``F(t, y) = W2 tanh(W1 y + b1) + b2`` with ``5w + 2`` parameters."""

    def __init__(self, width: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1, self.l2 = nn.Linear(2, width).double(), nn.Linear(width, 2).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-1]))

    def forward(self, t, y):
        return self.l2(torch.tanh(self.l1(y)))


def _gradient(func: MLP, y0: torch.Tensor, t: torch.Tensor, mode: str) -> list[torch.Tensor]:
    ys = odeint(func, y0, t, rtol=1e-6, atol=1e-8, method="dopri5", gradient=mode)
    return list(torch.autograd.grad(ys[-1].square().sum(), list(func.parameters())))


def _crossover(rows: list[dict]) -> float | None:
    """The parameter count where forward mode's time meets the fastest reverse mode's, interpolated on log-log
    axes between the last row where it is faster and the next (``None`` if it never is, or always is)."""
    for a, b in zip(rows, rows[1:]):
        ra, rb = a["forward_over_best_reverse"], b["forward_over_best_reverse"]
        if ra <= 1 < rb:
            x = math.log(a["params"]) + (math.log(b["params"]) - math.log(a["params"])) * (
                -math.log(ra) / (math.log(rb) - math.log(ra))
            )
            return math.exp(x)
    return None


def run(tiny: bool = False, out_dir=None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        y0 = torch.randn(8, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        t = torch.tensor([0.0, 1.0], dtype=torch.float64)
        rows = []
        for w in (2, 8) if tiny else WIDTHS:
            func = MLP(w)
            params = sum(p.numel() for p in func.parameters())
            grads = {m: _gradient(func, y0, t, m) for m in MODES}
            rel = {
                m: float(torch.cat([(a - b).reshape(-1) for a, b in zip(grads[m], grads["backprop"])]).norm())
                / float(torch.cat([b.reshape(-1) for b in grads["backprop"]]).norm())
                for m in MODES
            }
            repeat = 1 if tiny else (5 if params < 200 else 3)
            times = interleaved_medians(
                [lambda m=m, func=func: _gradient(func, y0, t, m) for m in MODES],
                repeat=repeat,
                warmup=0 if tiny else 1,
                clock=time.process_time,
            )
            row: dict = {"width": w, "params": params}
            row.update({f"{m}_s": s for m, s in zip(MODES, times)})
            row.update({f"{m}_rel_diff_from_backprop": rel[m] for m in MODES if m != "backprop"})
            row["forward_over_backprop"] = row["forward_s"] / row["backprop_s"]
            row["forward_over_best_reverse"] = row["forward_s"] / min(row[f"{m}_s"] for m in MODES[1:])
            rows.append(row)
        payload = {
            "setting": "MLP field 2 -> w -> 2 (tanh), p = 5w + 2 parameters; dopri5 rtol 1e-6 atol 1e-8 over [0, 1], "
            "batch 8, float64; one gradient of sum y(1)^2 with respect to the parameters (y0 not differentiated); "
            "one thread, CPU-time medians of interleaved runs",
            "rows": rows,
            "crossover_params": _crossover(rows),
            "time_s": time.perf_counter() - start,
        }
        write("forward_sensitivity", payload, out_dir)  # on one thread: the machine's record says so
    finally:
        torch.set_num_threads(threads)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| params | forward ms | backprop ms | checkpoint ms | adjoint ms | forward / best reverse |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['params']} | {1e3 * r['forward_s']:.1f} | {1e3 * r['backprop_s']:.1f} | "
            f"{1e3 * r['checkpoint_s']:.1f} | {1e3 * r['adjoint_s']:.1f} | {r['forward_over_best_reverse']:.2f} |"
        )
    print(f"crossover: {res['crossover_params']} parameters")


if __name__ == "__main__":
    main()
