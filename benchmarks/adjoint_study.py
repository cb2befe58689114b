"""The adjoint study over every registered gradient method: the seeds' fields, stiff Van der Pol, chaotic Lorenz.

``python -m cde_nets.benchmarks.adjoint_study [--tiny]`` writes ``benchmarks/results/adjoint_study.json`` and prints
the markdown tables. The problems, losses and references are those of the reproduction
(:mod:`cde_nets.experiments.adjoint_study`, whose docstring states them): H2 Hamiltonian, cubic friction and NAIS
(input ``u = y0``) fields on swiss-roll points, Van der Pol at ``μ = 1000`` with ``radauIIA5``, and Lorenz over
growing horizons with the gradient norm's fitted exponential rate against ``λ₁ ≈ 0.906``. Every row carries its
``problem``; a refused cell carries ``refused`` (the gradient method's message).
"""

from __future__ import annotations

import argparse

import torch

from cde_nets.diagnostics import gradient_growth, markdown_table, to_jsonable
from cde_nets.experiments import adjoint_study as study

from .common import write

# the benchmark's run: the reproduction's quick problems, timed over three runs per cell
FULL = {
    **study.SETTINGS["quick"],
    "n": 32,
    "methods": ("dopri5", "rk4", "alf"),
    "repeat": 3,
    "horizons": (1.0, 2.0, 4.0, 8.0),
}
TINY = {
    **study.SETTINGS["tiny"],
    **dict(steps=(8,), methods=("dopri5", "alf"), tolerances=(1e-3,), models=("Hamiltonian H2 (16 pieces, T = 4)",)),
    "per_input_on_seeds": True,
}


def run(tiny: bool = False, out_dir=None) -> dict:
    s = TINY if tiny else FULL
    studies = study.seed_studies(s, 0)
    studies[study.STIFF] = study.stiff_study(s)
    horizons = study.chaotic_studies(s)
    for T, st in horizons.items():
        studies[f"{study.CHAOTIC}, T = {T:g}"] = st
    growth = gradient_growth(horizons, study.LYAPUNOV_LORENZ)
    rows = [{"problem": name, **r} for name, st in studies.items() for r in st["rows"]]
    payload = {
        "setting": "every gradient method registered in GRADIENTS, plus Backprop(steps='fixed'); float64. Seeds' "
        f"fields (16 pieces, T = 4; swiss roll n = {s['n']} padded to R^4, BCE of a fixed linear read-out): "
        f"reference backprop through dopri5 at rtol = atol = {s['ref_rtol']:g}, step sizes held. Van der Pol "
        "mu = 1000 on [0, 2] from (2, 0), loss x(T) + v(T), radauIIA5: reference backprop through radauIIA5 at 4x "
        "the finest row's steps. Lorenz (sigma 10, rho 28, beta 8/3 as parameters), 8 points near the attractor, "
        "loss mean z(T), dopri5 at 1e-6: reference dopri5 at 1e-10, step sizes held. Memory: peak bytes saved for "
        f"backward during the forward pass (saved_tensors_hooks); time: median of {s['repeat']} forward+backward.",
        "reference": {name: st["reference"] for name, st in studies.items()},
        "rows": rows,
        "growth": growth,
    }
    path = write("adjoint_study" + ("_tiny" if tiny else ""), to_jsonable(payload), out_dir)
    if not tiny:  # the work-precision figures of the gradients guide, beside the JSON
        seeds = {k: v for k, v in studies.items() if not k.startswith(study.CHAOTIC)}
        study.plot({**seeds, f"{study.CHAOTIC}, T = 1": horizons[1.0]}, path.parent)
        study.plot_growth(growth, path.parent)
    return {**payload, "studies": studies}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    res = run(a.tiny)
    for name, st in res["studies"].items():
        print(f"### {name}\n\n{markdown_table(st)}\n")
    print(study.growth_table(res["growth"]))


if __name__ == "__main__":
    main()
