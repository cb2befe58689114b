"""Checkpoint(budget=k): the binomial schedule alone (Griewank's closed form, the online placement), and the
gradients it gives against every-step checkpointing and backpropagation through the same steps."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from torch import nn

import cde_nets
from cde_nets import ODEBlock
from cde_nets.solvers.gradients import Backprop, Checkpoint, Symplectic
from cde_nets.solvers.gradients.binomial import (
    OnlineSchedule,
    beta,
    offline_recomputations,
    reversal,
    revolve_advances,
)


@cache
def _revolve(steps: int, slots: int) -> int:
    """Griewank's recursion: advance j, keep that state, reverse the rest with one slot fewer, then the first j."""
    if steps <= 1:
        return 0
    if slots == 1:
        return steps * (steps - 1) // 2
    return min(j + _revolve(steps - j, slots - 1) + _revolve(j, slots) for j in range(1, steps))


@cache
def _offline(n: int, k: int) -> int:
    """The best placement knowing n: the forward solve keeps x_j for free, the rest is a problem with k - 1 slots."""
    if n <= k:
        return 0
    if k == 1:
        return _revolve(n, 1)
    return min(_offline(n - j, k - 1) + _revolve(j, k) for j in range(1, n))


def test_griewank_closed_form_is_the_recursion():
    for s in range(1, 7):
        for n in range(1, 45):
            assert revolve_advances(n, s) == _revolve(n, s), (n, s)
            assert offline_recomputations(n, s) == _offline(n, s), (n, s)
    assert [offline_recomputations(n, 1) for n in range(1, 7)] == [n * (n - 1) // 2 for n in range(1, 7)]
    assert offline_recomputations(30, 30) == 0 and offline_recomputations(31, 30) == 1


def _walk(n: int, k: int) -> tuple[int, int]:
    """Run the online placement over n steps and its reversal; check the visits; (advances, most kept)."""
    sched = OnlineSchedule(k)
    for i in range(n):
        sched.admit(i)
    held, work, advances, visited = set(sched.positions), None, 0, []
    peak = len(held)
    for action, i in reversal(sched.positions, n, k):
        if action == "load":
            assert i in held
            work = i
        elif action == "advance":
            assert work == i
            work, advances = i + 1, advances + 1
        elif action == "keep":
            assert work == i
            held.add(i)
            peak = max(peak, len(held))
        elif action == "drop":
            held.remove(i)
        else:
            assert work == i
            visited.append(i)
    assert visited == list(range(n - 1, -1, -1))
    assert advances == sched.recomputations(n)
    return advances, peak


def test_online_schedule_is_offline_optimal_to_beta_k_2():
    """Stumm & Walther's range: an online placement can match the offline optimum while n <= β(k, 2)."""
    for k in range(1, 9):
        for n in range(1, beta(k, 2) + 1):
            advances, peak = _walk(n, k)
            assert peak <= k
            assert advances == offline_recomputations(n, k), (n, k)


def test_online_schedule_beyond_beta_k_2():
    for k in range(2, 6):
        for n in range(beta(k, 2) + 1, beta(k, 3) + 1):
            advances, peak = _walk(n, k)
            assert peak <= k
            assert offline_recomputations(n, k) <= advances <= 1.15 * offline_recomputations(n, k), (n, k)


class _Field(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2)).double()

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y) * (1 + 0.5 * torch.sin(3 * t)) - 0.3 * y


_Y0 = torch.tensor([[1.0, -0.5], [0.2, 0.8], [-1.0, 0.3]], dtype=torch.float64)


def _grad(field: nn.Module, gradient, method: str, **kw) -> tuple[torch.Tensor, dict]:
    block = ODEBlock(field, T=2.0, method=method, gradient=gradient, **kw)
    y0 = _Y0.clone().requires_grad_()
    sol = block.solve(y0)
    (sol.y**2).sum().backward()
    out = torch.cat([y0.grad.flatten(), *(p.grad.flatten() for p in field.parameters())])
    field.zero_grad(set_to_none=True)
    return out, sol.stats.as_dict()


def _predicted(n: int, k: int) -> int:
    sched = OnlineSchedule(k)
    for i in range(n):
        sched.admit(i)
    return sched.recomputations(n)


@pytest.mark.parametrize(
    ("method", "kw"),
    [
        # step sizes differentiated: every attempt replayed; a first step too large for rejections
        ("dopri5", dict(rtol=1e-6, atol=1e-8, options={"first_step": 0.5})),
        ("fehlberg2", dict(rtol=1e-3, atol=1e-5)),  # a carried slope is part of the state
        ("rk4", dict(step_size=0.25)),
    ],
)
def test_budget_gives_the_same_gradient(method, kw):
    field = _Field()
    ref, ref_stats = _grad(field, Checkpoint(), method, **kw)
    bp, _ = _grad(field, Backprop(), method, **kw)
    n = ref_stats["steps_forward"]
    assert n >= 6 and ref_stats["stored_states"] >= n and ref_stats["recomputed_steps"] == 0
    if method == "dopri5":
        assert ref_stats["rejected_forward"] > 0
    torch.testing.assert_close(ref, bp, rtol=0, atol=1e-12)
    for k in (1, 2, n):
        got, stats = _grad(field, Checkpoint(budget=k), method, **kw)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
        assert stats["steps_forward"] == n and stats["rejected_backward"] == ref_stats["rejected_backward"]
        assert 1 <= stats["stored_states"] <= k
        assert stats["recomputed_steps"] == _predicted(n, k)
        if k == 1:
            assert stats["recomputed_steps"] == n * (n - 1) // 2
        if k == n:
            assert stats["recomputed_steps"] == 0


def test_budget_with_step_sizes_fixed_and_symplectic():
    field = _Field()
    kw = dict(rtol=1e-4, atol=1e-6)
    ref, _ = _grad(field, Checkpoint(steps="fixed"), "dopri5", **kw)
    got, stats = _grad(field, Checkpoint(steps="fixed", budget=2), "dopri5", **kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert stats["stored_states"] <= 2 and stats["recomputed_steps"] == _predicted(stats["steps_forward"], 2)
    ref, _ = _grad(field, Symplectic(), "dopri5", **kw)
    got, stats = _grad(field, Symplectic(budget=2), "dopri5", **kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert stats["stored_states"] <= 2


class _Counting(_Field):
    calls = 0

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(t, y)


def test_both_doors_take_a_budget():
    """The same gradient from ODEBlock and odeint, and odeint's extra evaluations are the block's recomputed
    steps (six stages each: dopri5's last is its next step's first)."""
    field = _Counting()
    t = torch.tensor([0.0, 0.7, 2.0], dtype=torch.float64)
    kw = dict(method="dopri5", rtol=1e-6, atol=1e-8)
    grads, calls = [], []
    for door, budget in (("block", 4), ("odeint", 4), ("odeint", None)):
        y0 = _Y0.clone().requires_grad_()
        field.calls = 0
        if door == "block":
            sol = ODEBlock(field, T=2.0, gradient=Checkpoint(budget=budget), **kw).solve(y0, t=t)
            ys, stats = sol.ys, sol.stats
        else:
            ys = cde_nets.odeint(field, y0, t, gradient=Checkpoint(budget=budget), **kw)
        (ys**2).sum().backward()
        calls.append(field.calls)
        grads.append(torch.cat([y0.grad.flatten(), *(p.grad.flatten() for p in field.parameters())]))
        field.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[1], grads[2], rtol=0, atol=1e-12)
    assert stats["recomputed_steps"] > 0 and stats["stored_states"] <= 4
    assert calls[1] - calls[2] == 6 * stats["recomputed_steps"]


def test_second_backward_and_per_sample_are_refused():
    field = _Field()
    block = ODEBlock(field, T=1.0, method="rk4", step_size=0.25, gradient=Checkpoint(budget=2))
    y = block(_Y0)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="budget=None"):
        y.sum().backward()
    with pytest.raises(ValueError, match="per_sample.*budget"):
        ODEBlock(field, T=1.0, controller="per_sample", gradient=Checkpoint(budget=2))


@pytest.mark.parametrize("budget", [0, -3, 2.5, True, "4"])
def test_bad_budget_is_refused_by_name(budget):
    with pytest.raises(ValueError, match="`budget`.*positive int"):
        Checkpoint(budget=budget)
    with pytest.raises(ValueError, match="`budget`"):
        OnlineSchedule(budget)


def test_fixed_grid_sweeps_refuse_a_budget():
    field = _Field()
    with pytest.raises(ValueError, match=r"budget=3.*'gl4'.*budget=None"):
        ODEBlock(field, T=1.0, method="gl4", step_size=0.1, gradient=Checkpoint(budget=3))(_Y0)
    assert Checkpoint().supports("gl4") and not Checkpoint(budget=3).supports("gl4")
