r"""The continuous adjoint of a per-sample solve: one batched backward solve in which each sample keeps its own
step control (the joint design of Lienen & Günnemann 2022, "torchode: A Parallel ODE Solver for PyTorch", §3).

The forward solve keeps no graph. Backwards, the state ``y`` and the adjoint ``a`` of every sample are integrated
together from its last output time to its first (Chen et al. 2018, "Neural ordinary differential equations",
§2), in ``s = −t`` so that the per-sample sweeps (:mod:`solvers.per_sample.loop`) run forwards:

    ``dy/ds = −F(−s, y)``,   ``da/ds = (∂F/∂y)ᵀ a``,   ``∂ℒ/∂θ = ∫ aᵀ ∂F/∂θ ds``,

each sample on its own steps and error ratio over its ``(y, a)`` (the parameter gradient is no state of the
solve: Kidger, Chen & Lyons 2021, "Hey, that's not an ODE", seminorm). The parameter integral is the method's own
quadrature of each accepted step, ``Σ_b Σ_i h_b b_i a_{i,b}ᵀ ∂F_b/∂θ(Y_{i,b})``, summed over the samples in one
vector-Jacobian product per sweep through the stages' retained graphs; for it every step re-evaluates its first
stage (no first-same-as-last) and the last step of each sample ends on its output time. Between output times
``y`` is reset to the forward value and the output's cotangent is added to ``a``, as ``odeint_adjoint`` does.

``design="separate"`` solves each sample's backward problem alone (a batch of one each), for comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import BACKWARD_UNSTABLE, Reason, SolverError
from ..gradients import Adjoint
from ..gradients.second_order import PER_SAMPLE_FIX, first_order, remember_inputs
from .grads import advance_for, integrate_rows
from .loop import PerSampleInfo, RowClocks, Stepper, Sweep

__all__ = ["SeparateAdjoint", "adjoint_rows"]


@dataclass(frozen=True, repr=False)
class SeparateAdjoint(Adjoint):
    """The per-sample adjoint with every sample's backward problem solved alone, a batch of one each: the
    design the joint backward solve is measured against (``benchmarks/per_sample.py``)."""

    design: ClassVar[str] = "separate"


def adjoint_rows(cfg: dict, y: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The forward outputs ``(n · B, N)`` without a graph, the per-sample adjoint as their backward pass.
    ``cfg``: ``stepper`` (forward), ``times``, ``rtol``/``atol`` (forward columns), ``adjoint_rtol``/``atol``
    (``None``: the forward's), ``info``, ``max_steps``, ``first_step``, ``design``."""
    return _Adjoint.apply(cfg, y, *params)


class _Adjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: dict, y: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        remember_inputs(ctx, y, *params)
        with torch.no_grad():
            out = integrate_rows(
                cfg["stepper"],
                y,
                cfg["times"],
                cfg["rtol"],
                cfg["atol"],
                cfg["info"],
                max_steps=cfg["max_steps"],
                first_step=cfg["first_step"],
                advance=advance_for("none", cfg["stepper"]),
            )
        ctx.cfg = cfg
        ctx.save_for_backward(out, *params)
        return out

    @staticmethod
    @first_order("adjoint", fix=PER_SAMPLE_FIX)
    def backward(ctx, g: torch.Tensor):
        cfg = ctx.cfg
        out, *params = ctx.saved_tensors
        B = cfg["times"].shape[0]
        outs, gs = out.view(-1, B, out.shape[1]), g.view(-1, B, out.shape[1])
        info = cfg["info"]
        if cfg["design"] == "joint":
            a, total = _backward(cfg, outs, gs, params, torch.arange(B, device=out.device))
        else:
            a_rows, total = [], [None] * len(params)
            for b in range(B):
                a_b, grads = _backward(cfg, outs, gs, params, torch.tensor([b], device=out.device))
                a_rows.append(a_b)
                total = [gp if t is None else (t if gp is None else t + gp) for t, gp in zip(total, grads)]
            a = torch.cat(a_rows)
        if info.on_backward is not None:
            info.on_backward(info.backward)
        return (None, a, *total)


class _Augmented:
    """``(y, a) ↦ (−F(−s, y), (∂F/∂y)ᵀ a)`` on the rows running; keeps each evaluation's graph until its sweep's
    parameter quadrature (:meth:`quadrature`) has used it."""

    def __init__(self, F: Any, N: int, sel: torch.Tensor, params: Sequence[torch.Tensor]):
        self.F, self.N, self.sel, self.params = F, N, sel, list(params)
        self.nfe = 0  # for the error of a failed backward solve (the totals are counted by the forward's field)
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)

    def __call__(self, s: torch.Tensor, z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        N = self.N
        y, a = z[:, :N], z[:, N:]
        with torch.enable_grad():
            yv = y.detach().requires_grad_()
            f = self.F(-s, yv, self.sel[ids])
            (vjp,) = torch.autograd.grad(f, yv, a, retain_graph=bool(self.params), allow_unused=True)
        if vjp is None:
            vjp = torch.zeros_like(a)
        if self.params:
            self.records.append((f, a))
        self.nfe += 1
        return torch.cat((-f.detach(), vjp), 1)

    def quadrature(self, stepper: Stepper, sw: Sweep, rows: RowClocks) -> None:
        """``Σ_i h_b b_i a_iᵀ ∂F/∂θ(Y_i)`` over the rows whose step was accepted, one product for the sweep."""
        stages, self.records = self.records[-stepper.s :], []
        if not self.params:
            return
        w = torch.where(sw.ok, rows.dt, 0).to(stages[0][1].dtype)[:, None]
        outs, cots = [], []
        for (f, a), b in zip(stages, stepper.b):
            if b != 0.0:
                outs.append(f)
                cots.append((b * w) * a)
        grads = torch.autograd.grad(outs, self.params, cots, allow_unused=True)
        self.grads = [g if acc is None else (acc if g is None else acc + g) for acc, g in zip(self.grads, grads)]


def _backward(cfg: dict, outs: torch.Tensor, gs: torch.Tensor, params, sel: torch.Tensor):
    """The backward solve of rows ``sel``: ``a(t_0)`` and the parameter gradients."""
    fwd: Stepper = cfg["stepper"]
    times = cfg["times"][sel]
    N = outs.shape[2]
    aug = _Augmented(fwd.F, N, sel, params)
    total: PerSampleInfo = cfg["info"].backward
    stepper = Stepper(aug, fwd.tab, outs, fwd.options, len(sel))
    stepper.fsal = False
    rtol = cfg["rtol"][sel] if cfg["adjoint_rtol"] is None else torch.full_like(cfg["rtol"][sel], cfg["adjoint_rtol"])
    atol = cfg["atol"][sel] if cfg["adjoint_atol"] is None else torch.full_like(cfg["atol"][sel], cfg["adjoint_atol"])
    a = gs[-1, sel]
    for j in range(times.shape[1] - 1, 0, -1):
        span = torch.stack((-times[:, j], -times[:, j - 1]), 1)
        z = torch.cat((outs[j, sel], a), 1)
        seg = PerSampleInfo.zeros(len(sel), outs.device)
        watch = _Divergence(outs[j, sel], outs[j - 1, sel], sel, times[:, j], times[:, j - 1], atol / rtol)

        def hook(sw: Sweep, rows: RowClocks, watch: _Divergence = watch) -> None:
            aug.quadrature(stepper, sw, rows)
            watch.sweep(sw.y[:, :N], rows.ids, aug.nfe)

        try:
            end = integrate_rows(
                stepper,
                z,
                span,
                rtol,
                atol,
                seg,
                max_steps=cfg["max_steps"],
                first_step=None,
                advance=advance_for("none", stepper),
                hook=hook,
            )
        except SolverError as exc:
            raise SolverError(f"{exc} {BACKWARD_UNSTABLE}", nfe=aug.nfe, reason=exc.reason) from exc
        total.steps[sel] += seg.steps
        total.rejected[sel] += seg.rejected
        total.sweeps += seg.sweeps
        ends = end.view(2, len(sel), 2 * N)[1]
        watch.landed(ends[:, :N], aug.nfe)
        a = ends[:, N:] + gs[j - 1, sel]
    return a, aug.grads


class _Divergence:
    """Whether the backward solve still follows the forward trajectory it re-integrates: the time-reversed solve
    of a field that attracts forwards diverges (its error grows as fast as the attraction), and the adjoint
    read along it is then no gradient, finite or not. Two checks per output interval of the rows ``sel``: no
    state of the backward solve exceeds its interval's forward states in magnitude by more than ``GROWTH``
    (checked every sweep, so that a divergence stops within a sweep of it), and the state it lands on at the
    interval's start equals the forward's there to within ``LANDING`` of its size (an RMS over the components of
    ``|Δ| / (|y| + atol/rtol)``: relative, with the tolerances' own floor; a solve that follows the forward one
    misses it by its global error, orders of magnitude less)."""

    GROWTH = 1e6
    LANDING = 0.1

    def __init__(self, y_end, y_start: torch.Tensor, sel: torch.Tensor, t_end, t_start, floor: torch.Tensor):
        scale = torch.maximum(y_end.abs().amax(1), y_start.abs().amax(1))
        self.bound = self.GROWTH * torch.clamp(scale, min=1.0)
        self.y_start, self.sel, self.t_end, self.t_start = y_start, sel, t_end, t_start
        self.floor = floor  # atol / rtol, (m, 1) or (m, N)

    def sweep(self, y: torch.Tensor, ids: torch.Tensor, nfe: int) -> None:
        over = y.abs().amax(1) > self.bound[ids]
        if bool(over.any()):
            self._fail(int(ids[over.nonzero()[0, 0]]), f"grew past {self.GROWTH:g} times the forward states", nfe)

    def landed(self, y: torch.Tensor, nfe: int) -> None:
        gap = ((y - self.y_start) / (self.y_start.abs() + self.floor)).pow(2).mean(1).sqrt()
        off = gap > self.LANDING
        if bool(off.any()):
            row = int(off.nonzero()[0, 0])
            self._fail(row, f"landed {float(gap[row]):.3g} of the state's size away from the forward solve's", nfe)

    def _fail(self, row: int, what: str, nfe: int) -> None:
        b = int(self.sel[row])
        raise SolverError(
            f"the adjoint's backward solve of sample {b} diverged on [{float(self.t_start[row]):g}, "
            f"{float(self.t_end[row]):g}]: re-integrated backwards, its state {what}, so the adjoint read along it "
            f"is no gradient. {BACKWARD_UNSTABLE}",
            nfe=nfe,
            reason=Reason.BACKWARD_UNSTABLE,
        )
