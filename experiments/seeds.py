"""A reproduction over seeds: one run per seed (in parallel processes when the cores allow), each kept as its own
JSON so that a killed run resumes seed by seed, and one result whose rows give the mean, the sample standard
deviation and the range over the seeds, the per-seed numbers beside them.

A row's ``ours`` becomes the mean over the seeds that measured it (a seed whose training diverged measured nothing:
its seed and the Trainer's message are kept in the row's ``diverged``); ``sd`` is the sample standard deviation
(``ddof = 1``; ``0`` for a single seed), ``min``/``max`` the range and ``per_seed`` the numbers in seed order. A
non-numeric row (``"holds"``, ``"yes"``) keeps its value where every seed agrees and lists them where they do not.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import nullcontext
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from .registry import THREADS, runner
from .report import write_result

__all__ = ["TRAINING", "default_seeds", "default_workers", "aggregate", "run_seeds", "seed_path"]

# The reproductions that train a network: their numbers move with the seed. The others are deterministic sweeps.
TRAINING = frozenset(
    {
        "hdnn_table1",
        "hdnn_fig4",
        "hdnn_table2",
        "ruseckas_circles",
        "hauser",
        "blog",
        "nais_digits",
        "mnist5k",
        "noise_robustness",
        "flows_2d",
    }
)
FULL_SEEDS = 5
# flows_2d trains two flows per density and seed: three seeds (the mean) fit its half-hour budget
FULL_SEEDS_OF = {"flows_2d": 3}


def default_seeds(name: str, size: str) -> int:
    """Five seeds (three for flows_2d) for a training reproduction at the full setting; one otherwise (quick and
    tiny keep one)."""
    return FULL_SEEDS_OF.get(name, FULL_SEEDS) if size == "full" and name in TRAINING else 1


def default_workers(n_seeds: int, threads: int | None = None) -> int:
    """As many parallel seeds as the cores this process may use hold runs of ``threads`` threads each."""
    return max(1, min(n_seeds, cores() // (threads or THREADS)))


def seed_path(out_dir: str | Path, name: str, size: str, seed: int) -> Path:
    return Path(out_dir) / "seeds" / f"{name}-{size}-seed{seed}.json"


def _one_seed(
    name: str, size: str, seed: int, out_dir: str, threads: int | None, resume: bool, snapshots: bool
) -> None:
    """Run one seed (in this process or a worker) and write its JSON; its figures go to a folder of its own."""
    import torch

    from cde_nets.train.trainer import snapshotting

    if threads:
        torch.set_num_threads(threads)
    path = seed_path(out_dir, name, size, seed)
    snap_dir = Path(out_dir) / "snapshots" / f"{name}-{size}-seed{seed}"
    with snapshotting(snap_dir, resume=resume) if snapshots else nullcontext():
        res = runner(name)(size=size, seed=seed, out_dir=str(path.parent / f"seed{seed}"))
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(write_result(res, path.parent / f"seed{seed}"), path)


def run_one(name: str, size: str, seed: int, out_dir: str, threads: int, resume: bool, snapshots: bool) -> dict:
    """One reproduction at one seed on ``threads`` intra-op threads (in this process or a worker), its training
    snapshotted under ``OUT/snapshots/<name>-<size>-seed<N>/``; returns its result, unwritten."""
    import torch

    from cde_nets.train.trainer import snapshotting

    torch.set_num_threads(threads)
    snap_dir = Path(out_dir) / "snapshots" / f"{name}-{size}-seed{seed}"
    with snapshotting(snap_dir, resume=resume) if snapshots else nullcontext():
        return runner(name)(size=size, seed=seed, out_dir=out_dir)


def cores() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def side_by_side(jobs: list[tuple[str, int, tuple]], budget: int, workers: int) -> Iterator[tuple[str, dict]]:
    """Run ``run_one(*args)`` for each ``(name, threads, args)`` in spawned processes, at most ``workers`` at a
    time and as many as ``budget`` cores hold their threads (a job wider than the budget runs alone), and yield
    ``(name, result)`` in the jobs' order as each becomes ready. A worker's exception is raised unchanged; the jobs
    not yet started are not started."""
    pending = list(jobs)
    running: dict[Future, tuple[str, int]] = {}
    ready: dict[str, dict] = {}
    order = [name for name, _, _ in jobs]
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=get_context("spawn")) as pool:
        try:
            while pending or running:
                used = sum(t for _, t in running.values())
                while pending and (not running or (used + pending[0][1] <= budget and len(running) < workers)):
                    name, t, args = pending.pop(0)
                    running[pool.submit(run_one, *args)] = (name, t)
                    used += t
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    name, _ = running.pop(fut)
                    ready[name] = fut.result()
                while order and order[0] in ready:
                    name = order.pop(0)
                    yield name, ready.pop(name)
        finally:
            for fut in running:
                fut.cancel()


def _finished(out_dir: str | Path, name: str, size: str, seed: int, log: Callable[[str], Any]) -> dict:
    res = json.loads(seed_path(out_dir, name, size, seed).read_text())  # what the JSON holds, not live objects
    log(f"{name} seed {seed}: {res['time_s']:.1f} s")
    return res


def _stats(values: list[Any]) -> dict:
    present = [v for v in values if v is not None]
    nums = [v for v in present if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if not nums or len(nums) != len(present):
        same = present and all(v == present[0] for v in present)
        return {"ours": present[0] if same else " / ".join(map(str, values))}
    mean = sum(nums) / len(nums)
    sd = math.sqrt(sum((v - mean) ** 2 for v in nums) / (len(nums) - 1)) if len(nums) > 1 else 0.0
    return {"ours": mean, "sd": sd, "min": min(nums), "max": max(nums)}


def aggregate(results: list[dict], time_s: float | None = None) -> dict:
    """One result from the per-seed ``results`` (one reproduction at one setting; seed order kept).

    ``time_s`` is the wall time to report; by default the sum of the seeds' own times."""
    if not results:
        raise ValueError("aggregate needs at least one per-seed result")
    first = results[0]
    if any(r["name"] != first["name"] or r["size"] != first["size"] for r in results):
        raise ValueError("aggregate takes results of one reproduction at one setting")
    settings: list[str] = []
    for r in results:
        settings += [row["setting"] for row in r["rows"] if row["setting"] not in settings]
    rows = []
    for setting in settings:
        each = [next((row for row in r["rows"] if row["setting"] == setting), None) for r in results]
        template = {k: v for k, v in next(row for row in each if row is not None).items() if k != "diverged"}
        values = [None if row is None else row["ours"] for row in each]
        agg = {**template, **_stats(values), "per_seed": values, "n_seeds": sum(v is not None for v in values)}
        gone = {r["seed"]: row["diverged"] for r, row in zip(results, each) if row is not None and "diverged" in row}
        if gone:  # seeds whose training went non-finite: no number, and the row says so
            agg["diverged"] = gone
        rows.append(agg)
    return {
        **first,
        "seeds": [r["seed"] for r in results],
        "seed_time_s": [r["time_s"] for r in results],
        "time_s": round(sum(r["time_s"] for r in results) if time_s is None else time_s, 2),
        "rows": rows,
    }


def run_seeds(
    name: str,
    size: str,
    seeds: list[int],
    out_dir: str | Path,
    *,
    workers: int = 1,
    threads: int | None = None,
    resume: bool = False,
    snapshots: bool = True,
    log: Callable[[str], Any] = print,
) -> dict:
    """Run ``name`` at ``size`` once per seed and return :func:`aggregate` of the runs.

    Every seed's result is written to ``OUT/seeds/<name>-<size>-seed<N>.json`` as it finishes; with ``resume`` a
    seed whose file exists is read back instead of run again (an unfinished one continues from its training
    snapshots). ``workers > 1`` runs the seeds in that many spawned processes.
    """
    t0 = time.perf_counter()
    done: dict[int, dict] = {}
    todo = []
    for seed in seeds:
        if resume and seed_path(out_dir, name, size, seed).exists():
            done[seed] = _finished(out_dir, name, size, seed, lambda m: log(m + " (finished before, read back)"))
        else:
            todo.append(seed)
    args = [(name, size, seed, str(out_dir), threads, resume, snapshots) for seed in todo]
    if workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=get_context("spawn")) as pool:
            futures = {seed: pool.submit(_one_seed, *a) for seed, a in zip(todo, args)}
            for seed, fut in futures.items():
                fut.result()  # a worker's exception is raised here, unchanged
                done[seed] = _finished(out_dir, name, size, seed, log)
    else:
        for seed, a in zip(todo, args):
            _one_seed(*a)
            done[seed] = _finished(out_dir, name, size, seed, log)
    # this invocation's wall time, unless some seeds ran before it: then the seeds' own times, summed
    return aggregate([done[s] for s in seeds], time_s=None if len(todo) < len(seeds) else time.perf_counter() - t0)
