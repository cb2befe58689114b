"""Shared helpers of the benchmark scripts: timing medians after warm-up, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def median_time(fn: Callable[[], object], repeat: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(
    fns: list[Callable[[], object]],
    repeat: int = 9,
    warmup: int = 2,
    number: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Median wall times of several functions run alternately, so machine drift hits them alike. Each sample
    times ``number`` calls in a row (for calls of a few milliseconds, where one call's time is mostly noise)
    and reports the time of one. ``clock=time.process_time`` times the process's CPU time instead, which the
    preemption of a loaded machine does not inflate (single-threaded runs)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = clock()
            for _ in range(number):
                fn()
            times[i].append((clock() - t0) / number)
    return [statistics.median(t) for t in times]


def machine() -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }


def write(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    os.replace(tmp, path)
    return path


class MLPField(torch.nn.Module):
    """The benchmarks' small neural ODE field ``f(t, y) = W_2 tanh(W_1 y + b_1) + b_2`` (``dim → width → dim``),
    the ``MLP 2-64-2`` of torchdiffeq's examples at the defaults."""

    def __init__(self, dim: int = 2, width: int = 64):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, width), torch.nn.Tanh(), torch.nn.Linear(width, dim))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)
