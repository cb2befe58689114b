"""The H-DNN reproductions' H2 net updates in the reference implementation's order: ``q`` from ``p`` first, then
``p`` from the new ``q`` (HamiltonianNet's ``H2.forward``); the paper's eqs. H12-13 write ``p`` first. With the
input in ``p`` and ``q`` of ``R⁴``, the order changes what a 1- or 2-layer net can fit."""

import torch

from cde_nets.experiments.common import hdnn_classifier


def test_h2_classifier_steps_q_first_as_the_reference_code():
    L, T = 2, 1.2
    model = hdnn_classifier("H2", L, T, seed=3).double()
    field, h = model.block.field, T / L
    x = torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p, q = model.embed(x).split(2, dim=1)
    for l in range(L):
        Kp, Kq = field.K_half(l, 0), field.K_half(l, 1)
        bp, bq = field.b_p[l], field.b_q[l]
        q = q + h * torch.tanh(p @ Kp.T + bp) @ Kp  # q' = q + h ∂H/∂p(p), J = [[0, −I], [I, 0]]
        p = p - h * torch.tanh(q @ Kq.T + bq) @ Kq  # p' = p − h ∂H/∂q(q')
    torch.testing.assert_close(model.features(x), torch.cat([p, q], 1), rtol=1e-12, atol=1e-12)


def test_table2_net_is_the_reference_h2_sparse_forward():
    """HamiltonianNet's H2_sparse (Table H-II) puts the input at features 0 and 12 of ``(y₁, y₂) ∈ R⁸ × R⁸`` and
    steps ``y₂ ← y₂ − h K₁ tanh(K₁ᵀ y₁ + b₁)`` first, then ``y₁ ← y₁ + h K₂ tanh(K₂ᵀ y₂ + b₂)``: our p-first step
    on ``(p, q) = (y₂, y₁)``, node by node, with ``K_q = K₁ᵀ``, ``K_p = K₂ᵀ``."""
    from cde_nets.datasets import swiss_roll
    from cde_nets.experiments.hdnn_table2 import INPUT_CHANNELS, RING, S_RING, h2_classifier

    L, h = 3, 0.5
    model = h2_classifier(L, RING, S_RING, seed=1).double()
    field = model.block.field
    x = swiss_roll(n=8, dim=16, seed=0, dtype=torch.float64, channels=INPUT_CHANNELS).x_train
    points = swiss_roll(n=8, dim=2, seed=0, dtype=torch.float64).x_train
    y1, y2 = torch.zeros(4, 8, dtype=torch.float64), torch.zeros(4, 8, dtype=torch.float64)
    y1[:, 0], y2[:, 4] = points[:, 0], points[:, 1]  # the reference's input_ch = [0, 12]
    for l in range(L):
        K1, K2 = field.K_half(l, 1).T, field.K_half(l, 0).T
        y2 = y2 - h * torch.tanh(y1 @ K1 + field.b_q[l]) @ K1.T
        y1 = y1 + h * torch.tanh(y2 @ K2 + field.b_p[l]) @ K2.T
    torch.testing.assert_close(model.features(x), torch.cat([y2, y1], 1), rtol=1e-12, atol=1e-12)
