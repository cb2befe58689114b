"""Gradients through per-sample steps (:mod:`cde_nets.solvers.per_sample.grads`,
:mod:`cde_nets.solvers.per_sample.adjoint`): checkpoint and symplectic replay the steps each sample took and equal
backprop to rounding; the per-sample adjoint converges to them with the tolerance, and its joint backward solve
(one batch, each sample on its own steps) equals solving every sample's backward problem alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cde_nets.solvers.errors import Reason, SolverError
from cde_nets.solvers.gradients import Adjoint, Backprop
from cde_nets.solvers.per_sample.adjoint import SeparateAdjoint
from cde_nets.solvers.per_sample.solve import odeint_per_sample


class Oscillator(nn.Module):
    """Van der Pol with a stiffness per sample (a parameter) and a shared damping ``c`` (a parameter)."""

    def __init__(self, mu: torch.Tensor):
        super().__init__()
        self.mu = nn.Parameter(mu.clone())
        self.c = nn.Parameter(torch.tensor(0.3, dtype=mu.dtype))

    def forward(self, t: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x, v = y[:, 0], y[:, 1]
        mu = self.mu[rows]
        return torch.stack((v, mu * (1 - x * x) * v - x - self.c * torch.sin(t) * x), 1)


def _problem(B: int = 5):
    g = torch.Generator().manual_seed(3)
    mu = 0.5 + 4 * torch.rand(B, generator=g, dtype=torch.float64)
    y0 = torch.randn(B, 2, generator=g, dtype=torch.float64)
    # per-sample output times: a row each, different spans
    t = torch.stack([torch.tensor([0.0, 0.3 + 0.1 * b, 0.9 + 0.2 * b, 1.6 + 0.1 * b]) for b in range(B)]).double()
    w = torch.randn(4, B, 2, generator=g, dtype=torch.float64)
    return Oscillator(mu), y0, t, w


def _grads(gradient, method="dopri5", rtol=1e-6, atol=1e-8, **kw):
    field, y0, t, w = _problem()
    y0.requires_grad_()
    out, info = odeint_per_sample(
        field, y0, t, method=method, rows=True, gradient=gradient, rtol=rtol, atol=atol, return_info=True, **kw
    )
    (out * w).sum().backward()
    return out.detach(), (y0.grad, field.mu.grad, field.c.grad), info


@pytest.mark.parametrize("method", ["dopri5", "bosh3", "tsit5"])
@pytest.mark.parametrize("gradient", ["checkpoint", "symplectic"])
def test_replayed_gradients_equal_backprop(method, gradient):
    """Checkpoint and symplectic replay the sweeps each sample took: the same values, and the gradients with
    respect to ``y0``, a per-sample and a shared parameter equal backprop's to 1e-10 (float64)."""
    ref_out, ref, ref_info = _grads("backprop", method)
    out, got, info = _grads(gradient, method)
    assert torch.equal(out, ref_out)
    assert torch.equal(info.steps, ref_info.steps) and info.nfe == ref_info.nfe
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_adjoint_converges_to_the_exact_gradient():
    """The per-sample adjoint solves the adjoint ODE, so it differs from the gradient of the steps by the
    integration error: tightening both tolerances by 1000x shrinks the gap by at least 100x."""
    _, ref, _ = _grads("backprop", rtol=1e-11, atol=1e-13)
    gaps = []
    for tol in (1e-5, 1e-8):
        _, got, info = _grads("adjoint", rtol=tol, atol=tol * 1e-2)
        gaps.append(max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref)))
        assert info.backward is not None and info.backward.nfe > 0 and bool((info.backward.steps > 0).all())
    assert gaps[0] < 1e-3 and gaps[1] < gaps[0] / 100


def test_joint_adjoint_equals_separate_backward_solves():
    """In the joint backward solve every sample keeps its own steps: its gradients are those of its own backward
    solve alone (to rounding in the parameter sum), and so are its step counts."""

    _, joint, ji = _grads(Adjoint(), rtol=1e-7, atol=1e-9)
    _, alone, si = _grads(SeparateAdjoint(), rtol=1e-7, atol=1e-9)
    assert torch.equal(ji.backward.steps, si.backward.steps)
    assert torch.equal(ji.backward.rejected, si.backward.rejected)
    assert ji.backward.nfe < si.backward.nfe
    for a, b in zip(joint, alone):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_backward_failure_names_the_exact_methods():
    """Van der Pol at μ = 25 attracts forwards; its time-reversed adjoint solve fails, and the error names the
    exact gradients that do not integrate backwards."""
    field = Oscillator(torch.tensor([25.0], dtype=torch.float64))
    y0 = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    out = odeint_per_sample(field, y0, torch.tensor([0.0, 10.0]), rows=True, gradient="adjoint", rtol=1e-5, atol=1e-7)
    with pytest.raises(SolverError, match="gradient='checkpoint' or gradient='backprop'") as info:
        out[-1].sum().backward()
    assert info.value.reason == Reason.BACKWARD_UNSTABLE


@pytest.mark.parametrize("steps", ["fixed", "differentiated"])
def test_backprop_saves_a_round_linear_in_rounds_and_no_stacked_stages(steps):
    """Backprop keeps each sweep's graph, so its memory grows with the sweeps, and only linearly: every sweep of a
    uniform batch saves the same tensors. Beyond the field's own saves (its input and ``k``, ``N + 1`` numbers a
    row per call), a dopri5 sweep with its step sizes held fixed saves ``O(rows)`` numbers: the step sizes of the
    ``h k_i`` (``s`` of ``m``), the two acceptance masks and the tableau rows, none of the stage stacks its
    combinations ``Σ_j a_ij h k_j`` are read from (those would add at least ``m N`` numbers each, quadratically
    many in the stages). Differentiating the step sizes (the default) adds ``s + 7`` state-sized tensors a sweep:
    each ``k_i`` for ``∂(h k_i)/∂h``, and the error ratio's ``y``, ``Y``, ``|y|``, ``|Y|``, ``err``, ``tol`` and
    ``err / tol``, still linear in the sweeps and with no stage stack."""
    m, N, s = 16, 16, 7
    k = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    gradient = Backprop(steps=steps)

    def saved(T: float) -> tuple[int, int, int]:
        n, numbers = [0], [0]

        def pack(x: torch.Tensor) -> torch.Tensor:
            n[0] += 1
            numbers[0] += x.numel()
            return x

        y0 = torch.ones(m, N, dtype=torch.float64, requires_grad=True)
        t = torch.tensor([0.0, T], dtype=torch.float64)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            info = odeint_per_sample(
                lambda t, y: -k * y, y0, t, rtol=1e-8, atol=1e-10, return_info=True, gradient=gradient
            )[1]
        return info.sweeps, n[0], numbers[0]

    (r0, n0, e0), (r1, n1, e1), (r2, n2, e2) = saved(2.0), saved(4.0), saved(8.0)
    assert r2 - r1 > r1 - r0 > 5
    assert (n1 - n0) * (r2 - r1) == (n2 - n1) * (r1 - r0)  # the same tensors each sweep: linear in the sweeps
    assert (e1 - e0) * (r2 - r1) == (e2 - e1) * (r1 - r0)
    per_round = (e2 - e1) // (r2 - r1)
    beyond_field = per_round - (s - 1) * (m * N + 1)  # FSAL: six field calls a sweep
    controller = 0 if steps == "fixed" else (s + 7) * m * N + 4 * (s + 2) * m
    assert beyond_field <= controller + (s + 2) * m + s * s, per_round
    assert beyond_field < controller + m * N
