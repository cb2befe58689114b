"""``ODEBlock(..., controller="per_sample")`` and ``SolverOptions(controller=...)``: every sample of a block's batch
on its own steps, at its own output times; a piecewise field evaluated on each sample's own piece; gradients
through the block input and the pieces equal to backprop's; refusals that name the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cde_nets import Backprop, Checkpoint, ODEBlock, Symplectic
from cde_nets.fields.nais import NAIS
from cde_nets.solvers.options import SolverOptions

TOL = dict(rtol=1e-7, atol=1e-9)


def _nais(layers: int = 3):
    g = torch.Generator().manual_seed(4)
    field = NAIS(3, 2, layers=layers, T=1.5, eps=0.1, init_std=1.0, generator=g).double()
    x0 = torch.randn(4, 3, generator=g, dtype=torch.float64)
    u = torch.randn(4, 2, generator=g, dtype=torch.float64)
    # every sample its own times, crossing the piece boundaries 0.5 and 1.0 at different places
    t = torch.tensor([[0.2, 0.7, 1.5], [0.1, 0.45, 0.55], [0.3, 1.2, 1.4], [0.05, 0.5, 1.0]], dtype=torch.float64)
    return field, x0, u, t


@pytest.mark.parametrize("jumps", [True, False])
def test_each_sample_on_its_own_piece_and_steps(jumps):
    """A piecewise NAIS field, per-sample output times: each sample takes the steps of its solve alone
    (stopping on the piece boundaries, torchdiffeq's ``jump_t``, or stepping across them), its piece looked up
    from its own time, and its states agree to rounding (the field's matrix products round differently for
    different row counts, and the steps across the jumps, half of them rejected, amplify that to ~1e-8); the
    shared step, on steps of its own, agrees to the tolerance."""
    field, x0, u, t = _nais()
    block = ODEBlock(field, solver=SolverOptions(controller="per_sample", jumps=jumps, **TOL))
    sol = block.solve(x0, u, t=t)
    assert sol.ys.shape == (3, 4, 3) and torch.equal(sol.ts, t)
    shared = ODEBlock(field, solver=SolverOptions(jumps=jumps, **TOL))
    for b in range(4):
        own = block.solve(x0[b : b + 1], u[b : b + 1], t=t[b : b + 1])
        torch.testing.assert_close(sol.ys[:, b], own.ys[:, 0], rtol=0, atol=1e-9 if jumps else 2e-8)
        alone = shared.solve(x0[b : b + 1], u[b : b + 1], t=t[b])
        torch.testing.assert_close(sol.ys[:, b], alone.ys[:, 0], rtol=0, atol=1e-5)
    # and not the piece of another time: solving every row on piece 0 changes the result
    frozen = ODEBlock(
        NAIS(3, 2, layers=1, T=1.5, eps=0.1).double(), solver=SolverOptions(controller="per_sample", jumps=False, **TOL)
    )
    frozen.field.load_state_dict({k: v[:1] for k, v in field.state_dict().items()}, strict=False)
    assert not torch.allclose(frozen.solve(x0, u, t=t).ys, sol.ys, atol=1e-6)


def test_t_end_closed_form_and_plain_module():
    """A plain module that broadcasts ``t`` over its rows: ``y' = −k y + cos t`` to per-sample end times, against
    the closed form ``y(T) = e^{−kT} (y_0 − k/(1+k²)) + (k cos T + sin T)/(1+k²)`` for ``k = 2``."""

    class Forced(nn.Module):
        def forward(self, t, y):
            return -2.0 * y + torch.cos(t).reshape(-1, 1)

    y0 = torch.tensor([[1.0], [0.0], [-1.0]], dtype=torch.float64)
    t_end = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    block = ODEBlock(Forced(), T=3.0, controller="per_sample", rtol=1e-10, atol=1e-12)
    sol = block.solve(y0, t_end=t_end)
    k, T = 2.0, t_end
    exact = torch.exp(-k * T) * (y0[:, 0] - k / (1 + k * k)) + (k * torch.cos(T) + torch.sin(T)) / (1 + k * k)
    torch.testing.assert_close(sol.y[:, 0], exact, rtol=0, atol=1e-9)
    assert torch.equal(sol.stop_times, t_end)
    assert sol.stats["nfe_forward"] > 0


@pytest.mark.parametrize("gradient", [Checkpoint, Symplectic])
@pytest.mark.parametrize("jumps", [True, False])
@pytest.mark.parametrize("steps", ["differentiated", "fixed"])
def test_block_gradients_equal_backprop(gradient, jumps, steps):
    """Through the block: gradients to ``x0``, the input ``u`` and the piecewise weights equal backprop's to
    1e-10 (float64) when the per-sample steps are replayed, with the re-read past each jump replayed too. Steps
    that straddle a jump of the field (``jumps=False``) with their sizes differentiated agree to 1e-7 only: their
    error estimate is made of the jump, and the controller's derivative of it is ill-conditioned (a 1e-14
    relative change of ``y0`` moves that gradient by 2e-9, the fixed-step one by 6e-12)."""

    def grads(g):
        field, x0, u, t = _nais()
        x0.requires_grad_(), u.requires_grad_()
        solver = SolverOptions(controller="per_sample", jumps=jumps, **TOL)
        ys = ODEBlock(field, gradient=g, solver=solver).solve(x0, u, t=t).ys
        ys.square().sum().backward()
        return [x0.grad, u.grad] + [p.grad for p in field.parameters()]

    tol = 1e-7 if steps == "differentiated" and not jumps else 1e-10
    for a, b in zip(grads(gradient(steps=steps)), grads(Backprop(steps=steps))):
        assert float((a - b).abs().max()) <= tol * float(b.abs().max())


@pytest.mark.slow
def test_block_adjoint_converges_like_the_shared_adjoint():
    """The per-sample adjoint through a block (gradients to ``u`` and the weights, a field of one piece) is as
    close to the gradient of the steps as the shared-step adjoint of each sample alone at the same tolerance,
    and converges with the tolerance."""

    def grads(g, tol, controller="per_sample"):
        field, x0, u, t = _nais(layers=1)
        u.requires_grad_()
        block = ODEBlock(field, controller=controller, gradient=g, rtol=tol, atol=tol)
        if controller == "batch":
            ys = torch.stack([block.solve(x0[b : b + 1], u[b : b + 1], t=t[b]).ys[:, 0] for b in range(4)], 1)
        else:
            ys = block.solve(x0, u, t=t).ys
        ys.square().sum().backward()
        return [u.grad] + [p.grad for p in field.parameters()]

    ref = grads("backprop", 1e-12)

    def error(*args):
        return max(float((a - b).abs().max()) for a, b in zip(grads(*args), ref))

    coarse = error("adjoint", 1e-7)
    assert coarse < 2 * error("adjoint", 1e-7, "batch")
    assert error("adjoint", 1e-10) < coarse / 100


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="serves methods"):
        SolverOptions("rk4", controller="per_sample")
    with pytest.raises(ValueError, match="`controller`"):
        SolverOptions(controller="sample")
    with pytest.raises(ValueError, match="step_t"):
        SolverOptions(controller="per_sample", options={"step_t": torch.tensor([0.5])})
    field, x0, u, t = _nais()
    with pytest.raises(ValueError, match="gradient"):
        ODEBlock(field, controller="per_sample", gradient="reversible")
    with pytest.raises(ValueError, match="gradient='checkpoint'"):
        ODEBlock(field, gradient="adjoint", solver=SolverOptions(controller="per_sample", jumps=False)).solve(
            x0, u, t=t
        )
    block = ODEBlock(field, solver=SolverOptions(controller="per_sample", jumps=False))
    with pytest.raises(ValueError, match="controller='batch'"):
        block.solve(x0, u, event=lambda t, y: y[:, 0])
    with pytest.raises(ValueError, match="start at 0 for some"):
        block.solve(x0, u, t=torch.cat((torch.zeros(4, 1), t[:, 1:]), 1).double().index_fill(0, torch.tensor([1]), 0.3))
    with pytest.raises(ValueError, match="detach"):
        block.solve(x0, u, t_end=torch.full((4,), 1.0, dtype=torch.float64, requires_grad=True))

    class ScalarTime(nn.Module):
        def forward(self, t, y):
            return -y * float(t)

    with pytest.raises((RuntimeError, ValueError)) as info:
        ODEBlock(ScalarTime(), T=1.0, controller="per_sample").solve(torch.ones(3, 1))
    assert "controller='batch'" in "".join(getattr(info.value, "__notes__", [])) + str(info.value)


class _Counted(nn.Module):
    """``y' = −w y + sin t`` (per-row ``t``), counting its calls."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.3, dtype=torch.float64))
        self.calls = 0

    def forward(self, t, y):
        self.calls += 1
        return -self.w * y + torch.sin(t)[:, None]


@pytest.mark.parametrize("gradient", ["adjoint", "checkpoint", "symplectic", "backprop"])
def test_backward_counts_in_stats(gradient):
    """``stats`` report the backward pass under the shared step's keys: ``nfe_backward`` the field evaluations
    ``backward()`` makes (the adjoint's backward solve, the replays) or the vector-Jacobian products (backprop),
    ``steps_backward``/``rejected_backward`` the most of a sample. For one sample over one output interval the
    adjoint's backward solve makes ``2 + 7 (steps + rejected)`` evaluations (dopri5 re-evaluates each step's first
    stage; the start adds the first stage and the initial step's probe), and a checkpoint replay re-evaluates
    stages 2-7 of each forward step: ``6 (steps + rejected)``."""
    field = _Counted()
    y0 = torch.tensor([[1.0, -0.5], [0.3, 2.0], [2.0, 0.1]], dtype=torch.float64)
    for rows in (slice(0, 1), slice(0, 3)):
        block = ODEBlock(field, T=2.0, controller="per_sample", gradient=gradient, rtol=1e-8, atol=1e-10)
        sol = block.solve(y0[rows])
        before, forward = field.calls, dict(sol.stats.items())
        sol.y.square().sum().backward()
        stats = sol.stats
        assert forward["nfe_backward"] == 0 and stats["nfe_forward"] == forward["nfe_forward"]
        if gradient == "backprop":
            assert 0 < stats["nfe_backward"] <= stats["nfe_forward"]
            continue
        assert stats["nfe_backward"] == field.calls - before
        attempts = stats["steps_backward"] + stats["rejected_backward"]
        if gradient == "adjoint":
            assert stats["steps_backward"] > 0
            if rows.stop == 1:
                assert stats["nfe_backward"] == 2 + 7 * attempts
        else:  # the replay takes the forward's steps
            assert (stats["steps_backward"], stats["rejected_backward"]) == (
                stats["steps_forward"],
                stats["rejected_forward"],
            )
            if gradient == "checkpoint" and rows.stop == 1:
                assert stats["nfe_backward"] == 6 * attempts
