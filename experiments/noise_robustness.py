"""Noise as a regulariser: a Hamiltonian ODE classifier against its SDE twin under input perturbations.

Both models are ``logits = linear(y(T))`` with ``y(0) = (x, 0, …, 0) ∈ R^d`` for a swiss-roll point ``x ∈ R²``
and the Hamiltonian drift ``F(t, y) = J Kᵀ tanh(K y + b)`` (Galimberti et al., eq. H12-13, H1 with canonical
``J``), piecewise constant over ``L`` pieces of ``[0, T]``:

- ODE: :class:`~cde_nets.ODEBlock`, ``y' = F(t, y)``, explicit Euler with one step per piece;
- SDE: :class:`~cde_nets.blocks.sde.SDEBlock`, ``dy = F(t, y) dt + σ dW`` (additive noise, fixed ``σ``: a learned
  ``σ`` would shrink to 0, since noise only costs training loss), Euler-Maruyama on the same grid.

They share the initial weights, the batch order and the optimiser, so the noise is the only difference in training.
At test time the SDE model integrates its drift ODE (``eval()``, noise off) and, as a second read-out, the mean of
``paths`` noisy paths (``SDESettings(noise_at_eval=True)``). Each test point is perturbed by ``ε N(0, I₂)`` in
input space for a growing ``ε``; accuracies are averaged over ``draws`` perturbations. There is no published number
for this setting (Liu et al. 2019 report the effect on CIFAR-10/STL-10), so every row's ``published`` is ``None``.

``run(size, seed, out_dir) -> dict`` as every reproduction (see :func:`experiments.report.result`): ``"rows"``
(``{"setting", "published", "ours", "unit", ...}``: accuracy in % per model and ``ε``, then per model the
accuracy lost from ``ε = 0`` to ``ε = 0.1`` in points), ``"settings"`` (the
configuration, plus ``"curves"``: ``{model: [accuracy per ε]}`` and ``"eps"``), ``"seed"``, ``"time_s"``,
``"figures"`` (the PNG) and ``"notes"``.
"""

from __future__ import annotations

import time

import torch

from cde_nets.blocks.models import Classifier
from cde_nets.blocks.ode import ODEBlock
from cde_nets.blocks.sde import SDEBlock
from cde_nets.datasets import swiss_roll
from cde_nets.fields import Hamiltonian
from cde_nets.train.trainer import Trainer, evaluate, seeded

from .report import SIZES, result, row, save_figure

__all__ = ["run", "SETTINGS", "build"]

SETTINGS = {
    "tiny": dict(
        n=200, epochs=2, batch=50, lr=0.01, L=4, T=2.0, dim=8, width=16, sigma=0.1, paths=2, draws=1, eps=(0.0, 0.1)
    ),
    "quick": dict(
        n=1000,
        epochs=40,
        batch=32,
        lr=0.01,
        L=8,
        T=2.0,
        dim=8,
        width=64,
        sigma=0.1,
        paths=8,
        draws=4,
        eps=(0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3),
    ),
    "full": dict(
        n=4000,
        epochs=100,
        batch=32,
        lr=0.01,
        L=16,
        T=2.0,
        dim=8,
        width=64,
        sigma=0.1,
        paths=16,
        draws=10,
        eps=(0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4),
    ),
}
INIT_STD = 0.5
DROP_EPS = 0.1  # the perturbation at which each model's loss of accuracy is summarised in a row


def build(noise: bool, s: dict, seed: int) -> Classifier:
    """The ODE (``noise=False``) or SDE classifier; the same ``seed`` gives both the same initial weights."""
    with seeded(seed):
        field = Hamiltonian(s["dim"], layers=s["L"], T=s["T"], width=s["width"], init_std=INIT_STD)
        readout_seed = int(torch.randint(0, 2**31 - 1, ()))
    h = s["T"] / s["L"]
    if noise:
        block = SDEBlock(
            field, noise="additive", sigma=s["sigma"], method="euler", step_size=h, gradient="backprop", seed=seed
        )
        block.rho.requires_grad_(False)
    else:
        block = ODEBlock(field, method="euler", step_size=h, gradient="backprop")
    with seeded(readout_seed):
        return Classifier(block, in_features=2, state_dim=s["dim"], n_out=1)


def _perturbed_accuracy(
    model: Classifier, x: torch.Tensor, y: torch.Tensor, eps: float, draws: int, seed: int
) -> float:
    gen = torch.Generator().manual_seed(seed)
    accs = [
        evaluate(model, x + eps * torch.randn(x.shape, generator=gen, dtype=x.dtype), y)["accuracy"]
        for _ in range(draws if eps > 0 else 1)
    ]
    return 100 * sum(accs) / len(accs)


def _plot(curves: dict, eps: tuple, s: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, acc), marker in zip(curves.items(), "osd"):
        ax.plot(eps, acc, marker=marker, label=name)
    ax.set(
        xlabel="input perturbation ε (std of Gaussian noise)",
        ylabel="test accuracy (%)",
        title=f"swiss roll, Hamiltonian net, L = {s['L']}, σ = {s['sigma']}",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return [save_figure(fig, out_dir, "noise_robustness")]


def run(size: str | bool = "quick", seed: int = 0, out_dir="results") -> dict:
    """Train the ODE and SDE classifiers and tabulate test accuracy against the input perturbation ``ε``.

    ``size``: ``"tiny"`` (seconds, the test suite), ``"quick"`` (< 1 min on 2 cores) or ``"full"``; ``True`` and
    ``False`` mean ``"quick"`` and ``"full"``.
    """
    if isinstance(size, bool):
        size = "quick" if size else "full"
    if size not in SIZES:
        raise ValueError(f"`size` must be one of {SIZES}, got {size!r}.")
    s = SETTINGS[size]
    t0 = time.perf_counter()
    # Batches of 32 × 8 states: a second intra-op thread only adds synchronisation (4x slower on 2 busy cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows, curves, train = _experiment(s, seed)
    finally:
        torch.set_num_threads(threads)
    figures = _plot(curves, s["eps"], s, out_dir)
    notes = [
        f"Additive noise σ = {s['sigma']} (fixed) in training; Euler / Euler-Maruyama with one step per piece "
        f"(h = {s['T'] / s['L']}); Adam lr {s['lr']} with cosine decay, batch {s['batch']}, {s['epochs']} "
        "epochs; the two models start from the same weights and see the same batches.",
        f"Input perturbation x + ε N(0, I₂) on the test points, accuracy averaged over {s['draws']} draws; the "
        "swiss roll's arms are about 0.25 apart, so ε ≳ 0.2 mixes them.",
        "No published number: the swiss roll is not among Liu et al. (2019)'s benchmarks.",
    ]
    return result(
        "noise_robustness",
        rows,
        size=size,
        seed=seed,
        time_s=time.perf_counter() - t0,
        settings={**s, "init_std": INIT_STD, "curves": curves, "train": train},
        notes=notes,
        figures=figures,
    )


def _experiment(s: dict, seed: int) -> tuple[list[dict], dict, dict]:
    data = swiss_roll(n=s["n"], dim=2, seed=seed)
    models, train = {}, {}
    for name, noise in (("ODE", False), ("SDE", True)):
        tr = time.perf_counter()
        model = build(noise, s, seed)
        trainer = Trainer(
            lr=s["lr"],
            seed=seed,
            desc=name,
            scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, s["epochs"]),
        )
        hist = trainer.fit(model, data, epochs=s["epochs"], batch_size=s["batch"])
        models[name] = model
        train[name] = {"train_accuracy": 100 * hist[-1]["train_accuracy"], "time_s": time.perf_counter() - tr}
    sde_block = models["SDE"].block
    evals = {
        "ODE": (models["ODE"], {}),
        "SDE, noise off at test": (models["SDE"], dict(noise_at_eval=False)),
        f"SDE, mean of {s['paths']} noisy paths": (models["SDE"], dict(noise_at_eval=True, paths=s["paths"])),
    }
    rows, curves = [], {}
    for name, (model, mode) in evals.items():
        if mode:
            sde_block.noise_at_eval, sde_block.paths = mode["noise_at_eval"], mode.get("paths", 1)
            sde_block.reseed(seed + 1)
        curves[name] = [
            _perturbed_accuracy(model, data.x_test, data.y_test, eps, s["draws"], seed + 2) for eps in s["eps"]
        ]
        base = train["SDE" if mode else "ODE"]
        rows += [
            row(f"{name}, ε = {eps} (test)", None, acc, "%", train=base["train_accuracy"], time_s=base["time_s"])
            for eps, acc in zip(s["eps"], curves[name])
        ]
        k = s["eps"].index(DROP_EPS)
        rows.append(
            row(
                f"{name}, accuracy lost from ε = 0 to ε = {DROP_EPS}", None, curves[name][0] - curves[name][k], "points"
            )
        )
    sde_block.noise_at_eval, sde_block.paths = False, 1
    return rows, curves, train
