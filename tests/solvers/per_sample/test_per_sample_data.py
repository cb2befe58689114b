"""Per-sample data in every door: a field whose ``forward`` takes ``rows`` receives the batch indices of the rows it
is handed, so a tensor with one entry per sample (a stiffness, a label, a target) is read for those rows however
the batch shrinks (finished samples leave a per-sample solve; stopped ones a stopping block). A field that does not
take them and fails on a compacted batch is told which rows it was handed and how to receive them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, Stop, odeint, odeint_per_sample

F64 = torch.float64
B = 24


class Oscillators(nn.Module):
    """Van der Pol with a stiffness per sample, held as a buffer of length ``B``."""

    def __init__(self, mu: torch.Tensor):
        super().__init__()
        self.register_buffer("mu", mu)

    def forward(self, t, y, rows):
        x, v = y[:, 0], y[:, 1]
        return torch.stack((v, self.mu[rows] * (1 - x * x) * v - x), 1)


class Unaware(Oscillators):
    """The same field reading its buffer whole: right on the full batch only."""

    def forward(self, t, y):
        x, v = y[:, 0], y[:, 1]
        return torch.stack((v, self.mu * (1 - x * x) * v - x), 1)


def _problem():
    g = torch.Generator().manual_seed(5)
    mu = 0.5 + 6 * torch.rand(B, generator=g, dtype=F64)
    y0 = torch.randn(B, 2, generator=g, dtype=F64)
    t_end = 0.5 + 2.5 * torch.rand(B, generator=g, dtype=F64)  # staggered ends: rows leave the batch
    return mu, y0, t_end


def test_each_door_hands_the_field_its_rows():
    """Per sample (both doors, rows leaving the batch) every sample equals its solve alone; on the shared step
    (both doors) the field is handed every row, in order, and equals the field that reads its buffer whole."""
    mu, y0, t_end = _problem()
    field = Oscillators(mu)
    tol = dict(rtol=1e-8, atol=1e-10)
    per = odeint_per_sample(field, y0, t_end=t_end, **tol)[-1]
    for b in (0, 7, 23):
        alone = odeint_per_sample(Oscillators(mu[b : b + 1]), y0[b : b + 1], t_end=t_end[b : b + 1], **tol)[-1]
        torch.testing.assert_close(per[b : b + 1], alone, rtol=0, atol=0)
    t = torch.tensor([0.0, 1.5], dtype=F64)
    via_odeint = odeint(field, y0, t, controller="per_sample", **tol)
    block = ODEBlock(field, T=1.5, controller="per_sample", **tol)
    torch.testing.assert_close(block(y0), via_odeint[-1], rtol=0, atol=0)
    shared = odeint(field, y0, t, **tol)
    torch.testing.assert_close(shared, odeint(Unaware(mu), y0, t, **tol), rtol=0, atol=0)
    torch.testing.assert_close(ODEBlock(field, T=1.5, **tol)(y0), shared[-1], rtol=0, atol=0)


class Decay(nn.Module):
    """``y' = −μ_b y``: each sample settles at its own rate."""

    def __init__(self, mu: torch.Tensor):
        super().__init__()
        self.register_buffer("mu", mu)

    def forward(self, t, y, rows):
        return -self.mu[rows, None] * y


def test_a_stopping_block_hands_the_field_the_rows_still_running():
    """Stopped samples leave the batch; the field reads its data for the rows that remain, and each sample stops
    where it would alone (``‖F‖ = ε`` on ``y' = −μ y``: ``t* = ln(μ ‖y_0‖ / ε) / μ``, the solver's to its error)."""
    mu, y0, _ = _problem()
    block = ODEBlock(Decay(mu), T=8.0, rtol=1e-9, atol=1e-11, stop=Stop(0.05))
    sol = block.solve(y0)
    exact = torch.log(mu * y0.norm(dim=1) / 0.05) / mu
    exact = torch.where(mu * y0.norm(dim=1) <= 0.05, torch.zeros_like(exact), exact)
    assert int((sol.stop_times < 8.0).sum()) > B // 2
    finished = sol.stop_times < 8.0
    torch.testing.assert_close(sol.stop_times[finished], exact[finished], rtol=1e-6, atol=1e-8)


def test_a_field_that_fails_on_a_compacted_batch_is_told_why():
    mu, y0, t_end = _problem()
    with pytest.raises(RuntimeError, match="size of tensor") as info:
        odeint_per_sample(Unaware(mu), y0, t_end=t_end, rtol=1e-8, atol=1e-10)
    note = " ".join(getattr(info.value, "__notes__", []))
    assert f"of the batch's {B} rows" in note and "forward(t, y, rows)" in note
