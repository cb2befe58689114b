"""Start ``world_size`` local processes with a torch.distributed process group (gloo on CPU by default).

The rendezvous is a file store in a temporary directory and gloo is pinned to the loopback interface, so nothing
leaves the machine. Each worker returns a picklable result; :func:`spawn` collects them in rank order and fails
loudly (with the worker's traceback) if any rank fails or the run exceeds ``timeout_s``.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _worker(rank: int, world_size: int, store: str, out: str, backend: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    result: dict
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
        try:
            result = {"ok": fn(rank, world_size, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the parent, which raises
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out) / f"rank{rank}.pt")


def spawn(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results in rank order."""
    if world_size < 1:
        raise ValueError(f"`world_size` must be >= 1, got {world_size}.")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="cde_nets_dist_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, tmp, backend, fn, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if alive:
            raise TimeoutError(f"ranks {alive} did not finish within {timeout_s} s (deadlock or too slow).")
        results = []
        for r in range(world_size):
            path = Path(tmp) / f"rank{r}.pt"
            if not path.exists():
                raise RuntimeError(f"rank {r} exited with code {procs[r].exitcode} and reported nothing.")
            res = torch.load(path, weights_only=False)
            if "error" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['error']}")
            results.append(res["ok"])
        return results
