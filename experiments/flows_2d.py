"""Continuous normalizing flows on the 2-D densities, unregularised (FFJORD, Grathwohl et al. 2019) against
kinetic + Jacobian regularised (RNODE, Finlay et al. 2020, eqs. 4-5), same seeds, same data, same solver.

Each flow is ``ContinuousFlow(field, T=1, trace="exact")`` over a time-concatenated tanh MLP, trained with Adam on
``−mean log p`` (+ ``λ_K ∫‖F‖² + λ_J ∫‖∂F/∂z‖²_F`` for RNODE, ``λ_K = λ_J = 0.01`` as in RNODE's §4) by dopri5 at
``rtol = atol = tol``. Recorded per epoch: training NLL, forward NFE per step, wall time; at the end the test NLL
(exact trace, evaluation mode). RNODE's anchor: about 2.8× less training time than FFJORD at equal bits/dim on
MNIST (their Table 1); the issue's target here is NLL within 0.05 nats with ≥ 2× fewer forward NFE and ≥ 2× less
time. The entropy of the two densities with a closed form (eight Gaussians, checkerboard) is the lowest NLL any
model can reach and is given beside them.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from torch import nn

from cde_nets.datasets import density_2d, density_2d_log_prob
from cde_nets.flows import ContinuousFlow
from cde_nets.regularisers import controlled_norm
from cde_nets.training import seeded

from .common import threads
from .report import result, row, save_figure

SETTINGS = {
    "tiny": dict(densities=("eight_gaussians",), seeds=(0,), epochs=1, steps=2, batch=64, hidden=16, tol=1e-3, n=256),
    "quick": dict(
        densities=("eight_gaussians", "checkerboard", "two_moons", "pinwheel", "rings"),
        seeds=(0,),
        epochs=4,
        steps=25,
        batch=256,
        hidden=32,
        tol=1e-4,
        n=4000,
    ),
    "full": dict(
        densities=("eight_gaussians", "checkerboard", "two_moons", "pinwheel", "rings"),
        seeds=(0, 1, 2),
        epochs=10,
        steps=100,
        batch=256,
        hidden=32,
        tol=1e-5,
        n=8000,
    ),
}
VARIANTS = {"unregularised": {}, "kinetic+jacobian": {"kinetic": 0.01, "jacobian": 0.01}}
RNODE_TIME_RATIO = 2.8  # FFJORD / RNODE training time on MNIST at equal bits/dim (Finlay et al. 2020, Table 1)


class TimeMLP(nn.Module):
    """``F(t, z) = W₃ tanh(W₂ tanh(W₁ [z, t] + b₁) + b₂) + b₃``."""

    def __init__(self, dim: int = 2, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim + 1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, dim)
        )

    def forward(self, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z, t.expand(z.shape[0], 1)], 1))


def train_flow(name: str, seed: int, weights: dict[str, float], s: dict) -> dict:
    """One flow on density ``name``: per-epoch NLL/NFE/time, final test NLL, and the trained flow."""
    data = density_2d(name, s["n"], seed=seed)
    with seeded(seed):
        field = TimeMLP(2, s["hidden"])
    # both variants control their steps on (z, log p) by the same norm, so they run the same solver code
    options = {"norm": controlled_norm(2)}
    flow = ContinuousFlow(
        field, 1.0, trace="exact", regularisers=tuple(weights), rtol=s["tol"], atol=s["tol"], options=options
    )
    opt = torch.optim.Adam(field.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    history, wall = [], 0.0
    for epoch in range(s["epochs"]):
        nll, nfe = 0.0, 0
        t0 = time.perf_counter()
        for _ in range(s["steps"]):
            x = data.x_train[torch.randint(len(data.x_train), (s["batch"],), generator=gen)]
            loss = -flow.log_prob(x).mean()
            total = loss + sum(w * flow.regularisation[k] for k, w in weights.items())
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
            nll += float(loss.detach())
            nfe += flow.nfe
        wall += time.perf_counter() - t0
        history.append(dict(epoch=epoch, nll=nll / s["steps"], nfe=nfe / s["steps"], time_s=wall))
    flow.eval()
    with torch.no_grad():
        test_nll = float(-flow.log_prob(data.x_test).mean())
    nfe_total = round(sum(h["nfe"] for h in history) * s["steps"])  # every step's count, summed
    return dict(history=history, test_nll=test_nll, nfe_total=nfe_total, time_s=wall, flow=flow, data=data)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _plot(runs: dict, densities: tuple[str, ...], out_dir) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the experiments extra
        return None
    g = torch.linspace(-4.5, 4.5, 90)
    grid = torch.cartesian_prod(g, g)
    fig, axes = plt.subplots(len(densities), 3, figsize=(7.5, 2.5 * len(densities)), squeeze=False)
    for i, name in enumerate(densities):
        data = runs[(name, "unregularised")]["data"].x_train
        axes[i, 0].hist2d(data[:, 0].numpy(), data[:, 1].numpy(), bins=90, range=[[-4.5, 4.5]] * 2, cmap="viridis")
        axes[i, 0].set_ylabel(name)
        for j, variant in enumerate(VARIANTS, start=1):
            with torch.no_grad():
                p = runs[(name, variant)]["flow"].log_prob(grid).exp().reshape(90, 90)
            axes[i, j].imshow(p.T.numpy(), origin="lower", extent=(-4.5, 4.5, -4.5, 4.5), cmap="viridis")
    for j, title in enumerate(("data", *VARIANTS)):
        axes[0, j].set_title(title)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    return save_figure(fig, out_dir, "flows_2d_densities")


def _plot_curves(curves: dict, densities: tuple[str, ...], out_dir) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the experiments extra
        return None
    fig, axes = plt.subplots(2, len(densities), figsize=(3 * len(densities), 5), squeeze=False)
    for j, name in enumerate(densities):
        for variant, style in zip(VARIANTS, ("-", "--")):
            for k, hist in enumerate(curves[f"{name}/{variant}"]):
                label = variant if k == 0 else None
                epochs = [h["epoch"] + 1 for h in hist]
                axes[0, j].plot(epochs, [h["nll"] for h in hist], style, color=f"C{k}", label=label)
                axes[1, j].plot(epochs, [h["nfe"] for h in hist], style, color=f"C{k}")
        axes[0, j].set_title(name)
        axes[1, j].set_xlabel("epoch")
    axes[0, 0].set_ylabel("training NLL (nats)")
    axes[1, 0].set_ylabel("forward NFE per step")
    axes[0, 0].legend(fontsize=7)
    return save_figure(fig, out_dir, "flows_2d_curves")


def run(size: str = "quick", seed: int = 0, out_dir="results") -> dict:
    threads()
    s = SETTINGS[size]
    t0 = time.perf_counter()
    # one untimed step first: the first autograd pass of a process pays set-up costs the first variant must not
    train_flow(s["densities"][0], seed, {}, {**SETTINGS["tiny"], "epochs": 1, "steps": 1})
    runs: dict = {}
    rows, curves = [], {}
    for name in s["densities"]:
        stats = {}
        for variant, weights in VARIANTS.items():
            per_seed = []
            for k in s["seeds"]:
                per_seed.append(train_flow(name, seed + k, weights, s))
                last = per_seed[-1]
                print(
                    f"flows_2d {name} {variant} seed {seed + k}: test NLL {last['test_nll']:.3f}, "
                    f"{last['nfe_total']} NFE, {last['time_s']:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            runs[(name, variant)] = per_seed[0]
            stats[variant] = {
                "test_nll": _mean([r["test_nll"] for r in per_seed]),
                "nfe_total": _mean([r["nfe_total"] for r in per_seed]),
                "time_s": _mean([r["time_s"] for r in per_seed]),
            }
            curves[f"{name}/{variant}"] = [r["history"] for r in per_seed]
            rows.append(row(f"{name}, {variant}: test NLL", None, stats[variant]["test_nll"], "nats", density=name))
            rows.append(row(f"{name}, {variant}: forward NFE (training)", None, stats[variant]["nfe_total"]))
            rows.append(row(f"{name}, {variant}: training time", None, stats[variant]["time_s"], "s"))
        u, r = stats["unregularised"], stats["kinetic+jacobian"]
        rows.append(row(f"{name}: NLL gap (regularised − unregularised)", 0.0, r["test_nll"] - u["test_nll"], "nats"))
        rows.append(row(f"{name}: forward NFE ratio (unreg / reg)", None, u["nfe_total"] / r["nfe_total"]))
        rows.append(row(f"{name}: time ratio (unreg / reg)", RNODE_TIME_RATIO, u["time_s"] / r["time_s"]))
        if name in ("eight_gaussians", "checkerboard"):
            x = density_2d(name, 20000, seed=seed + 1000, dtype=torch.float64).x_train
            entropy = float(-density_2d_log_prob(name, x).mean())
            rows.append(row(f"{name}: entropy (lowest reachable NLL)", None, round(entropy, 3), "nats"))
    figures = [_plot(runs, s["densities"], out_dir), _plot_curves(curves, s["densities"], out_dir)]
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()}
    notes = [
        "Published: RNODE's 2.8× is the FFJORD/RNODE training-time ratio on full MNIST, not a 2-D density; the "
        "issue's targets are an NLL gap within 0.05 nats and ratios ≥ 2 (mean over 3 seeds, the full setting).",
        f"lambda_K = lambda_J = {VARIANTS['kinetic+jacobian']['kinetic']}; exact trace; dopri5 at tol {s['tol']}, "
        "steps controlled on (z, log p) only in both variants.",
    ]
    if not math.isfinite(sum(r["ours"] for r in rows if isinstance(r["ours"], float))):
        notes.append("a run diverged (non-finite NLL): see the curves.")
    return result(
        "flows_2d",
        rows,
        size=size,
        seed=seed,
        time_s=time.perf_counter() - t0,
        settings=settings,
        notes=notes,
        figures=[f for f in figures if f],
        curves=curves,
    )
