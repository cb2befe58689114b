"""Measure how long each reproduction takes at a setting, the way the listing states it, and store the times.

``python -m cde_nets.experiments.timings --size tiny|quick|full [--only NAME ...]`` runs each reproduction in a
fresh process (``cde-nets experiments NAME --SIZE --threads N --no-snapshots`` into a temporary folder, on the
torch threads the command gives it by default: one, two for nais_digits) and writes its wall time to
``experiments/timings.json`` with the date, the machine's facts, the 1-minute load average before and after the
run and the process's CPU time, so that a time taken on a busy machine says so. ``--main-job`` times the README's
main job in a fresh clone of this repository's ``HEAD``: the README's install runs first, untimed, then the main
job (``.venv/bin/python -m cde_nets.experiments all --quick``) is timed as the README runs it. ``cde-nets
experiments`` lists these times; its ``all`` row is the sum of its column.

Run it on a quiet machine (load below 1.5): the listing is only as true as the machine was idle.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMINGS = Path(__file__).parent / "timings.json"
SIZES = ("tiny", "quick", "full")
_ROOT = Path(__file__).resolve().parent.parent  # the repository, for --main-job


def machine() -> dict:
    """Facts that make a time comparable: CPU, cores, Python, torch, threads."""
    import torch

    from .registry import THREADS

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": THREADS,
        "platform": platform.platform(),
    }


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _timed(cmd: list[str], **kw) -> dict:
    """Run ``cmd`` (a child process): its wall time, its CPU time (user + system, its children included), and the
    load average before and after."""
    load, t0, c0 = _load(), time.perf_counter(), os.times()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, **kw)
    seconds, c1 = time.perf_counter() - t0, os.times()
    cpu = c1.children_user - c0.children_user + c1.children_system - c0.children_system
    return {"seconds": round(seconds, 1), "cpu_s": round(cpu, 1), "load_before": load, "load_after": _load()}


def time_reproduction(name: str, size: str, seed: int = 0) -> dict:
    """Wall time of one reproduction at ``size`` in a fresh process on the threads the command gives it by default,
    with the date and the load around it."""
    from .registry import threads_for

    threads = threads_for(name)
    flag = [] if size == "full" else [f"--{size}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory(prefix="timing_") as out:
        cmd = [sys.executable, "-m", "cde_nets.experiments", name, *flag, "--seed", str(seed)]
        cmd += ["--threads", str(threads), "--no-snapshots", "--out", out]
        timed = _timed(cmd, env=env)
    return {**timed, "date": _now(), "threads": threads}


def main_job_command() -> str:
    """The README's main-job command line (the install, then ``experiments all --quick`` after its last ``&&``)."""
    readme = (_ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("python3") and "all --quick" in line]
    if len(lines) != 1:
        raise SystemExit("README.md must hold exactly one main-job command (python3... experiments all --quick).")
    return lines[0]


def time_main_job() -> dict:
    """The README's main job, timed from a fresh clone of ``HEAD`` after the README's install (what a newcomer runs
    first); the install is not timed."""
    from .registry import THREADS, THREADS_OF

    install, job = main_job_command().rsplit(" && ", 1)
    with tempfile.TemporaryDirectory(prefix="main_job_") as tmp:
        clone = Path(tmp) / "cde_nets"
        subprocess.run(["git", "clone", "-q", str(_ROOT), str(clone)], check=True)
        subprocess.run(["bash", "-c", install], cwd=clone, check=True, stdout=subprocess.DEVNULL)
        timed = _timed(["bash", "-c", job], cwd=clone)
    threads = {"default": THREADS, **THREADS_OF}  # what each reproduction ran on (the command's defaults)
    return {**timed, "date": _now(), "threads": threads, "command": shlex.split(job)[-4:]}


def load_timings(path: Path = TIMINGS) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    from .registry import REPRODUCTIONS

    p = argparse.ArgumentParser(prog="python -m cde_nets.experiments.timings", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=SIZES, help="setting to time (every reproduction, or those of --only)")
    p.add_argument("--only", nargs="*", help="reproductions to time (default: all)")
    p.add_argument("--main-job", action="store_true", help="time the README's main job in a fresh clone")
    p.add_argument("--out", default=str(TIMINGS), help="the timings file to update (default: experiments/timings.json)")
    a = p.parse_args(argv)
    if a.size is None and not a.main_job:
        p.error("give --size and/or --main-job")
    names = a.only or list(REPRODUCTIONS)
    unknown = set(names) - set(REPRODUCTIONS)
    if unknown:
        p.error(f"unknown reproduction(s) {sorted(unknown)}; choose from {list(REPRODUCTIONS)}")
    path = Path(a.out)
    data = load_timings(path)
    facts = machine()
    if a.size is not None:
        for name in names:
            entry = {**time_reproduction(name, a.size), "machine": facts}
            data.setdefault(a.size, {})[name] = entry
            print(f"{name} --{a.size}: {entry['seconds']} s (load {entry['load_before']})", flush=True)
            path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    if a.main_job:
        data["main_job"] = {**time_main_job(), "machine": facts}
        print(f"main job: {data['main_job']['seconds']} s", flush=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
