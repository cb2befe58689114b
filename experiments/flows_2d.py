"""Continuous normalizing flows on the 2-D densities, unregularised (FFJORD, Grathwohl et al. 2019) against
kinetic + Jacobian regularised (RNODE, Finlay et al. 2020, eqs. 4-5), same seeds, same data.

Each flow is ``ContinuousFlow(field, T, trace="exact")`` over a time-concatenated tanh MLP, trained with Adam on
``−mean log p`` (+ ``λ (∫‖F‖² + ∫‖∂F/∂z‖²_F)`` when regularised). A variant trains by dopri5 at
``rtol = atol = tol`` or, as RNODE trained (its MNIST script: rk4 at step 0.25, test by dopri5 at 1e-5), by rk4
at a fixed ``step``: regularised dynamics stay easy enough for a few fixed steps to follow them, and the
unregularised flow trained the same way is the control. RNODE's ``λ = 0.01`` multiplies per-dimension means
(``½ mean ‖F‖²``, ``mean (εᵀ∂F/∂z)²``) beside bits per dimension; in nats summed over dimensions, as here, that
is ``λ_K = 0.01 ln2 / 2 ≈ 0.0035`` and ``λ_J = 0.01 ln2 ≈ 0.0069``. Recorded per epoch: training NLL, forward
NFE per step, wall and CPU time (the variants' epochs interleaved); at the end the test NLL of the ODE itself
(exact trace, dopri5 at ``tol``, evaluation mode) whatever solver trained it. RNODE's anchor: about 2.8× less
training time than FFJORD at equal bits/dim on MNIST (their Table 1); the issue's target here is NLL within 0.05
nats with ≥ 2× fewer forward NFE and ≥ 2× less time. The entropy of the two densities with a closed form (eight
Gaussians, checkerboard) is the lowest NLL any model can reach and is given beside them.

The ``long`` setting (``run("long", seed)``, one thread) is the full one trained five times longer (3000 steps),
checkerboard and pinwheel first, with ``λ = 0.2`` (same convention) beside ``λ = 0.05``: RNODE's mechanism is that
the unregularised flow's evaluations per step grow as training goes on while the regularised flow's stay flat,
which 600 steps may be too short to show. Each epoch's training NLL, NFE per step and CPU time are printed as it ends.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from torch import nn

from cde_nets import integrated_terms
from cde_nets.datasets import density_2d, density_2d_log_prob
from cde_nets.flows import ContinuousFlow
from cde_nets.regularisers import controlled_norm
from cde_nets.train.trainer import seeded

from .common import threads
from .report import result, row, save_figure

DENSITIES = ("eight_gaussians", "checkerboard", "two_moons", "pinwheel", "rings")
# name: (regularisers, trained by rk4 at the setting's fixed `step` rather than dopri5 at `tol`)
VARIANTS = {
    "unregularised": ((), False),
    "kinetic+jacobian": (("kinetic", "jacobian"), False),
    "kinetic+jacobian, rk4": (("kinetic", "jacobian"), True),
    "unregularised, rk4": ((), True),
}
BOTH = ("unregularised", "kinetic+jacobian")
# name: (a VARIANTS entry, its λ in place of the setting's)
AT_LAMBDA = {"kinetic+jacobian, λ = 0.2": ("kinetic+jacobian", 0.2)}
SETTINGS = {
    "tiny": dict(densities=("eight_gaussians",), variants=tuple(VARIANTS), epochs=1, steps=2, batch=64, hidden=16,
                 lr=1e-3, T=1.0, lam=0.01, tol=1e-3, step=0.25, n=256),
    "quick": dict(densities=DENSITIES, variants=BOTH, epochs=4, steps=25, batch=256, hidden=32, lr=1e-3, T=1.0,
                  lam=0.01, tol=1e-4, step=0.25, n=4000),
    # the study's setting: lr 5e-3 fits the densities within 600 steps; lam 0.05 cost at most 0.015 nats there
    "full": dict(densities=DENSITIES, variants=tuple(VARIANTS), epochs=6, steps=100, batch=256, hidden=64, lr=5e-3,
                 T=1.0, lam=0.05, tol=1e-5, step=0.25, n=8000),
    # the full setting trained 5x longer (3000 steps), with a 4x stronger λ beside it: does the unregularised
    # flow's NFE per step keep growing while the regularised ones' stays flat (RNODE's mechanism)?
    "long": dict(densities=("checkerboard", "pinwheel", "two_moons", "eight_gaussians", "rings"),
                 variants=(*BOTH, *AT_LAMBDA), epochs=30, steps=100, batch=256, hidden=64, lr=5e-3, T=1.0, lam=0.05,
                 tol=1e-5, step=0.25, n=8000),
}  # fmt: skip
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
    NLL, the forward NFE per step, the wall time and the process's CPU time (what a shared machine's load does not
    inflate); :meth:`finish` adds the test NLL (exact trace, evaluation mode)."""

    def __init__(self, name: str, seed: int, variant: str, s: dict):
        self.data = density_2d(name, s["n"], seed=seed)
        with seeded(seed):
            field = TimeMLP(2, s["hidden"])
        base, lam = AT_LAMBDA.get(variant, (variant, s["lam"]))
        regularisers, fixed = VARIANTS[base]
        self.weights = {k: lam for k in regularisers}
        self.flow = adaptive_flow(field, s, regularisers)
        if fixed:  # RNODE's protocol: regularised dynamics trained by rk4 at a fixed step
            self.flow = ContinuousFlow(
                field, s["T"], trace="exact", regularisers=regularisers, method="rk4", options={"step_size": s["step"]}
            )
        self.opt = torch.optim.Adam(field.parameters(), lr=s["lr"])
        self.gen = torch.Generator().manual_seed(seed)
        self.s = s
        self.history: list[dict] = []
        self.wall = self.cpu = 0.0
        self.nfe_total = 0

    def epoch(self) -> None:
        s, flow, nll = self.s, self.flow, 0.0
        t0, c0, n0 = time.perf_counter(), time.process_time(), self.nfe_total
        for _ in range(s["steps"]):
            x = self.data.x_train[torch.randint(len(self.data.x_train), (s["batch"],), generator=self.gen)]
            with integrated_terms() as terms:
                loss = -flow.log_prob(x).mean()
            total = loss + sum(w * terms[k] for k, w in self.weights.items())
            self.opt.zero_grad(set_to_none=True)
            total.backward()
            self.opt.step()
            nll += float(loss.detach())
            self.nfe_total += terms.nfe_forward
        self.wall += time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        nfe = (self.nfe_total - n0) / s["steps"]
        self.history.append(
            dict(epoch=len(self.history), nll=nll / s["steps"], nfe=nfe, time_s=self.wall, cpu_s=self.cpu)
        )

    def finish(self) -> dict:
        """The test NLL of the ODE itself: dopri5 at ``tol`` whatever solver trained it."""
        flow = adaptive_flow(self.flow.field, self.s, ()).eval()
        with torch.no_grad():
            test_nll = float(-flow.log_prob(self.data.x_test).mean())
        return dict(
            history=self.history, test_nll=test_nll, nfe_total=self.nfe_total, time_s=self.wall, cpu_s=self.cpu,
            flow=flow, data=self.data,
        )  # fmt: skip


def adaptive_flow(field: nn.Module, s: dict, regularisers: tuple[str, ...]) -> ContinuousFlow:
    """The flow solved by dopri5 at ``tol``, its steps controlled on ``(z, log p)`` with or without regularisers,
    so that every variant runs the same solver code."""
    return ContinuousFlow(
        field, s["T"], trace="exact", regularisers=regularisers, rtol=s["tol"], atol=s["tol"],
        options={"norm": controlled_norm(2)},
    )  # fmt: skip


def train_variants(name: str, seed: int, s: dict) -> dict[str, dict]:
    """The setting's variants on density ``name`` from the same seed, their epochs interleaved (A B A B ...) so
    that a change in the machine's load falls on all alike."""
    runs = {variant: FlowRun(name, seed, variant, s) for variant in s["variants"]}
    for e in range(s["epochs"]):
        for variant, run in runs.items():
            run.epoch()
            h = run.history[-1]
            print(
                f"flows_2d {name} {variant} seed {seed} epoch {e + 1}/{s['epochs']}: training NLL {h['nll']:.3f}, "
                f"{h['nfe']:.1f} NFE per step, {run.nfe_total} NFE, {run.cpu:.1f} s CPU",
                file=sys.stderr,
                flush=True,
            )
    return {variant: run.finish() for variant, run in runs.items()}


def _plot(runs: dict, densities: tuple[str, ...], variants: tuple[str, ...], out_dir) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the experiments extra
        return None
    g = torch.linspace(-4.5, 4.5, 90)
    grid = torch.cartesian_prod(g, g)
    cols = 1 + len(variants)
    fig, axes = plt.subplots(len(densities), cols, figsize=(2.5 * cols, 2.5 * len(densities)), squeeze=False)
    for i, name in enumerate(densities):
        data = runs[(name, "unregularised")]["data"].x_train
        axes[i, 0].hist2d(data[:, 0].numpy(), data[:, 1].numpy(), bins=90, range=[[-4.5, 4.5]] * 2, cmap="viridis")
        axes[i, 0].set_ylabel(name)
        for j, variant in enumerate(variants, start=1):
            with torch.no_grad():
                p = runs[(name, variant)]["flow"].log_prob(grid).exp().reshape(90, 90)
            axes[i, j].imshow(p.T.numpy(), origin="lower", extent=(-4.5, 4.5, -4.5, 4.5), cmap="viridis")
    for j, title in enumerate(("data", *variants)):
        axes[0, j].set_title(title)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    return save_figure(fig, out_dir, "flows_2d_densities")


def _plot_curves(curves: dict, densities: tuple[str, ...], variants: tuple[str, ...], out_dir) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the experiments extra
        return None
    fig, axes = plt.subplots(2, len(densities), figsize=(3 * len(densities), 5), squeeze=False)
    for j, name in enumerate(densities):
        for k, variant in enumerate(variants):
            hist = curves[f"{name}/{variant}"][0]
            epochs = [h["epoch"] + 1 for h in hist]
            axes[0, j].plot(epochs, [h["nll"] for h in hist], color=f"C{k}", label=variant)
            axes[1, j].plot(epochs, [h["nfe"] for h in hist], color=f"C{k}")
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
    if size == "long":  # one intra-op thread: the process's CPU time is then the training's, no worker spinning
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    # one untimed step first: the first autograd pass of a process pays set-up costs the first variant must not
    FlowRun(s["densities"][0], seed, "unregularised", {**s, "epochs": 1, "steps": 1}).epoch()
    runs: dict = {}
    rows, curves = [], {}
    for name in s["densities"]:
        trained = train_variants(name, seed, s)
        for variant, r in trained.items():
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
        for variant in s["variants"][1:]:
            rows += _ratios(name, variant, trained["unregularised"], trained[variant])
        rows += _entropy(name, seed)
    figures = [
        _plot(runs, s["densities"], s["variants"], out_dir),
        _plot_curves(curves, s["densities"], s["variants"], out_dir),
    ]
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()}
    notes = [
        "Published: RNODE's 2.8× is the FFJORD/RNODE training-time ratio on full MNIST, not a 2-D density; the "
        "issue's targets are an NLL gap within 0.05 nats and ratios ≥ 2 (mean over 3 seeds, the full setting).",
        f"lambda_K = lambda_J = {s['lam']}; T = {s['T']}; exact trace; dopri5 at tol {s['tol']}, steps controlled "
        f"on (z, log p) in every adaptive variant; the ', rk4' variants train by rk4 at step {s['step']} (RNODE's "
        "protocol); every test NLL is the ODE's, by dopri5 at tol; the variants' epochs interleaved.",
    ]
    if not math.isfinite(sum(r["ours"] for r in rows if isinstance(r["ours"], float))):
        notes.append("a run diverged (non-finite NLL): see the curves.")
    return result(
        "flows_2d", rows, size=size, seed=seed, time_s=time.perf_counter() - t0, settings=settings, notes=notes,
        figures=[f for f in figures if f], curves=curves,
    )  # fmt: skip


def _ratios(name: str, variant: str, u: dict, r: dict) -> list[dict]:
    """The NLL gap of ``variant`` to the unregularised flow and the unregularised flow's NFE and times over its."""
    vs = "" if variant == "kinetic+jacobian" else f" ({variant})"
    return [
        row(f"{name}: NLL gap (regularised − unregularised){vs}", 0.0, r["test_nll"] - u["test_nll"], "nats"),
        row(f"{name}: forward NFE ratio (unreg / reg){vs}", None, u["nfe_total"] / r["nfe_total"]),
        row(f"{name}: time ratio (unreg / reg){vs}", RNODE_TIME_RATIO, u["time_s"] / r["time_s"]),
        row(f"{name}: CPU time ratio (unreg / reg){vs}", None, u["cpu_s"] / r["cpu_s"]),
    ]


def _entropy(name: str, seed: int) -> list[dict]:
    """The entropy of a density with a closed form: the lowest NLL any model can reach."""
    if name not in ("eight_gaussians", "checkerboard"):
        return []
    x = density_2d(name, 20000, seed=seed + 1000, dtype=torch.float64).x_train
    entropy = float(-density_2d_log_prob(name, x).mean())
    return [row(f"{name}: entropy (lowest reachable NLL)", None, round(entropy, 3), "nats")]
