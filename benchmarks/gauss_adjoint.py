"""The quadrature adjoint against the augmented adjoint and backprop by the number of parameters: the time and the
backward field evaluations of one gradient of an MLP field 2 → w → 2 (``p = 5w + 2`` parameters, ~10 to ~1e5).

``gradient="adjoint"`` solves backwards the state ``(y, a, g)`` with ``g`` the ``p`` parameter-gradient states:
each of its stages takes a full vector-Jacobian product and combines ``p``-sized stage vectors. ``gradient="gauss"``
solves ``a`` alone (products in ``y`` only) and adds ``m`` products in ``θ`` per backward step by Gauss-Legendre
quadrature, ``y`` read off the forward's stored dense output. The crossover is the parameter count where the
quadrature adjoint becomes faster than the augmented one. dopri5 at rtol 1e-6, atol 1e-8, batch 8, one thread,
CPU-time medians of interleaved runs.

``python -m cde_nets.benchmarks.gauss_adjoint [--tiny]`` writes ``benchmarks/results/gauss_adjoint.json``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from cde_nets import ODEBlock

from .common import interleaved_medians, write

MODES = ("backprop", "adjoint", "gauss")
WIDTHS = (2, 8, 32, 128, 512, 2048, 8192, 20000)  # p = 5w + 2: 12 ... 100002 parameters
# the field's cost against the parameters': the batch grows at a fixed width (the parameter-gradient arithmetic of the
# augmented solve does not grow with it, the field's evaluations do)
BATCH_WIDTH, BATCHES = 4096, (8, 64, 512, 2048)


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


def _gradient(func: MLP, y0: torch.Tensor, mode: str) -> tuple[list[torch.Tensor], dict]:
    block = ODEBlock(func, T=1.0, method="dopri5", rtol=1e-6, atol=1e-8, gradient=mode)
    sol = block.solve(y0)
    grads = list(torch.autograd.grad(sol.y.square().sum(), list(func.parameters())))
    return grads, sol.stats.as_dict()


def _crossover(rows: list[dict]) -> float | None:
    """The parameter count above which the quadrature adjoint is faster than the augmented one at every size
    measured: its time ratio interpolated to 1 on log-log axes between the last row where it is slower and the
    next (the smallest count if it is never slower; ``None`` if it is slower at the largest)."""
    slower = [i for i, r in enumerate(rows) if r["gauss_over_adjoint"] > 1]
    if not slower:
        return float(rows[0]["params"])
    i = slower[-1]
    if i == len(rows) - 1:
        return None
    a, b = rows[i], rows[i + 1]
    ra, rb = a["gauss_over_adjoint"], b["gauss_over_adjoint"]
    x = math.log(a["params"]) + (math.log(b["params"]) - math.log(a["params"])) * (
        math.log(ra) / (math.log(ra) - math.log(rb))
    )
    return math.exp(x)


def _flat(gs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in gs])


def _row(func: MLP, y0: torch.Tensor, tiny: bool) -> dict:
    """One size: each mode's gradient, counts and CPU time (interleaved medians)."""
    params = sum(p.numel() for p in func.parameters())
    got = {m: _gradient(func, y0, m) for m in MODES}
    ref = _flat(got["backprop"][0])
    repeat = 1 if tiny else (11 if params * len(y0) < 100_000 else 5)
    times = interleaved_medians(
        [lambda m=m: _gradient(func, y0, m) for m in MODES],
        repeat=repeat,
        warmup=0 if tiny else 1,
        clock=time.process_time,
    )
    row: dict = {"width": func.l1.out_features, "params": params}
    row.update({f"{m}_s": s for m, s in zip(MODES, times)})
    for m in MODES:
        stats = got[m][1]
        row[f"{m}_nfe_forward"] = stats["nfe_forward"]
        row[f"{m}_nfe_backward"] = stats["nfe_backward"]
        row[f"{m}_steps_backward"] = stats["steps_backward"]
    for m in ("adjoint", "gauss"):
        row[f"{m}_rel_diff_from_backprop"] = float((_flat(got[m][0]) - ref).norm() / ref.norm())
    row["gauss_over_adjoint"] = row["gauss_s"] / row["adjoint_s"]
    row["gauss_over_backprop"] = row["gauss_s"] / row["backprop_s"]
    return row


def run(tiny: bool = False, out_dir=None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        y0 = torch.randn(8, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        rows = [_row(MLP(w), y0, tiny) for w in ((2, 16) if tiny else WIDTHS)]
        batch_rows = []
        for b in (4,) if tiny else BATCHES:
            yb = torch.randn(b, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
            batch_rows.append({"batch": b, **_row(MLP(16 if tiny else BATCH_WIDTH), yb, tiny)})
        payload = {
            "setting": "MLP field 2 -> w -> 2 (tanh), p = 5w + 2 parameters; dopri5 rtol 1e-6 atol 1e-8 over [0, 1], "
            "batch 8, float64; one gradient of sum y(1)^2 with respect to the parameters (y0 not differentiated); "
            "gauss with its default 3-point rule; one thread, CPU-time medians of interleaved runs",
            "rows": rows,
            "crossover_params": _crossover(rows),
            "batch_setting": f"the same at width {BATCH_WIDTH} ({5 * BATCH_WIDTH + 2} parameters), the batch growing",
            "batch_rows": batch_rows,
            "time_s": time.perf_counter() - start,
        }
        write("gauss_adjoint", payload, out_dir)
    finally:
        torch.set_num_threads(threads)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| params | backprop ms | adjoint ms | gauss ms | gauss / adjoint | backward NFE adjoint | gauss |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['params']} | {1e3 * r['backprop_s']:.1f} | {1e3 * r['adjoint_s']:.1f} | {1e3 * r['gauss_s']:.1f} "
            f"| {r['gauss_over_adjoint']:.2f} | {r['adjoint_nfe_backward']} | {r['gauss_nfe_backward']} |"
        )
    print(f"crossover: {res['crossover_params']} parameters")
    print(res["batch_setting"])
    for r in res["batch_rows"]:
        ratios = f"gauss / adjoint {r['gauss_over_adjoint']:.2f}, gauss / backprop {r['gauss_over_backprop']:.2f}"
        print(f"batch {r['batch']}: {ratios}")


if __name__ == "__main__":
    main()
