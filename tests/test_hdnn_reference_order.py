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
