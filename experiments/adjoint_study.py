"""The adjoint study: every registered gradient method on the seeds' fields, a stiff problem and a chaotic one.

``cde_nets.diagnostics.adjoint_study`` computes the parameter gradient of each problem's loss with every gradient
method registered in ``GRADIENTS`` when it runs (plus ``Backprop(steps="fixed")``), and compares it with a float64
reference: relative gradient error, NFE forward/backward, time and peak bytes saved for backward; a cell a gradient
method refuses is a row carrying its refusal. Problems:

- the seeds' fields, 16 pieces over ``T = 4``, on swiss-roll points padded to ``R⁴`` with the binary cross-entropy of
  a fixed linear read-out: the H2 Hamiltonian field (Galimberti et al.), cubic friction, NAIS with its input
  ``u = y0`` (Ciccone et al. 2018); reference: backprop through dopri5 at ``rtol = atol = 1e-10``, step sizes held on
  their mesh;
- stiff Van der Pol ``x'' − μ(1 − x²)x' + x = 0``, ``μ = 1000`` (a parameter), from ``(2, 0)`` over ``[0, 2]``, with
  the L-stable implicit ``radauIIA5`` at fixed steps; loss ``x(T) + v(T)``; reference: backprop through
  ``radauIIA5`` at a 4x finer step than the finest row (dopri5 at ``1e-10`` took 13700 evaluations and was 1.7e-7
  off the converged value there);
- chaotic Lorenz (σ = 10, ρ = 28, β = 8/3, the three parameters) from points on the attractor, over horizons up to
  ``T = 12``; loss: the mean of ``z(T)``; dopri5 at ``1e-6``, at most 2000 steps a solve; reference: dopri5 at
  ``1e-10``, step sizes held. Every gradient grows like ``e^{λ₁T}``
  (``λ₁ ≈ 0.906``): the fitted rates are reported per method.

Expected (Chen et al. 2018; Zhuang et al. 2020; Ma et al. 2021): the exact-for-the-solver gradients (backprop,
checkpoint, symplectic, forward, reversible) match each other to rounding and the ODE's gradient to the solver's
tolerance; the continuous adjoint is limited by its backward solve, hopeless on the chaotic problem past a few
Lyapunov times (its backward reconstruction of ``y`` expands at ``−Σλᵢ ≈ 13.7``); memory grows with the steps for
backprop only.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from cde_nets.datasets import swiss_roll
from cde_nets.diagnostics import adjoint_study, gradient_growth, markdown_table, registered_gradients
from cde_nets.fields import NAIS, CubicFriction, Hamiltonian
from cde_nets.solvers.gradients import Backprop

from .common import threads
from .report import result, row, save_figure

LYAPUNOV_LORENZ = 0.9056  # Sprott (2003), "Chaos and time-series analysis", Table A.1

# quick: 68 s on the 2-core development machine at a load of 3 (forward mode and the Lorenz horizons cost
# most). Horizons start at 1: over [1, 3] the gradient norm of this loss barely grows (a fitted rate of 0.02), the
# exponential regime shows from T = 4.
SETTINGS = {
    "tiny": dict(
        n=16,
        tolerances=(1e-3, 1e-5),
        steps=(),
        methods=("dopri5",),
        repeat=1,
        ref_rtol=1e-8,
        stiff_steps=(10,),
        horizons=(0.5,),
        # the test suite's setting: two seeds' fields, and forward mode (one tangent per parameter, 192 and 320
        # here) only where the parameters are few (Van der Pol, Lorenz)
        models=("Hamiltonian H2 (16 pieces, T = 4)", "cubic friction (16 pieces, T = 4)"),
        per_input_on_seeds=False,
    ),
    "quick": dict(
        n=16,
        tolerances=(1e-3, 1e-5),
        steps=(16,),
        methods=("dopri5", "alf"),
        repeat=1,
        ref_rtol=1e-10,
        stiff_steps=(10, 40),
        horizons=(1.0, 2.0, 4.0),
    ),
    "full": dict(
        n=64,
        tolerances=(1e-3, 1e-5, 1e-7),
        steps=(16, 64),
        methods=("dopri5", "rk4", "alf"),
        repeat=3,
        ref_rtol=1e-10,
        stiff_steps=(10, 40, 160),
        horizons=(1.0, 2.0, 4.0, 8.0, 12.0),
    ),
}

MODELS = {
    "Hamiltonian H2 (16 pieces, T = 4)": lambda: Hamiltonian(
        4, layers=16, T=4.0, K="blockdiag", init_std=1.0, generator=torch.Generator().manual_seed(0)
    ).double(),
    "cubic friction (16 pieces, T = 4)": lambda: CubicFriction(
        4,
        layers=16,
        T=4.0,
        gamma=0.1,
        learn_gamma=False,
        zero_init=False,
        init_std=0.5,
        generator=torch.Generator().manual_seed(0),
    ).double(),
    "NAIS with input u (16 pieces, T = 4)": lambda: NAIS(
        4, 4, layers=16, T=4.0, init_std=0.3, generator=torch.Generator().manual_seed(0)
    ).double(),
}

STIFF = "Van der Pol mu = 1000, radauIIA5"
CHAOTIC = "Lorenz (sigma 10, rho 28, beta 8/3)"


class VanDerPol(nn.Module):
    """``x' = v``, ``v' = μ(1 − x²)v − x`` with ``μ`` a parameter."""

    def __init__(self, mu: float):
        super().__init__()
        self.mu = nn.Parameter(torch.tensor(mu, dtype=torch.float64))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, v = y[:, :1], y[:, 1:]
        return torch.cat([v, self.mu * (1 - x**2) * v - x], 1)


class Lorenz(nn.Module):
    """``x' = σ(y − x)``, ``y' = x(ρ − z) − y``, ``z' = xy − βz`` with ``σ, ρ, β`` parameters (Lorenz 1963)."""

    def __init__(self, sigma: float = 10.0, rho: float = 28.0, beta: float = 8.0 / 3.0):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([sigma, rho, beta], dtype=torch.float64))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s, r, b = self.theta
        x, yy, z = y[:, 0], y[:, 1], y[:, 2]
        return torch.stack([s * (yy - x), x * (r - z) - yy, x * yy - b * z], 1)


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    split = swiss_roll(n=2 * n, dim=4, seed=seed, dtype=torch.float64)
    readout = torch.randn(4, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    return split.x_train[:n], split.y_train[:n].to(torch.float64), readout


def _lorenz_start(n: int) -> torch.Tensor:
    """``n`` points near the attractor: ``(1 + i/10, 1, 1)`` after a transient of 10 time units (rk4, ``h = 0.01``)."""
    f, y = Lorenz(), torch.ones(n, 3, dtype=torch.float64)
    y[:, 0] += 0.1 * torch.arange(n)
    h = 0.01
    with torch.no_grad():
        for _ in range(1000):
            k1 = f(None, y)
            k2 = f(None, y + h / 2 * k1)
            k3 = f(None, y + h / 2 * k2)
            k4 = f(None, y + h * k3)
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return y


def seed_studies(s: dict, seed: int) -> dict[str, dict]:
    """The seeds' fields on the swiss roll: dopri5 over the tolerances, the fixed-step methods over the steps."""
    x, label, readout = _data(s["n"], seed)

    def loss_fn(yT, target):
        return torch.nn.functional.binary_cross_entropy_with_logits(yT @ readout, target)

    gradients = registered_gradients([Backprop(steps="fixed")])
    if not s.get("per_input_on_seeds", True):
        gradients = [g for g in gradients if not g.per_input]
    studies = {}
    for name in s.get("models", MODELS):
        studies[name] = adjoint_study(
            MODELS[name],
            (x, label),
            loss_fn,
            tolerances=s["tolerances"],
            steps=s["steps"],
            methods=s["methods"],
            gradients=gradients,
            repeat=s["repeat"],
            reference=dict(rtol=s["ref_rtol"], atol=s["ref_rtol"]),
            solve={"u": x} if name.startswith("NAIS") else None,
        )
    return studies


def stiff_study(s: dict) -> dict:
    """Van der Pol at μ = 1000 over [0, 2] with radauIIA5; the reference at 4x the finest row's steps."""
    y0 = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    T, finest = 2.0, max(s["stiff_steps"])
    return adjoint_study(
        lambda: VanDerPol(1000.0),
        y0,
        lambda y: y.sum(),
        tolerances=(),
        steps=s["stiff_steps"],
        methods=("radauIIA5",),
        gradients=registered_gradients([Backprop(steps="fixed")]),
        repeat=s["repeat"],
        reference=dict(method="radauIIA5", step_size=T / (4 * finest)),
        solve={"T": T},
    )


def chaotic_studies(s: dict) -> dict[float, dict]:
    """Lorenz from 8 points near the attractor over each horizon: dopri5 at rtol = atol = 1e-6, reference 1e-10."""
    y0 = _lorenz_start(8)
    return {
        T: adjoint_study(
            Lorenz,
            y0,
            lambda y: y[:, 2].mean(),
            tolerances=(1e-6,),
            methods=("dopri5",),
            gradients=registered_gradients([Backprop(steps="fixed")]),
            repeat=s["repeat"],
            reference=dict(rtol=1e-10, atol=1e-10, options={"max_num_steps": 10**5}),
            # the adjoint's backward solve diverges: fail, not crawl
            solve={"T": T, "options": {"max_num_steps": 2000}},
        )
        for T in s["horizons"]
    }


def _rows(studies: dict[str, dict]) -> list[dict]:
    rows = []
    for name, st in studies.items():
        for r in st["rows"]:
            where = f"rtol {r['rtol']:.0e}" if r["rtol"] is not None else f"{r['steps']} steps"
            setting = f"{name}: {r['mode']} {r['method']}, {where}"
            keys = ("mode", "method", "rtol", "steps", "status", "nfe_forward", "nfe_backward", "time_s")
            extra = {k: r[k] for k in (*keys, "peak_saved_bytes", "grad_norm")} | {"model": name}
            if r["status"] != "ok":
                message = r.get("refused") or r.get("error")
                rows.append(row(setting, None, f"{r['status']}: {message}", message=message, **extra))
            else:
                rows.append(row(setting, None, r["rel_grad_error"], "rel. grad error", **extra))
    return rows


def plot(studies: dict[str, dict], out_dir) -> list[str]:
    """Work-precision: relative gradient error against time, and against peak memory saved for backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    for key, label, scale in (("time_s", "time per gradient (s)", 1.0), ("peak_saved_bytes", "peak saved (KiB)", 1024)):
        fig, axes = plt.subplots(1, len(studies), figsize=(4.6 * len(studies), 4.0), squeeze=False)
        for ax, (name, st) in zip(axes[0], studies.items()):
            groups: dict[str, list] = {}
            for r in st["rows"]:
                if r["status"] == "ok":
                    groups.setdefault(f"{r['mode']} {r['method']}", []).append(r)
            for i, (g, rs) in enumerate(sorted(groups.items())):
                xs = [max(r[key] / scale, 1e-3) for r in rs]
                ax.loglog(xs, [max(r["rel_grad_error"], 1e-17) for r in rs], "os^vD<>p*h"[i % 10] + "-", label=g)
            ax.set(xlabel=label, ylabel="relative gradient error", title=name)
            ax.title.set_fontsize(8)
            ax.legend(fontsize=5)
        figures.append(save_figure(fig, out_dir, f"adjoint_study_{'time' if key == 'time_s' else 'memory'}"))
    return figures


def plot_growth(growth: dict, out_dir) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(growth["horizons"], growth["reference"]["norms"], "k-", lw=3, alpha=0.4, label="reference")
    for name, m in growth["modes"].items():
        if m["horizons"]:
            ax.semilogy(m["horizons"], m["norms"], "o--", label=f"{name} (rate {m['rate'] or float('nan'):.2f})")
    T = growth["horizons"]
    ref0 = growth["reference"]["norms"][0]
    ax.semilogy(T, [ref0 * 2.718281828 ** (growth["lyapunov"] * (t - T[0])) for t in T], "k:", label="e^{0.906 T}")
    ax.set(xlabel="horizon T", ylabel="‖dL/dθ‖", title="Lorenz: gradient norm against horizon")
    ax.legend(fontsize=6)
    return save_figure(fig, out_dir, "adjoint_study_lorenz_growth")


def growth_table(growth: dict) -> str:
    """The gradient norm per horizon and method, and the fitted rate against λ₁, as a markdown table."""
    hs = growth["horizons"]
    lines = ["| method | " + " | ".join(f"T = {h:g}" for h in hs) + " | fitted rate |", "|---" * (len(hs) + 2) + "|"]
    ref = growth["reference"]
    rate = "" if ref["rate"] is None else f"{ref['rate']:.3f}"
    lines.append("| reference | " + " | ".join(f"{v:.3g}" for v in ref["norms"]) + f" | {rate} |")
    for name, m in growth["modes"].items():
        cells = []
        for h in hs:
            if h in m["messages"]:
                cells.append(m["messages"][h].split(";")[0][:60].replace("|", "/"))
            else:
                i = m["horizons"].index(h)
                cells.append(f"{m['norms'][i]:.3g} (err {m['errors'][i]:.0e})")
        rate = "" if m["rate"] is None else f"{m['rate']:.3f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {rate} |")
    return "\n".join(lines)


def run(size: str = "quick", seed: int = 0, out_dir="results") -> dict:
    threads()
    s = SETTINGS[size]
    t0 = time.perf_counter()
    studies = seed_studies(s, seed)
    studies[STIFF] = stiff_study(s)
    horizons = chaotic_studies(s)
    studies[f"{CHAOTIC}, T = {min(horizons):g}"] = horizons[min(horizons)]
    growth = gradient_growth(horizons, LYAPUNOV_LORENZ)
    tables = "\n\n".join(f"### {name}\n\n{markdown_table(st)}" for name, st in studies.items())
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "adjoint_study.md").write_text(f"{tables}\n\n### {CHAOTIC}: growth\n\n{growth_table(growth)}\n")
    notes = [
        "No paper tabulates this study; the module docstring states the problems, references and expectations.",
        f"Swiss roll, {s['n']} points padded to R⁴; float64; reference for the seeds' fields: backprop through dopri5 "
        f"at rtol = atol = {s['ref_rtol']:.0e}, step sizes held on their mesh.",
        "backprop, checkpoint and symplectic differentiate every adaptive step size (the derivative of the loss as "
        "computed); 'backprop (fixed steps)' holds the sizes on their mesh (the discrete adjoint of the ODE).",
        f"Lorenz gradient growth: fitted rates {_rates(growth)} against λ₁ = {LYAPUNOV_LORENZ}.",
    ]
    figures = [*plot(studies, out_dir), plot_growth(growth, out_dir)]
    return result(
        "adjoint_study",
        _rows(studies),
        size=size,
        seed=seed,
        time_s=time.perf_counter() - t0,
        settings={k: list(v) if isinstance(v, tuple) else v for k, v in s.items()}
        | {"references": {k: v["reference"] for k, v in studies.items()}},
        notes=notes,
        figures=figures,
        growth=growth,
    )


def _rates(growth: dict) -> str:
    rates = {"reference": growth["reference"]["rate"]} | {k: m["rate"] for k, m in growth["modes"].items()}
    return ", ".join(f"{k} {v:.3f}" for k, v in rates.items() if v is not None)
