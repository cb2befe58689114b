"""Pattern-dependent stopping: wall time against the fraction of samples that converge early.

A time-invariant NAIS block (one piece, eq. N3) ``x ← x + h tanh(A x + B u + b)`` runs with per-sample stopping
(``discretize(field, "euler", stop=Stop(eps, max_depth))``, Ciccone et al. 2018, §5.3). Samples started at their
equilibrium ``x* = −A⁻¹(B u + b)`` move by ``h |tanh(≈ 0)| < eps`` in the first step and stop at depth 1; the others
start far from it (slowest decay rate ``ε = 0.01`` of ``A``) and run all ``max_depth`` steps. With the batch
compacted as samples stop, the work is ``Σ depths`` row-steps, so the goal is time ∝ ``Σ depths``: a least-squares
line ``t = c Σ depths + t₀`` over the fractions 0, 0.25, 0.5, 0.75, 1 must fit every point within 20 %
(``max_rel_deviation = max |t − fit| / fit``). Also reported: the fit ``t = c Σ depths + d · steps + t₀`` with a
per-step cost ``d`` independent of the rows (``steps`` = loop length = max depth).
``python -m cde_nets.benchmarks.stopping_scaling [--tiny]``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from cde_nets import Stop, discretize
from cde_nets.fields import NAIS

from .common import interleaved_medians, write

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _inputs(field: NAIS, batch: int, fraction: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x0, u)``: the first ``round(fraction · batch)`` samples at their equilibrium, the rest 3 units away per
    coordinate."""
    u = torch.randn(batch, field.input_dim, generator=gen)
    with torch.no_grad():
        A = field.A(0).double()
        rhs = (u.double() @ field.B[0].double().T + field.b[0].double()).T
        x_star = torch.linalg.solve(A, -rhs).T.float()
    x0 = x_star + 3.0 * torch.randn(batch, field.dim, generator=gen)
    n_early = round(fraction * batch)
    x0[:n_early] = x_star[:n_early]
    return x0, u


def run(tiny: bool = False, out_dir=None) -> dict:
    dim, batch, max_depth = (8, 16, 4) if tiny else (128, 2048, 32)
    repeat, warmup = (1, 0) if tiny else (7, 2)
    eps = 1e-3
    gen = torch.Generator().manual_seed(0)
    field = NAIS(dim, dim, layers=1, T=0.1, generator=gen).project_()  # h = 0.1, Condition N1 holds for h <= 1
    net = discretize(field, "euler", stop=Stop(eps=eps, max_depth=max_depth))
    cases = []
    for fraction in FRACTIONS:
        x0, u = _inputs(field, batch, fraction, gen)
        with torch.no_grad():
            depths = net.solve(x0, u).depths
        cases.append((fraction, x0, u, int(depths.sum()), int((depths == 1).sum()), int(depths.max())))
    rows = []
    for mode in ("forward", "forward+backward"):

        def call(x0, u, mode=mode):
            if mode == "forward":
                return lambda: net(x0, u)
            return lambda: net(x0, u).square().mean().backward()

        with torch.set_grad_enabled(mode != "forward"):
            times = interleaved_medians([call(x0, u) for _, x0, u, *_ in cases], repeat, warmup)
        for (fraction, _, _, sum_depths, n_early, steps), t in zip(cases, times):
            rows.append(
                {
                    "mode": mode,
                    "fraction_early": fraction,
                    "early_samples": n_early,
                    "sum_depths": sum_depths,
                    "steps": steps,
                    "time_s": t,
                }
            )
    fits = {}
    for mode in ("forward", "forward+backward"):
        r = [x for x in rows if x["mode"] == mode]
        s = np.array([x["sum_depths"] for x in r], dtype=float)
        t = np.array([x["time_s"] for x in r])
        c, t0 = np.polyfit(s, t, 1)
        fit = c * s + t0
        for x, f in zip(r, fit):
            x["fit_s"] = float(f)
        # A per-step cost independent of the rows (loop overhead) shows up as an extra term in the loop length.
        X = np.stack([s, [x["steps"] for x in r], np.ones_like(s)], 1)
        coef = np.linalg.lstsq(X, t, rcond=None)[0]
        fit3 = X @ coef
        fits[mode] = {
            "seconds_per_row_step": float(c),
            "intercept_s": float(t0),
            "max_rel_deviation": float(np.max(np.abs(t - fit) / fit)),
            "with_step_cost": {
                "seconds_per_row_step": float(coef[0]),
                "seconds_per_step": float(coef[1]),
                "intercept_s": float(coef[2]),
                "max_rel_deviation": float(np.max(np.abs(t - fit3) / fit3)),
            },
            "time_ratio_full_to_early": float(t[0] / t[-1]),
        }
    payload = {
        "setting": f"NAIS dim {dim}, input {dim}, one piece, h = 0.1, euler, batch {batch}, eps {eps}, "
        f"max_depth {max_depth}; early samples start at equilibrium (depth 1)",
        "goal": "max_rel_deviation <= 0.2 (time proportional to sum of depths)",
        "rows": rows,
        "fit": fits,
    }
    write("stopping_scaling", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| mode | fraction early | Σ depths | time ms | fit ms | deviation |\n|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['mode']} | {r['fraction_early']:.2f} | {r['sum_depths']} | {1e3 * r['time_s']:.2f} | "
            f"{1e3 * r['fit_s']:.2f} | {r['time_s'] / r['fit_s'] - 1:+.1%} |"
        )
    for mode, f in res["fit"].items():
        print(
            f"{mode}: {1e9 * f['seconds_per_row_step']:.1f} ns per row-step, intercept "
            f"{1e3 * f['intercept_s']:.2f} ms, max deviation {f['max_rel_deviation']:.1%}"
        )
        g = f["with_step_cost"]
        print(
            f"  with a per-step cost: {1e9 * g['seconds_per_row_step']:.1f} ns per row-step, "
            f"{1e3 * g['seconds_per_step']:.3f} ms per step, max deviation {g['max_rel_deviation']:.1%}"
        )


if __name__ == "__main__":
    main()
