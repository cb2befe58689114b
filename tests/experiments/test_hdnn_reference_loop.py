"""H-DNN training (experiments.hdnn_protocol.train_hdnn) against the reference implementation's loop written out by
hand (HamiltonianNet's train_2d_example): same data, initial weights and batches, so the block must end in the same
place to float64 rounding. The loop below restates what that code does per batch: a fresh zero read-out fitted by
10 Adam steps on the frozen features, then one Adam step of the block on BCE + 5e-4 · R_K with Adam's step
counter set to the epoch number (its bias correction counts epochs, eps added to the corrected √v̂)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cde_nets.experiments.common import hdnn_classifier
from cde_nets.experiments.hdnn_protocol import EpochAdam, train_hdnn
from cde_nets.train.trainer import smoothness_RK


def _readout(feats: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    W, mu = torch.zeros(1, feats.shape[1], requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([W, mu], lr=0.05)
    for _ in range(10):
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(feats @ W[0] + mu, y)
        (loss + 1e-4 * 0.5 * (W.square().sum() + mu.square().sum())).backward()
        opt.step()
    return W.detach(), mu.detach()


def _reference_loop(K, b, x, y, J, h, epochs, seed, batch=125):
    """H1 layers ``y ← y + h J Kᵀ tanh(K y + b)`` trained as the reference code trains them."""
    K, b = nn.Parameter(K.clone()), nn.Parameter(b.clone())
    opt = torch.optim.Adam([K, b], lr=0.05)
    gen = torch.Generator().manual_seed(seed)  # the batches train_hdnn's Trainer draws

    def forward(z):
        for l in range(K.shape[0]):
            z = z + h * torch.tanh(z @ K[l].T + b[l]) @ K[l] @ J.T
        return z

    for epoch in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), batch):
            xb, yb = x[perm[i : i + batch]], y[perm[i : i + batch]].double()
            with torch.no_grad():
                feats = forward(xb)
            W, mu = _readout(feats, yb)
            opt.zero_grad()
            R_K = 0.5 * ((K[1:] - K[:-1]).square().sum() + (b[1:] - b[:-1]).square().sum())
            loss = F.binary_cross_entropy_with_logits(forward(xb) @ W[0] + mu, yb) + 5e-4 * h * R_K
            loss.backward()
            for p in opt.state:  # the reference: optimizer_k.state[p]['step'] = epoch, once the state exists
                opt.state[p]["step"] = torch.tensor(float(epoch))
            opt.step()
    return K.detach(), b.detach()


def test_train_hdnn_is_the_reference_loop_step_for_step(f64):
    L, T, seed, epochs = 2, 1.2, 0, 3
    gen = torch.Generator().manual_seed(1)
    x = torch.zeros(250, 4)
    x[:, [0, 3]] = torch.randn(250, 2, generator=gen)  # the 2-D point in features 0 and 3, as Table H-I
    y = (x[:, 0] * x[:, 3] > 0).long()
    model = hdnn_classifier("H1", L, T, seed)
    field = model.block.field
    K0, b0 = field.K.data.clone(), field.b.data.clone()
    train_hdnn(
        model, (x, y, None, None), epochs=epochs, seed=seed, regularisers=[smoothness_RK(5e-4, T / L)], progress=False
    )
    K, b = _reference_loop(K0, b0, x, y, field.J, T / L, epochs, seed)
    assert (K - K0).abs().max() > 0.1  # training moved the weights
    torch.testing.assert_close(field.K.data, K, rtol=0, atol=1e-12)
    torch.testing.assert_close(field.b.data, b, rtol=0, atol=1e-12)


def test_epoch_adam_counts_epochs_with_eps_where_the_reference_adds_it(f64):
    """Gradients of 1e-9, where eps = 1e-8 decides the step: the update must be the reference's to rounding."""
    grads = 1e-9 * torch.randn(3 * 4, 5, generator=torch.Generator().manual_seed(0))  # 3 epochs of 4 batches
    p = nn.Parameter(torch.zeros(5))
    opt = EpochAdam([p], batches_per_epoch=4, lr=0.05)
    m, v, theta = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for k, g in enumerate(grads):
        p.grad = g.clone()
        opt.step()
        t = k // 4 + 1
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        theta = theta - 0.05 * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    torch.testing.assert_close(p.detach(), theta, rtol=1e-12, atol=0)
    assert theta.abs().max() > 1e-3  # eps shapes the step here: |θ| is far above the 1e-9 gradients


def test_epoch_adam_resumes_its_epoch_count_from_the_state_dict(f64):
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt_a = EpochAdam([a], batches_per_epoch=2, lr=0.05)
    opt_b = EpochAdam([b], batches_per_epoch=2, lr=0.05)
    grads = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    for k, g in enumerate(grads):
        a.grad = g.clone()
        opt_a.step()
        if k == 2:  # b's run stops after 2 updates (the end of epoch 0) and resumes in a fresh optimiser
            state = opt_b.state_dict()
            opt_b = EpochAdam([b], batches_per_epoch=2, lr=0.05)
            opt_b.load_state_dict(state)
        b.grad = g.clone()
        opt_b.step()
    assert torch.equal(a, b)


def test_epoch_adam_names_a_bad_batch_count():
    with pytest.raises(ValueError, match="batches_per_epoch"):
        EpochAdam([nn.Parameter(torch.ones(1))], batches_per_epoch=0)
