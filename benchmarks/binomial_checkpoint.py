"""Memory against time for ``Checkpoint(budget=k)``: an MLP field over 1000 rk4 steps, ``k = 4, 8, 16, 32`` and
every step's state (``budget=None``).

Each configuration runs one forward and backward pass; the peak memory is the rise of the process's resident set
over it (Linux: ``/proc/self/clear_refs`` resets the high-water mark ``VmHWM``; allocations of 32 KiB and more
are mapped and unmapped one by one, so a freed state leaves no resident heap behind for the next configuration
to reuse). The recomputed steps come from the solve's statistics, beside the offline optimum
(:func:`~solvers.gradients.binomial.offline_recomputations`, Griewank's ``t(n + 1, k) − n``). Times: median of
``repeat`` runs (the peak: the least of them), one thread, in CPU time of the process (``time_s``, which the
preemption of a shared machine does not inflate) and wall time (``wall_s``).

``python -m cde_nets.benchmarks.binomial_checkpoint [--tiny]`` writes ``benchmarks/results/binomial_checkpoint.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from cde_nets import ODEBlock
from cde_nets.solvers.gradients import Checkpoint
from cde_nets.solvers.gradients.binomial import offline_recomputations

from .common import write

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _map_large_allocations(threshold: int = 32 * 1024) -> bool:
    """Fix glibc's mmap threshold (it otherwise rises after large frees, and freed memory stays resident)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold))
    except OSError:
        return False


def _rss_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class MLP(nn.Module):
    """``F(t, y) = W2 tanh(W1 y + b1) + b2``, ``dim → width → dim``."""

    def __init__(self, dim: int, width: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(dim, width), nn.Tanh(), nn.Linear(width, dim)).double()

    def forward(self, t, y):
        return self.net(y)


def _one(block: ODEBlock, y0: torch.Tensor) -> dict:
    sol = block.solve(y0)
    sol.y.square().sum().backward()
    return sol.stats.as_dict()


def run(tiny: bool = False, out_dir=None, repeat: int = 2) -> dict:
    torch.set_num_threads(1)
    steps, dim, width, batch = (12, 8, 16, 4) if tiny else (1000, 64, 64, 128)
    budgets: list[int | None] = [4, 8, 16, 32, None]
    repeat = 1 if tiny else repeat
    mapped = _map_large_allocations()
    field = MLP(dim, width)
    y0 = torch.randn(batch, dim, dtype=torch.float64) / dim**0.5
    state_bytes = y0.numel() * y0.element_size()
    rows = []
    # warm-up at full size, so that one-off growth of the process (allocator arenas, caches) is no configuration's
    _one(ODEBlock(field, T=1.0, method="rk4", step_size=1.0 / steps, gradient=Checkpoint(budget=32)), y0)
    field.zero_grad(set_to_none=True)
    for k in budgets:
        block = ODEBlock(field, T=1.0, method="rk4", step_size=1.0 / steps, gradient=Checkpoint(budget=k))
        times, walls, peaks = [], [], []
        stats: dict = {}
        for _ in range(repeat):
            before = _rss_kib("VmRSS")
            reset = _reset_peak()
            c0, t0 = time.process_time(), time.perf_counter()
            stats = _one(block, y0)
            times.append(time.process_time() - c0)
            walls.append(time.perf_counter() - t0)
            peak = _rss_kib("VmHWM")
            if reset and before is not None and peak is not None:
                peaks.append((peak - before) * 1024)
            field.zero_grad(set_to_none=True)
        n = stats["steps_forward"]
        rows.append(
            {
                "budget": "all" if k is None else k,
                "steps": n,
                "stored_states": stats["stored_states"],
                "stored_bytes": stats["stored_states"] * state_bytes,
                "recomputed_steps": stats["recomputed_steps"],
                "offline_optimum": 0 if k is None else offline_recomputations(n, k),
                "peak_rss_rise_bytes": min(peaks) if peaks else None,
                "peak_rss_rise_each_bytes": peaks,
                "time_s": statistics.median(times),
                "wall_s": statistics.median(walls),
            }
        )
    full = rows[-1]
    for r in rows:
        r["time_over_all"] = r["time_s"] / full["time_s"]
        if r["peak_rss_rise_bytes"] is not None and full["peak_rss_rise_bytes"]:
            r["peak_over_all"] = r["peak_rss_rise_bytes"] / full["peak_rss_rise_bytes"]
    payload = {
        "setting": {
            "method": "rk4",
            "steps": steps,
            "field": f"MLP {dim}-{width}-{dim}, tanh",
            "batch": batch,
            "dtype": "float64",
            "state_bytes": state_bytes,
            "repeat": repeat,
            "mmap_threshold_fixed": mapped,
        },
        "rows": rows,
    }
    write("binomial_checkpoint", payload, out_dir)
    return payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    res = run(tiny=args.tiny, out_dir=None if not args.tiny else Path("/tmp"))
    for r in res["rows"]:
        print(r)


if __name__ == "__main__":
    main()
