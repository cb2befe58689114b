"""Table H-I's MS1-MS3 baselines against the reference implementation (HamiltonianNet's MS1, MS2, MS3 and the
loop of train_2d_example), written out by hand in its own weights: the layer order, the initial scale and the
training (Adam on its parameters, R_K on its ``getK()``) must be the reference's to float64 rounding.

Its weights, row-vector form (``y`` is a row, the reference's ``F.linear(y, W)`` is ``y @ Wᵀ``), ``y = (p, q)``:
- MS1: ``K`` (L, 2, 2), ``b`` (L, 4); ``q ← q + h tanh(p Kᵀ + b_q)``, then ``p ← p + h tanh(−q K + b_p)``;
  ``getK() = [[0, K], [−Kᵀ, 0]]``.
- MS2: ``M`` (L, 4, 4) free off the diagonal, ``K = M − Mᵀ``; ``y ← y + h tanh(y K + b)``; ``getK() = K``.
- MS3: ``K1, K2`` (L, 2, 2), ``b1, b2`` (L, 2); ``q ← q − h tanh(p K1 + b2) K1ᵀ``, then
  ``p ← p + h tanh(q K2 + b1) K2ᵀ``; ``getK() = [[0, K1], [K2, 0]]``; the loop resets the Adam step counter of
  its first two parameters (K1, K2) only.
"""

import pytest
import torch
from test_hdnn_reference_loop import _readout
from torch import nn
from torch.nn import functional as F

from cde_nets.experiments.common import hdnn_classifier
from cde_nets.experiments.hdnn_protocol import reference_RK, train_hdnn

OFF = 1 - torch.eye(4)  # MS2's free entries of M


def _reference_forward(arch: str, w: dict, z: torch.Tensor, h: float) -> torch.Tensor:
    p, q = z[:, :2], z[:, 2:]
    for l in range(len(w["b1" if arch == "MS3" else "b"])):
        if arch == "MS1":
            K, b = w["K"][l], w["b"][l]
            q = q + h * torch.tanh(p @ K.T + b[2:])
            p = p + h * torch.tanh(-q @ K + b[:2])
        elif arch == "MS2":
            M = w["M"][l] * OFF
            y = torch.cat([p, q], 1)
            y = y + h * torch.tanh(y @ (M - M.T) + w["b"][l])
            p, q = y[:, :2], y[:, 2:]
        else:
            K1, K2 = w["K1"][l], w["K2"][l]
            q = q - h * torch.tanh(p @ K1 + w["b2"][l]) @ K1.T
            p = p + h * torch.tanh(q @ K2 + w["b1"][l]) @ K2.T
    return torch.cat([p, q], 1)


def _reference_K(arch: str, w: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``getK()`` and ``getb()``, layer first."""
    if arch == "MS2":
        M = w["M"] * OFF
        return M - M.mT, w["b"]
    A, B = (w["K"], -w["K"].mT) if arch == "MS1" else (w["K1"], w["K2"])
    Z = torch.zeros_like(A)
    K = torch.cat([torch.cat([Z, A], 2), torch.cat([B, Z], 2)], 1)
    return K, w["b"] if arch == "MS1" else torch.cat([w["b1"], w["b2"]], 1)


def _reference_weights(arch: str, L: int, gen: torch.Generator) -> dict:
    shapes = {
        "MS1": dict(K=(L, 2, 2), b=(L, 4)),
        "MS2": dict(M=(L, 4, 4), b=(L, 4)),
        "MS3": dict(K1=(L, 2, 2), K2=(L, 2, 2), b1=(L, 2), b2=(L, 2)),
    }[arch]
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def _into_ours(arch: str, w: dict, field) -> None:
    """Our field holding the reference's weights: the same layers (the mapping is a relabelling)."""
    with torch.no_grad():
        if arch == "MS1":
            field.K0.data.copy_(-w["K"].mT)
            field.b1.data.copy_(-w["b"][:, 2:])
            field.b2.data.copy_(w["b"][:, :2])
        elif arch == "MS2":
            iu = torch.triu_indices(4, 4, 1)
            field.S.data.copy_(_reference_K(arch, w)[0].mT[:, iu[0], iu[1]])
            field.b.data.copy_(w["b"])
        else:
            field.K1.data.copy_(w["K2"].mT)
            field.K2.data.copy_(w["K1"].mT)
            field.b1.data.copy_(w["b1"])
            field.b2.data.copy_(w["b2"])


def _reference_loop(arch, w, x, y, h, epochs, seed, batch=125):
    """train_2d_example's block training on the batches train_hdnn's Trainer draws."""
    w = {k: nn.Parameter(v.clone()) for k, v in w.items()}
    opt = torch.optim.Adam(list(w.values()), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), batch):
            xb, yb = x[perm[i : i + batch]], y[perm[i : i + batch]].double()
            with torch.no_grad():
                feats = _reference_forward(arch, w, xb, h)
            W, mu = _readout(feats, yb)
            opt.zero_grad()
            K, b = _reference_K(arch, w)
            R_K = 0.5 * ((K[1:] - K[:-1]).square().sum() + (b[1:] - b[:-1]).square().sum())
            out = _reference_forward(arch, w, xb, h) @ W[0] + mu
            (F.binary_cross_entropy_with_logits(out, yb) + 5e-4 * h * R_K).backward()
            for p in list(opt.state)[:2]:  # optimizer_k.state[li[ii]]['step'] = epoch, for ii in range(2)
                opt.state[p]["step"] = torch.tensor(float(epoch))
            opt.step()
    return {k: v.detach() for k, v in w.items()}


@pytest.mark.parametrize("arch", ["MS1", "MS2", "MS3"])
def test_ms_classifier_is_the_reference_forward(arch, f64):
    """MS3 steps q first in the reference (eq. 40 of H App. I writes p first); MS1 does too, MS2 is one Euler step."""
    L, T = 3, 1.2
    w = _reference_weights(arch, L, torch.Generator().manual_seed(2))
    model = hdnn_classifier(arch, L, T, seed=0).double()
    _into_ours(arch, w, model.block.field)
    x = torch.zeros(6, 4)
    x[:, [0, 3]] = torch.randn(6, 2, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.features(x), _reference_forward(arch, w, x, T / L), rtol=0, atol=1e-13)


def test_ms2_classifier_starts_K_as_the_reference_M_minus_M_transposed():
    """The reference draws its free ``M ~ N(0, 1)``, so each entry of ``K = M − Mᵀ`` has variance 2: over 12 000
    entries the sample variance lies within 0.1 of 2 (four of its standard errors, 2·√(2/12 000) ≈ 0.026)."""
    field = hdnn_classifier("MS2", 2000, 1.2, seed=0).block.field
    assert abs(float(field.S.data.detach().var()) - 2.0) < 0.1


@pytest.mark.parametrize("arch", ["MS1", "MS2", "MS3"])
def test_train_hdnn_is_the_reference_ms_loop_step_for_step(arch, f64):
    """Ours trains its own parameters (MS2: the upper triangle ``S`` of ``K``), the reference its own (MS2: all of
    ``M``), and both must end at the same net: Adam moves ``M``'s two copies of an entry of ``K`` by one step each,
    its R_K counts MS1's ``K`` and MS2's ``S`` twice, its MS3 biases keep Adam's own step count."""
    L, T, seed, epochs = 3, 1.2, 0, 2
    gen = torch.Generator().manual_seed(1)
    x = torch.zeros(250, 4)
    x[:, [0, 3]] = torch.randn(250, 2, generator=gen)
    y = (x[:, 0] * x[:, 3] > 0).long()
    w0 = _reference_weights(arch, L, gen)
    model = hdnn_classifier(arch, L, T, seed).double()
    _into_ours(arch, w0, model.block.field)
    reg = [reference_RK(5e-4, T / L)]
    train_hdnn(model, (x, y, None, None), epochs=epochs, seed=seed, regularisers=reg, progress=False)
    w = _reference_loop(arch, w0, x, y, T / L, epochs, seed)
    expected = hdnn_classifier(arch, L, T, seed).double()
    _into_ours(arch, w, expected.block.field)
    assert max((a - b).abs().max() for a, b in zip(w.values(), w0.values())) > 0.1  # training moved the weights
    for (name, a), b in zip(model.block.field.named_parameters(), expected.block.field.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_reference_RK_names_a_bad_step():
    with pytest.raises(ValueError, match="`h`"):
        reference_RK(5e-4, 0.0)
