"""H-DNN Fig. 4 (Galimberti et al.; H §V-C): BSM norms during training, 32-layer H2-DNN against 8- and 32-layer tanh
MLPs.

Double moons, the reference protocol (:mod:`experiments.hdnn_protocol`), 30 epochs = 960 iterations as in the paper.
After every epoch the backward sensitivity matrices ``Φ_ℓ = ∂y_N/∂y_{N−ℓ}`` (H eq. 20) are computed on a fixed
batch of 125 training points: per sample (:func:`cde_nets.diagnostics.discrete_bsm`) and, as the reference plots
them, the norm of the batch-averaged matrix. Theorem H3 / Lemma H4: every H2 layer is symplectic, so each
per-sample ``‖Φ_ℓ‖₂ >= 1`` at every depth and every iteration; the MLP's vanish beyond a few layers from the
output. The MLP (H footnote 11) is ``y_{j+1} = tanh(K_j y_j + b_j)`` on ``R⁶``, ``K, b ~ N(0, 1)``, weight decay
``1e-4 · ½ Σ_{j<N−1} (‖K_j‖² + ‖b_j‖²)`` (the reference's run_MLP).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from cde_nets.blocks.models import Classifier
from cde_nets.datasets import double_moons
from cde_nets.diagnostics import discrete_bsm
from cde_nets.train.trainer import Regulariser, seeded, smoothness_RK

from .common import hdnn_classifier, threads
from .hdnn_protocol import train_hdnn
from .report import result, row, save_figure

PUBLISHED = {"H2 test": 100.0, "MLP8 test": 99.7, "MLP32 test": 50.0, "H2 min BSM": 1.0, "H2 max BSM": 11.0}

SETTINGS = {
    "tiny": dict(n=400, epochs=2, h2_layers=4, mlp_layers=(2, 4), T=1.2, probe=16),
    "quick": dict(n=2000, epochs=30, h2_layers=32, mlp_layers=(8, 32), T=1.2, probe=125),
    "full": dict(n=8000, epochs=30, h2_layers=32, mlp_layers=(8, 32), T=1.2, probe=125),
}


class TanhMLP(nn.Module):
    """``y_{j+1} = tanh(K_j y_j + b_j)``, ``j = 0..N−1`` (H footnote 11), standard-normal init as the reference."""

    def __init__(self, layers: int, dim: int):
        super().__init__()
        self.K = nn.Parameter(torch.randn(layers, dim, dim))
        self.b = nn.Parameter(torch.randn(layers, dim))

    def step(self, l: int, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.addmm(self.b[l], y, self.K[l].T))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        for K, b in zip(self.K.unbind(0), self.b.unbind(0)):
            y = torch.tanh(torch.addmm(b, y, K.T))
        return y


def _mlp_decay(weight: float) -> Regulariser:
    def fn(model: nn.Module) -> torch.Tensor:
        mlp = model.block
        return 0.5 * (mlp.K[:-1].square().sum() + mlp.b[:-1].square().sum())

    return Regulariser("weight_decay", weight, fn)


def _bsm_recorder(step, layers: int, probe: torch.Tensor):
    """``fit`` epoch callback: per-layer BSM norms on ``probe`` (min/mean per sample, and of the mean matrix),
    stored in the epoch's metrics so that a snapshotted run keeps them when it is resumed."""

    def record(epoch, model, metrics):
        res = discrete_bsm(step, model.embed(probe), layers=layers, matrices=True)
        mean_matrix = torch.linalg.matrix_norm(res["Phi"].mean(1), ord=2)
        metrics["bsm"] = {
            "epoch": epoch,
            "min": res["min"].tolist(),
            "mean": res["mean"].tolist(),
            "mean_matrix": mean_matrix.tolist(),
            "test_accuracy": metrics.get("test_accuracy"),
        }
        metrics["bsm_min"] = float(res["min"].min())

    return record


def _bsm_log(history: list[dict]) -> list[dict]:
    return [h["bsm"] for h in history]


def _train(s: dict, seed: int) -> dict:
    """The H2-DNN and the tanh MLPs trained, each with its per-epoch BSM norms (:func:`_bsm_recorder`)."""
    runs = {}
    L = s["h2_layers"]
    data = double_moons(n=s["n"], seed=seed, dim=4, channels=(0, 3))
    model = hdnn_classifier("H2", L, s["T"], seed)
    net = model.block
    r = train_hdnn(
        model,
        data,
        epochs=s["epochs"],
        seed=seed,
        regularisers=[smoothness_RK(5e-4, s["T"] / L)],
        desc=f"H2 L={L}",
        epoch_callback=_bsm_recorder(
            lambda l, y: net.scheme.readout(net.step(l, net.init_state(y))), L, data[0][: s["probe"]]
        ),
    )
    runs[f"H2 {L}"] = {
        "layers": L,
        **{k: r[k] for k in ("train_accuracy", "test_accuracy", "time_s")},
        "bsm": _bsm_log(r["history"]),
    }
    data6 = double_moons(n=s["n"], seed=seed, dim=6, channels=(0, 5))
    for M in s["mlp_layers"]:
        with seeded(seed):
            mlp = TanhMLP(M, 6)
            model = Classifier(mlp, in_features=6, state_dim=6, n_out=1)
        r = train_hdnn(
            model,
            data6,
            epochs=s["epochs"],
            seed=seed,
            regularisers=[_mlp_decay(1e-4)],
            desc=f"MLP L={M}",
            epoch_callback=_bsm_recorder(mlp.step, M, data6[0][: s["probe"]]),
        )
        runs[f"MLP {M}"] = {
            "layers": M,
            **{k: r[k] for k in ("train_accuracy", "test_accuracy", "time_s")},
            "bsm": _bsm_log(r["history"]),
        }
    return runs


def _rows(runs: dict, s: dict) -> list[dict]:
    """Test accuracies and the BSM norms' extremes over training, beside the published ones."""
    L = s["h2_layers"]
    h2 = runs[f"H2 {L}"]
    h2_min = min(min(e["min"]) for e in h2["bsm"])
    h2_max = max(max(e["mean_matrix"]) for e in h2["bsm"])
    h2_sample_max = max(max(e["mean"]) for e in h2["bsm"])
    h2_matrix_min = min(min(e["mean_matrix"]) for e in h2["bsm"])
    rows = [
        row(
            f"H2-DNN, {L} layers: test accuracy",
            PUBLISHED["H2 test"],
            100 * h2["test_accuracy"],
            "%",
            time_s=h2["time_s"],
        ),
        row(f"H2-DNN, {L} layers: min per-sample ‖Φ_ℓ‖₂ over training (>= 1)", PUBLISHED["H2 min BSM"], h2_min),
        row(
            f"H2-DNN, {L} layers: min ‖mean Φ_ℓ‖₂ over training (reference's measure)",
            PUBLISHED["H2 min BSM"],
            h2_matrix_min,
        ),
        row(f"H2-DNN, {L} layers: max ‖mean Φ_ℓ‖₂ over training (paper: <= 11)", PUBLISHED["H2 max BSM"], h2_max),
        row(f"H2-DNN, {L} layers: max of the batch-mean per-sample ‖Φ_ℓ‖₂ over training", None, h2_sample_max),
    ]
    for M in s["mlp_layers"]:
        m = runs[f"MLP {M}"]
        pub = PUBLISHED["MLP8 test"] if M == 8 else PUBLISHED["MLP32 test"] if M == 32 else None
        rows.append(row(f"tanh MLP, {M} layers: test accuracy", pub, 100 * m["test_accuracy"], "%", time_s=m["time_s"]))
        deep = [v for e in m["bsm"][-1:] for v in e["mean"][6:]]  # ℓ = 7..N at the end of training
        if deep:
            rows.append(
                row(f"tanh MLP, {M} layers: max mean ‖Φ_ℓ‖₂, ℓ >= 7, end of training (paper ≈ 0)", None, max(deep))
            )
    return rows


def run(size: str = "quick", seed: int = 0, out_dir="results") -> dict:
    threads()
    s = SETTINGS[size]
    t0 = time.perf_counter()
    runs = _train(s, seed)
    rows = _rows(runs, s)
    figures = [_plot(runs, out_dir)]
    notes = [
        "Published: H Fig. 4 and §V-C (BSM norms in [1, 11] for the 32-layer H2-DNN; the 32-layer MLP at 50 % "
        "with ‖Φ_ℓ‖ ≈ 0 for ℓ = 7..32). BSMs are recorded once per epoch, not per iteration.",
        f"N = {s['n']} points, {s['epochs']} epochs, T = {s['T']} for the H2-DNN.",
    ]
    return result(
        "hdnn_fig4",
        rows,
        size=size,
        seed=seed,
        time_s=time.perf_counter() - t0,
        settings=s,
        notes=notes,
        figures=figures,
        runs=runs,
    )


def _plot(runs: dict, out_dir) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.6))
    for ax, (name, r) in zip(axes, runs.items()):
        norms = np.array([e["mean"] for e in r["bsm"]]).T  # (ℓ, epoch)
        im = ax.imshow(
            np.log10(np.maximum(norms, 1e-12)),
            aspect="auto",
            origin="lower",
            cmap="viridis",
            extent=(0.5, norms.shape[1] + 0.5, 0.5, norms.shape[0] + 0.5),
            vmin=-6,
            vmax=1.5,
        )
        ax.set(
            xlabel="epoch",
            ylabel="ℓ (layers from the output)",
            title=f"{name} layers: test {100 * r['test_accuracy']:.1f} %",
        )
        fig.colorbar(im, ax=ax, label="log10 mean ‖Φ_ℓ‖₂")
    fig.tight_layout()
    return save_figure(fig, out_dir, "hdnn_fig4")
