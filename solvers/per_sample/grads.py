r"""The sweeps of a per-sample solve driven to the end, and the gradient each method attaches to them.

- ``backprop``: every sweep keeps its graph (memory grows with the sweeps).
- ``checkpoint`` (Zhuang et al. 2020, "Adaptive checkpoint adjoint method for gradient estimation in neural
  ODE"): each sweep keeps only its inputs ``(y, k_1)``; the backward pass recomputes the sweep's stages from
  them with a graph and backpropagates through that sweep alone. The step sizes, the accept/reject decisions and
  the dense-output weights are the forward's, kept with the sweep, so the replay takes the same per-sample steps
  and the gradient equals backprop's.
- ``symplectic`` (Matsubara, Miyatake & Yaguchi 2021, "Symplectic adjoint method for exact gradient of neural ODE
  with minimal memory", eq. 8 in stage form, as :mod:`solvers.gradients.replay`): each sweep keeps ``(y, k_1)``; the
  backward pass recomputes the stage inputs ``Y_i`` without a graph and carries the adjoint back stage by stage,

      ``κ_i = h b_i λ_{n+1} + h Σ_{j>i} a_ji μ_j``,   ``μ_i = (∂F/∂y(t + c_i h, Y_i))ᵀ κ_i``,
      ``λ_n = λ_{n+1} + Σ_i μ_i``,   ``∂ℒ/∂θ += Σ_i (∂F/∂θ)ᵀ κ_i``,

  with ``κ_i = 0`` on the rows whose step was rejected (their state passes through unchanged), one
  vector-Jacobian product with the graph of a single evaluation at a time. The first stage is the sweep's input
  ``k_1`` (the last stage of the step before), so its cotangent ``κ_1`` flows to that sweep.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import Reason, SolverError
from ..gradients.second_order import PER_SAMPLE_FIX, first_order, remember_inputs
from .loop import RowClocks, Stepper, Sweep, dense, start
from .steps import controlled_advance, count_replayed

__all__ = ["advance_for", "integrate_rows"]

Advance = Callable[[torch.Tensor, torch.Tensor, RowClocks], Sweep]


def advance_for(mode: str, stepper: Stepper, params: Sequence[torch.Tensor] = ()) -> Advance:
    """One sweep as ``mode`` records it: ``"none"`` (no graph), ``"backprop"``, ``"checkpoint"``,
    ``"symplectic"`` (``params``: the tensors the field reads that the replay's gradient reaches)."""
    if mode == "none":
        return functools.partial(stepper.sweep, graph=False)
    if mode == "backprop":
        return lambda y, k0, rows: stepper.sweep(y, k0, rows, graph=True)
    if stepper.differentiated:  # the clocks travel from sweep to sweep through autograd
        stepper.keep = True
        return controlled_advance(mode, stepper, params)
    replayed = _CheckpointSweep if mode == "checkpoint" else _SymplecticSweep

    def replay(y: torch.Tensor, k0: torch.Tensor, rows: RowClocks) -> Sweep:
        box: list[Sweep] = []
        y1, k1, *values = replayed.apply(stepper, rows, box, y, k0, *params)
        sw = box[0]
        sw.y, sw.k0, sw.values = y1, k1, values
        return sw

    return replay


def integrate_rows(
    stepper: Stepper,
    y: torch.Tensor,
    times: torch.Tensor,
    rtol: torch.Tensor,
    atol: torch.Tensor,
    info: Any,
    *,
    max_steps: int,
    first_step: float | None,
    advance: Advance,
    hook: Callable[[Sweep, RowClocks], None] | None = None,
) -> torch.Tensor:
    """Sweeps from ``y`` (``(B, N)``) until every row has reached its last output time; the outputs as
    ``(n · B, N)`` (row ``j · B + b``: sample ``b`` at ``times[b, j]``; the last, the row's state at its end).
    Finished rows leave the batch once a quarter of the running rows have finished; until then they ride along
    frozen at their end. Once no more than ``B / 16`` rows are left they all stay to the end: a compaction costs
    about a sweep's overhead, and what it would save is then at most a sixteenth of a full sweep's field work.
    ``hook`` sees each sweep with the clocks it started from."""
    B, n = times.shape
    k0, rows = start(stepper, y, times, rtol, atol, first_step)
    device = y.device
    # per row: sweeps with an accepted or frozen step (frozen rows always accept) and sweeps after which it still
    # ran, tallied from the sweeps' flags at each compaction
    passed = torch.zeros(B, dtype=torch.long, device=device)
    ran = torch.zeros(B, dtype=torch.long, device=device)
    flags: list[torch.Tensor] = []
    n_live = B
    positions: list[torch.Tensor] = [rows.ids]
    end = (n - 1) * B  # the last output's offset
    values: list[torch.Tensor] = [y]
    sweeps = 0
    while True:
        sweeps += 1
        if sweeps > max_steps:
            raise SolverError(
                f"per-sample control took max_steps={max_steps} sweeps without finishing ({len(rows.ids)} "
                "samples still running); raise `max_steps` or loosen `rtol`/`atol`.",
                nfe=info.nfe,
                reason=Reason.MAX_STEPS,
            )
        sw = advance(y, k0, rows)
        if hook is not None:
            hook(sw, rows)
        flags += (sw.ok, sw.alive)
        if sw.n_bad:
            raise _failure(sw, rows, info.nfe)
        values += sw.values
        positions += sw.positions
        y, k0, rows, live, n_live = sw.y, sw.k0, sw.rows, sw.alive, sw.n_alive
        if n_live == 0:
            break
        m = rows.ids.shape[0]
        if n_live <= m * 3 // 4 and m > B // 16:  # compaction
            passed, ran = _tally(flags, passed, ran)
            done = (~live).nonzero()[:, 0]
            _count(info, rows.ids[done], passed[done], ran[done], sweeps)
            values.append(y.index_select(0, done))
            positions.append(rows.ids[done] + end)
            keep = live.nonzero()[:, 0]
            y, k0, passed, ran = (v.index_select(0, keep) for v in (y, k0, passed, ran))
            rows = rows.select(keep)
    passed, ran = _tally(flags, passed, ran)
    _count(info, rows.ids, passed, ran, sweeps)
    values.append(y)
    positions.append(rows.ids + end)
    info.sweeps = sweeps
    out = y.new_zeros(n * B, y.shape[1])
    return out.index_put((torch.cat(positions),), torch.cat(values))


def _tally(flags: list[torch.Tensor], passed: torch.Tensor, ran: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``passed`` and ``ran`` with the sweeps' ``(ok, alive)`` flags since the last tally added (``flags``
    emptied): one sum for all those sweeps rather than an update each sweep."""
    if not flags:
        return passed, ran
    ok, alive = torch.stack(flags).view(-1, 2, passed.shape[0]).sum(0, dtype=torch.long)
    flags.clear()
    return passed + ok, ran + alive


def _count(info: Any, ids: torch.Tensor, passed: torch.Tensor, ran: torch.Tensor, sweeps: int) -> None:
    """Accepted and rejected steps of finished rows: ``passed`` less the sweeps they rode along frozen (a row
    finished in sweep ``ran + 1``)."""
    last = ran + 1
    accepted = passed - (sweeps - last)
    info.steps[ids] = accepted
    info.rejected[ids] = last - accepted


def _failure(sw: Sweep, rows: RowClocks, nfe: int) -> SolverError:
    assert sw.bad is not None
    row = int(sw.bad.nonzero()[0])
    b = int(rows.ids[row])
    nonfinite = not math.isfinite(float(sw.ratio[row]))
    what = "the state became non-finite (NaN/inf)"
    if not nonfinite:
        what = f"the step size underflowed (t={float(rows.t0[row]):g})"
    return SolverError(
        f"per-sample control: {what} in sample {b} after {nfe} batched field evaluations; tighten `rtol`/`atol`, "
        "use float64, or check that sample's input.",
        nfe=nfe,
        reason=Reason.NONFINITE if nonfinite else Reason.UNDERFLOW,
    )


class _ReplayedSweep(torch.autograd.Function):
    """One sweep without a graph, its inputs and decisions kept for a replay in the backward pass."""

    @staticmethod
    def forward(ctx, stepper: Stepper, rows: RowClocks, box: list, y: torch.Tensor, k0: torch.Tensor, *params):
        remember_inputs(ctx, y, k0, *params)
        with torch.no_grad():
            sw = stepper.sweep(y, k0, rows, graph=False)
        box.append(sw)
        ctx.stepper, ctx.rows, ctx.ok, ctx.outs = stepper, rows, sw.ok, list(zip(sw.out_rows, sw.out_w))
        ctx.jumped, ctx.first = sw.jumped, stepper.recorded == 0
        stepper.recorded += 1
        ctx.save_for_backward(y, k0, *params)
        return (sw.y, sw.k0, *sw.values)


class _CheckpointSweep(_ReplayedSweep):
    """The sweep's stages recomputed with a graph, its outputs rebuilt with the forward's decisions."""

    @staticmethod
    @first_order("checkpoint", fix=PER_SAMPLE_FIX)
    def backward(ctx, g_y, g_k, *g_values):
        st, rows = ctx.stepper, ctx.rows
        y, k0, *params = ctx.saved_tensors
        okc = ctx.ok[:, None]
        with torch.enable_grad():
            yv, kv = y.detach().requires_grad_(), k0.detach().requires_grad_()
            K, _, Y, k_last = st.stages(yv, kv, rows, graph=True)
            k_new = torch.where(okc, k_last, kv)
            jr = ctx.jumped
            if jr is not None:
                k_new = k_new.index_put((jr,), st.after_jump(rows.t1[jr], Y[jr], rows.ids[jr], rows.span))
            outs = [torch.where(okc, Y, yv), k_new]
            outs += [dense(yv, K, r, w) for r, w in ctx.outs]
            pairs = [(o, g) for o, g in zip(outs, (g_y, g_k, *g_values)) if g is not None]
            grads = torch.autograd.grad(
                [o for o, _ in pairs], [yv, kv, *params], [g for _, g in pairs], allow_unused=True
            )
        count_replayed(ctx)
        return (None, None, None, *grads)


class _SymplecticSweep(_ReplayedSweep):
    """The sweep's backward pass is the symplectic adjoint of its steps."""

    @staticmethod
    @first_order("symplectic", fix=PER_SAMPLE_FIX)
    def backward(ctx, g_y, g_k, *g_values):
        st, rows = ctx.stepper, ctx.rows
        y, k0, *params = ctx.saved_tensors
        g_y = torch.zeros_like(y) if g_y is None else g_y
        g_k = torch.zeros_like(y) if g_k is None else g_k
        okc = ctx.ok[:, None]
        h = rows.dt.to(y.dtype)[:, None]
        inputs: list[torch.Tensor] = []
        with torch.no_grad():
            st.stages(y, k0, rows, graph=False, inputs=inputs)
        grads: list[torch.Tensor | None] = [None] * len(params)
        jr = ctx.jumped
        if jr is not None:  # k_1 re-read past a jump from the new state: its cotangent goes to that state
            with torch.enable_grad():
                Y = inputs[-1][jr].detach().requires_grad_()
                f = st.after_jump(rows.t1[jr], Y, rows.ids[jr], rows.span)
                mu, *gp = torch.autograd.grad(f, [Y, *params], g_k[jr], allow_unused=True)
            grads = list(gp)
            g_y = g_y.index_add(0, jr, mu)
            g_k = g_k.index_fill(0, jr, 0.0)
        with torch.no_grad():
            lam_acc = torch.where(okc, g_y, 0)
            kappa: list[torch.Tensor | None] = [h * b * lam_acc if b != 0.0 else None for b in st.b]
            kappa[-1] = _add(kappa[-1], torch.where(okc, g_k, 0))
            lam_y, lam_k = g_y.clone(), torch.where(okc, 0, g_k)
            for (r, w), g in zip(ctx.outs, g_values):
                if g is None:
                    continue
                lam_y.index_add_(0, r, g)
                wh = w * h[r]  # the dense output's weights on the stages themselves
                for i in range(st.s):
                    kappa[i] = _add(kappa[i], torch.zeros_like(y).index_add_(0, r, wh[:, i : i + 1] * g))
        ts = st.stage_times(rows.t0, rows.dt, rows.t1, rows.span)
        for i in range(st.s - 1, 0, -1):
            kap = kappa[i]
            if kap is None:
                continue
            with torch.enable_grad():
                Y = inputs[i].detach().requires_grad_()
                f = st.F(ts[i], Y, rows.ids)
                mu, *gp = torch.autograd.grad(f, [Y, *params], kap, allow_unused=True)
            grads = [_add(a, b) for a, b in zip(grads, gp)]
            lam_y += mu
            for j, a in enumerate(st.tab.tableau.a[i]):
                if a != 0.0:
                    kappa[j] = _add(kappa[j], (a * h) * mu)
        lam_k = _add(lam_k, kappa[0])
        count_replayed(ctx)
        return (None, None, None, lam_y, lam_k, *grads)


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> Any:
    return b if a is None else (a if b is None else a + b)
