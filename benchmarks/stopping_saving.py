"""Saving of per-sample stopping (Ciccone et al. 2018, NAIS-Net, §5.3) on a batch where half the samples converge early.

A NAIS-Net block (``x(k+1) = x(k) + h tanh(A x(k) + B u + b)``, Alg. N1 projected, ``x(0) = 0``) is unrolled
with ``discretize(field, "euler", stop=Stop(eps, max_depth))``: each sample stops once ``‖x(i) − x(i−1)‖ <
eps`` and leaves the batch (compaction). Half the batch gets a tiny input ``u`` (its equilibrium is next to
``x(0)``: a few steps), half a large one (hundreds of steps). The baseline runs the same Euler step on the
whole batch until the slowest sample stops (batch-level stopping at ``max(depths)``). Reported: field rows
evaluated, and median wall time of forward and forward+backward. ``python -m cde_nets.benchmarks.stopping_saving
[--tiny]``.
"""

from __future__ import annotations

import argparse

import torch

from cde_nets import Stop, discretize
from cde_nets.fields import NAIS

from .common import interleaved_medians, write


class CountingNAIS(NAIS):
    """NAIS that counts the batch rows it evaluates."""

    rows_seen = 0

    def evaluate(self, l: int, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        self.rows_seen += x.shape[0]
        return super().evaluate(l, x, u)


def setup(dim: int, batch: int, eps: float, max_depth: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    field = CountingNAIS(dim, dim, T=1.0, eps=0.05, generator=g).double().project_()
    scale = torch.cat([torch.full((batch // 2, 1), 1e-4), torch.full((batch - batch // 2, 1), 2.0)])
    u = scale * torch.randn(batch, dim, generator=g, dtype=torch.float64)
    x0 = torch.zeros(batch, dim, dtype=torch.float64)
    net = discretize(field, "euler", stop=Stop(eps=eps, max_depth=max_depth))
    return field, net, x0, u


def whole_batch(field: NAIS, x0: torch.Tensor, u: torch.Tensor, depth: int) -> torch.Tensor:
    """The same Euler step on every sample until the slowest one stops."""
    x, h = x0, field.grid.h
    for _ in range(depth):
        x = x + h * field.evaluate(0, x, u)
    return x


def run(tiny: bool = False, out_dir=None) -> dict:
    dim, batch, eps, max_depth = (8, 16, 1e-4, 400) if tiny else (64, 1024, 1e-4, 2000)
    repeat, warmup = (1, 0) if tiny else (7, 1)
    field, net, x0, u = setup(dim, batch, eps, max_depth)

    sol = net.solve(x0, u=u)
    y, depths = sol.y, sol.depths
    rows_stop, field.rows_seen = field.rows_seen, 0
    slowest = int(depths.max())
    y_all = whole_batch(field, x0, u, slowest)
    rows_all, field.rows_seen = field.rows_seen, 0
    fast, slow = depths[: batch // 2].double(), depths[batch // 2 :].double()
    # Samples that stopped early keep moving in the baseline, by less than eps per step towards x̄.
    drift = float((y - y_all).detach().norm(dim=1).max())

    rows = []
    for mode in ("forward", "forward+backward"):

        def stop_fn(backward=mode != "forward"):
            out = net(x0, u=u)
            if backward:
                out.square().sum().backward()

        def all_fn(backward=mode != "forward"):
            out = whole_batch(field, x0, u, slowest)
            if backward:
                out.square().sum().backward()

        with torch.set_grad_enabled(mode != "forward"):
            t_stop, t_all = interleaved_medians([stop_fn, all_fn], repeat, warmup)
        rows.append({"mode": mode, "stop_s": t_stop, "whole_batch_s": t_all, "time_ratio": t_stop / t_all})
    field.rows_seen = 0
    payload = {
        "setup": {
            "field": "NAIS (Alg. N1, eps 0.05), tanh, h = 1, x(0) = 0",
            "dim": dim,
            "batch": batch,
            "stop_eps": eps,
            "max_depth": max_depth,
            "dtype": "float64",
            "inputs": "half |u| ~ 1e-4 (early), half |u| ~ 2 (late)",
        },
        "depth_early_half_mean": float(fast.mean()),
        "depth_late_half_mean": float(slow.mean()),
        "depth_max": slowest,
        "rows_stop": rows_stop,
        "rows_whole_batch": rows_all,
        "rows_ratio": rows_stop / rows_all,
        "max_state_difference": drift,
        "timings": rows,
    }
    write("stopping_saving", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    torch.set_num_threads(1)
    res = run(p.parse_args().tiny)
    print(
        f"depths: early half {res['depth_early_half_mean']:.1f}, "
        f"late half {res['depth_late_half_mean']:.1f}, max {res['depth_max']}"
    )
    print(f"rows: stop {res['rows_stop']}, whole batch {res['rows_whole_batch']} (ratio {res['rows_ratio']:.3f})")
    for r in res["timings"]:
        print(
            f"{r['mode']}: stop {1e3 * r['stop_s']:.1f} ms, whole batch {1e3 * r['whole_batch_s']:.1f} ms "
            f"(ratio {r['time_ratio']:.3f})"
        )


if __name__ == "__main__":
    main()
