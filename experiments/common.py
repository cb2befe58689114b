"""Builders shared by the reproductions: the seeds' classifiers and a timed, seeded training run."""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from cde_nets import discretize
from cde_nets.blocks.models import Classifier
from cde_nets.fields import MS1, MS2, MS3, Hamiltonian
from cde_nets.train.trainer import NonFiniteError, Trainer, seeded, smoothness_RK

__all__ = ["hdnn_classifier", "train_classifier", "HDNN_SCHEMES", "diverged"]

# H-DNN Table I architectures: (field builder, scheme). y ∈ R⁴ = the 2-D point padded with two zeros. H2 steps q
# first, then p from the new q, as the reference implementation does (HamiltonianNet's H2.forward); eqs. H12-13
# write p first. With the input in p and q the order matters: on double moons, 2 layers, seeds 0-2, q first gave
# 99.95 / 93.2 / 85.7 % test against 86.6 / 90.6 / 86.1 % p first (the reference code: 99.4 / 94.9 / 90.2 on the same
# seeds).
# MS3 too steps q first in the reference (its MS3.forward), where eq. 40 of H App. I writes p first.
HDNN_SCHEMES = {
    "H1": (lambda L, T: Hamiltonian(4, layers=L, T=T), "euler"),
    "H2": (lambda L, T: Hamiltonian(4, layers=L, T=T, K="blockdiag"), "symplectic_euler_qp"),
    "MS1": (lambda L, T: MS1(4, layers=L, T=T), "symplectic_euler_qp"),
    "MS2": (lambda L, T: MS2(4, layers=L, T=T), "euler"),
    "MS3": (lambda L, T: MS3(4, layers=L, T=T), "symplectic_euler_qp"),
}


def hdnn_classifier(arch: str, layers: int, T: float, seed: int) -> nn.Module:
    """``sigmoid(linear)`` read-out of a discrete H-DNN / MS net on ``R⁴`` (Galimberti et al., Table H-I).

    Weights and biases of the block start standard normal, as in the reference implementation; MS2's ``K = S − Sᵀ``
    starts as the reference's ``M − Mᵀ`` with ``M ~ N(0, 1)``: ``S ~ N(0, 2)``.
    """
    build, scheme = HDNN_SCHEMES[arch]
    with seeded(seed):
        field = build(layers, T)
        with torch.no_grad():
            for p in field.parameters():
                p.normal_()
            if arch == "MS2":
                field.S.data.mul_(math.sqrt(2.0))
        return Classifier(discretize(field, scheme), in_features=2, state_dim=4, n_out=1)


def train_classifier(
    model: nn.Module,
    data,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    smooth: float = 0.0,
    h: float = 1.0,
    desc: str = "",
    **kw,
) -> dict:
    """Train with Adam and optional R_K smoothness; returns final metrics, history and wall time."""
    regs = [smoothness_RK(smooth, h)] if smooth else []
    t0 = time.perf_counter()
    hist = Trainer(lr=lr, seed=seed, regularisers=regs, desc=desc, **kw).fit(
        model, data, epochs=epochs, batch_size=batch_size
    )
    return {
        "train_accuracy": hist[-1].get("train_accuracy"),
        "test_accuracy": hist[-1].get("test_accuracy"),
        "history": hist,
        "time_s": time.perf_counter() - t0,
    }


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def threads() -> None:
    """At most two intra-op threads for a reproduction called directly; ``cde-nets experiments`` sets one before it
    runs each (its ``--threads``, :data:`experiments.registry.THREADS`), which this keeps."""
    torch.set_num_threads(min(2, torch.get_num_threads()))


def diverged(exc: NonFiniteError) -> str:
    """What a row records for a training run stopped by a non-finite step: when it happened, and the solver's own
    message (which names the layer or time) when a block's state blew up."""
    return exc.where if exc.__cause__ is None else f"{exc.where}: {exc.__cause__}"
