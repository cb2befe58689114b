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

DENSITIES = ("eight_gaussians", "checkerboard", "two_moons", "pinwheel", "rings")
SETTINGS = {
    "tiny": dict(densities=("eight_gaussians",), epochs=1, steps=2, batch=64, hidden=16, lr=1e-3, T=1.0, lam=0.01,
                 tol=1e-3, n=256),
    "quick": dict(densities=DENSITIES, epochs=4, steps=25, batch=256, hidden=32, lr=1e-3, T=1.0, lam=0.01, tol=1e-4,
                  n=4000),
    "full": dict(densities=DENSITIES, epochs=10, steps=100, batch=256, hidden=32, lr=1e-3, T=1.0, lam=0.01, tol=1e-5,
                 n=8000),
}  # fmt: skip
VARIANTS = {"unregularised": (), "kinetic+jacobian": ("kinetic", "jacobian")}
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


class FlowRun:
    """One flow in training on density ``name``: :meth:`epoch` trains ``steps`` Adam steps and records the training
    NLL, the forward NFE per step, the wall time and this thread's CPU time (what a shared machine's load does not
    inflate); :meth:`finish` adds the test NLL (exact trace, evaluation mode)."""

    def __init__(self, name: str, seed: int, weights: dict[str, float], s: dict):
        self.data = density_2d(name, s["n"], seed=seed)
        with seeded(seed):
            field = TimeMLP(2, s["hidden"])
        # both variants control their steps on (z, log p) by the same norm, so they run the same solver code
        self.flow = ContinuousFlow(
            field, s["T"], trace="exact", regularisers=tuple(weights), rtol=s["tol"], atol=s["tol"],
            options={"norm": controlled_norm(2)},
        )  # fmt: skip
        self.opt = torch.optim.Adam(field.parameters(), lr=s["lr"])
        self.gen = torch.Generator().manual_seed(seed)
        self.weights, self.s = weights, s
        self.history: list[dict] = []
        self.wall = self.cpu = 0.0
        self.nfe_total = 0

    def epoch(self) -> None:
        s, flow, nll = self.s, self.flow, 0.0
        t0, c0, n0 = time.perf_counter(), time.thread_time(), self.nfe_total
        for _ in range(s["steps"]):
            x = self.data.x_train[torch.randint(len(self.data.x_train), (s["batch"],), generator=self.gen)]
            loss = -flow.log_prob(x).mean()
            total = loss + sum(w * flow.regularisation[k] for k, w in self.weights.items())
            self.opt.zero_grad(set_to_none=True)
            total.backward()
            self.opt.step()
            nll += float(loss.detach())
            self.nfe_total += flow.nfe
        self.wall += time.perf_counter() - t0
        self.cpu += time.thread_time() - c0
        nfe = (self.nfe_total - n0) / s["steps"]
        self.history.append(dict(epoch=len(self.history), nll=nll / s["steps"], nfe=nfe, time_s=self.wall))

    def finish(self) -> dict:
        self.flow.eval()
        with torch.no_grad():
            test_nll = float(-self.flow.log_prob(self.data.x_test).mean())
        return dict(
            history=self.history, test_nll=test_nll, nfe_total=self.nfe_total, time_s=self.wall, cpu_s=self.cpu,
            flow=self.flow, data=self.data,
        )  # fmt: skip


def train_pair(name: str, seed: int, s: dict) -> dict[str, dict]:
    """Both variants on density ``name`` from the same seed, their epochs interleaved (A B A B ...) so that a
    change in the machine's load falls on both alike."""
    runs = {variant: FlowRun(name, seed, weights(variant, s), s) for variant in VARIANTS}
    for _ in range(s["epochs"]):
        for run in runs.values():
            run.epoch()
    return {variant: run.finish() for variant, run in runs.items()}


def weights(variant: str, s: dict) -> dict[str, float]:
    """The regularisers' weights of ``variant`` at setting ``s``."""
    return {k: s["lam"] for k in VARIANTS[variant]}


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
    """One seed; ``python -m cde_nets.experiments flows_2d`` runs three at the full setting
    (:mod:`~cde_nets.experiments.seeds`) and reports the mean and spread of every row."""
    threads()
    s = SETTINGS[size]
    t0 = time.perf_counter()
    # one untimed step first: the first autograd pass of a process pays set-up costs the first variant must not
    FlowRun(s["densities"][0], seed, {}, {**s, "epochs": 1, "steps": 1}).epoch()
    runs: dict = {}
    rows, curves = [], {}
    for name in s["densities"]:
        pair = train_pair(name, seed, s)
        for variant, r in pair.items():
            runs[(name, variant)] = r
            curves[f"{name}/{variant}"] = [r["history"]]
            print(
                f"flows_2d {name} {variant} seed {seed}: test NLL {r['test_nll']:.3f}, {r['nfe_total']} NFE, "
                f"{r['time_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU",
                file=sys.stderr,
                flush=True,
            )
            rows.append(row(f"{name}, {variant}: test NLL", None, r["test_nll"], "nats", density=name))
            rows.append(row(f"{name}, {variant}: forward NFE (training)", None, r["nfe_total"]))
            rows.append(row(f"{name}, {variant}: training time", None, r["time_s"], "s"))
            rows.append(row(f"{name}, {variant}: training CPU time", None, r["cpu_s"], "s"))
        rows += _ratios(name, pair["unregularised"], pair["kinetic+jacobian"], seed)
    figures = [_plot(runs, s["densities"], out_dir), _plot_curves(curves, s["densities"], out_dir)]
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()}
    notes = [
        "Published: RNODE's 2.8× is the FFJORD/RNODE training-time ratio on full MNIST, not a 2-D density; the "
        "issue's targets are an NLL gap within 0.05 nats and ratios ≥ 2 (mean over 3 seeds, the full setting).",
        f"lambda_K = lambda_J = {s['lam']}; T = {s['T']}; exact trace; dopri5 at tol {s['tol']}, steps controlled "
        "on (z, log p) only in both variants; the two variants' epochs interleaved.",
    ]
    if not math.isfinite(sum(r["ours"] for r in rows if isinstance(r["ours"], float))):
        notes.append("a run diverged (non-finite NLL): see the curves.")
    return result(
        "flows_2d", rows, size=size, seed=seed, time_s=time.perf_counter() - t0, settings=settings, notes=notes,
        figures=[f for f in figures if f], curves=curves,
    )  # fmt: skip


def _ratios(name: str, u: dict, r: dict, seed: int) -> list[dict]:
    """The gap and the ratios of one density, and the entropy where the density has a closed form."""
    rows = [
        row(f"{name}: NLL gap (regularised − unregularised)", 0.0, r["test_nll"] - u["test_nll"], "nats"),
        row(f"{name}: forward NFE ratio (unreg / reg)", None, u["nfe_total"] / r["nfe_total"]),
        row(f"{name}: time ratio (unreg / reg)", RNODE_TIME_RATIO, u["time_s"] / r["time_s"]),
        row(f"{name}: CPU time ratio (unreg / reg)", None, u["cpu_s"] / r["cpu_s"]),
    ]
    if name in ("eight_gaussians", "checkerboard"):
        x = density_2d(name, 20000, seed=seed + 1000, dtype=torch.float64).x_train
        entropy = float(-density_2d_log_prob(name, x).mean())
        rows.append(row(f"{name}: entropy (lowest reachable NLL)", None, round(entropy, 3), "nats"))
    return rows
