r"""The replayed sweeps of a per-sample solve with the step sizes differentiated (:mod:`solvers.gradients.step_sizes`).

A sweep maps each running row's ``(y, k_1)`` and its clocks ``(t_0, h, t_1, m)`` (start, step, end, the PI
controller's memory ``m``) to the new ones: the stages, the error ratio ``ρ`` over the row's components, the
controller ``h ← h · clip(scale · ρ^(−α) m, dfactor, cap)`` and memory ``m ← max(ρ, floor)^β`` of an accepted
step (:mod:`solvers.per_sample.control`), the end clipped to the row's last output time or the next jump, and the
dense outputs at ``x = (t_j − t_0) / (t_1 − t_0)``. Here the clocks are inputs and outputs of each sweep's
autograd function, so that their dependence on the state travels from sweep to sweep:

- ``checkpoint`` rebuilds the sweep's graph from its stored inputs, on the branches the forward took (accepted
  rows, clipped factors, outputs due);
- ``symplectic`` recomputes the stages without a graph and takes the cotangents back stage by stage, one
  evaluation's graph at a time (Matsubara, Miyatake & Yaguchi 2021, as
  :func:`solvers.gradients.replay_controlled.stagewise`), each vector-Jacobian product taken in the field's times too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..gradients.replay_controlled import field_vjp, stagewise
from ..gradients.second_order import PER_SAMPLE_FIX, first_order, remember_inputs
from .loop import RowClocks, Stepper, Sweep, dense, dense_weights

__all__ = ["controlled_advance", "count_replayed", "with_clocks"]


def with_clocks(rows: RowClocks, t0: torch.Tensor, dt: torch.Tensor, t1: torch.Tensor, prev: torch.Tensor) -> RowClocks:
    """``rows`` with these clocks (tensors that may carry graphs)."""
    r = rows
    return RowClocks(r.ids, t0, dt, t1, r.on_jump, r.tl, r.tt, r.cursor, r.t_next, r.rtol, r.atol, prev, r.cap, r.span)


class _Accumulator:
    """The parameters' gradients, summed over the evaluations of a stagewise backward pass."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self.g: list[torch.Tensor | None] = [None] * len(self.params)

    def fresh(self) -> None:
        pass

    def inputs(self):
        return self.params, None

    def add(self, grads, keys) -> None:
        self.g = [a if b is None else (b if a is None else a + b) for a, b in zip(self.g, grads)]


class _Controlled(torch.autograd.Function):
    """One sweep without a graph; its inputs, clocks and the controller's branches kept for the backward pass."""

    @staticmethod
    def forward(ctx, st: Stepper, rows: RowClocks, box: list, y, k0, t0, dt, t1, prev, *params):
        remember_inputs(ctx, y, k0, t0, dt, t1, prev, *params)
        with torch.no_grad():
            sw = st.sweep(y, k0, rows, graph=False)
        box.append(sw)
        ctx.stepper, ctx.rows, ctx.d = st, rows, sw.decision
        ctx.outs = list(zip(sw.out_rows, sw.out_t))
        ctx.jumped, ctx.first = sw.jumped, st.recorded == 0
        st.recorded += 1
        ctx.save_for_backward(y, k0, t0, dt, t1, prev, *params)
        n = sw.rows
        return (sw.y, sw.k0, n.t0, n.dt, n.t1, n.prev, *sw.values)


def _outputs(ctx, rg: RowClocks, yv, kv, K, Y, k_last, k_jump=None) -> list[torch.Tensor]:
    """The sweep's outputs ``(y, k_1, t_0, h, t_1, m, dense outputs…)`` on the forward's branches, as functions of
    its inputs (``rg``: the clocks it started from) and stages; ``k_jump``: the first stage past a jump, where
    the caller evaluates it itself."""
    st, d = ctx.stepper, ctx.d
    okc = d.ok[:, None] if d.ok_n is None else d.ok_n
    t_new, dt, t1, prev = st.control.differentiated(rg, d, K, st.e, yv, Y)
    if not d.n_bad and st.jumps is not None:
        planned = st.plan(with_clocks(rg, t_new, dt, t1, prev), t_new, dt, t1)
        dt, t1 = planned.dt, planned.t1
    k_new = torch.where(okc, k_last, kv)
    jr = ctx.jumped
    if jr is not None:
        if k_jump is None:
            k_jump = st.after_jump(rg.t1[jr], Y[jr], rg.ids[jr], rg.span)
        k_new = k_new.index_put((jr,), k_jump)
    values = [dense(yv, K, r, dense_weights(st, (tj - rg.t0[r]) / (rg.t1[r] - rg.t0[r]))) for r, tj in ctx.outs]
    return [torch.where(okc, Y, yv), k_new, t_new, dt, t1, prev, *values]


def _leaves(ctx) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    y, k0, t0, dt, t1, prev, *params = ctx.saved_tensors
    return [v.detach().requires_grad_() for v in (y, k0, t0, dt, t1, prev)], params


class ControlledCheckpointSweep(_Controlled):
    """The sweep's graph rebuilt from its stored inputs on the forward's branches."""

    @staticmethod
    @first_order("checkpoint", fix=PER_SAMPLE_FIX)
    def backward(ctx, *cots):
        leaves, params = _leaves(ctx)
        with torch.enable_grad():
            yv, kv, t0, dt, t1, prev = leaves
            rg = with_clocks(ctx.rows, t0, dt, t1, prev)
            K, _, Y, k_last = ctx.stepper.stages(yv, kv, rg, graph=True)
            outs = _outputs(ctx, rg, yv, kv, K, Y, k_last)
            pairs = [(o, g) for o, g in zip(outs, cots) if g is not None and o.requires_grad]
            grads = torch.autograd.grad(
                [o for o, _ in pairs], [*leaves, *params], [g for _, g in pairs], allow_unused=True
            )
        count_replayed(ctx)
        return (None, None, None, *grads)


class ControlledSymplecticSweep(_Controlled):
    """The sweep's cotangents taken back one stage evaluation at a time."""

    @staticmethod
    @first_order("symplectic", fix=PER_SAMPLE_FIX)
    def backward(ctx, *cots):
        st = ctx.stepper
        leaves, params = _leaves(ctx)
        yv, kv, t0, dt, t1, prev = leaves
        rows = ctx.rows
        s = st.s
        with torch.no_grad():  # the stage values: inputs Y_i and slopes k_i at the times T_i
            y, k0 = yv.detach(), kv.detach()
            ts = st.stage_times(t0.detach(), dt.detach(), t1.detach(), rows.span)
            h = dt.detach().to(y.dtype)[:, None]
            ks, Ys = [k0], [y]
            for i in range(1, s):
                Ys.append(_combine(y, h, ks, st.tab.tableau.a[i]))
                ks.append(st.F(ts[i], Ys[i], rows.ids))
            jr = ctx.jumped
            after = None
            if jr is not None:
                after = (Ys[-1][jr], rows.t1[jr])
                ks_jump = st.after_jump(rows.t1[jr], Ys[-1][jr], rows.ids[jr], rows.span)
        acc = _Accumulator(params)
        with torch.enable_grad():
            rg = with_clocks(rows, t0, dt, t1, prev)
            tg = st.stage_times(t0, dt, t1, rows.span)
            hg = dt.to(yv.dtype)[:, None]
            kl = [k.detach().requires_grad_() for k in ks[1:]]
            kall = [kv, *kl]
            Yg = [yv] + [_combine(yv, hg, kall, st.tab.tableau.a[i]) for i in range(1, s)]
            K = torch.stack([hg * k for k in kall])
            points = [(Yg[i], tg[i]) for i in range(1, s)]
            wrt = [*leaves, *kl]
            kj = None
            if after is not None:
                kj = ks_jump.detach().requires_grad_()
                wrt.append(kj)
                tj = rg.t1[jr].to(yv.dtype)
                points.append((Yg[-1][jr], tj))
            outs = _outputs(ctx, rg, yv, kv, K, Yg[-1], kl[-1], kj)
            pairs = [(o, g) for o, g in zip(outs, cots) if g is not None]

            def vjp(i: int, kappa: torch.Tensor):
                if after is not None and i == len(points) - 1:  # the field just past the jump
                    Yj, T1 = after
                    return field_vjp(st.F, Yj, st.after_time(T1, rows.span), kappa, acc, rows.ids[jr])
                return field_vjp(st.F, Ys[i + 1], ts[i + 1], kappa, acc, rows.ids)

            got = stagewise([o for o, _ in pairs], [g for _, g in pairs], wrt, 6, points, vjp)
        count_replayed(ctx)
        return (None, None, None, *got, *acc.g)


def _combine(y: torch.Tensor, h: torch.Tensor, ks: Sequence[torch.Tensor], a: Sequence[float]) -> torch.Tensor:
    """``y + Σ_j a_j (h k_j)``."""
    out = y
    for w, k in zip(a, ks):
        if w != 0.0:
            out = out + w * (h * k)
    return out


def count_replayed(ctx) -> None:
    """Count a replayed sweep: the replay of the forward's first sweep ends the backward pass (every output
    depends on it), and the backward counts are then complete."""
    info = ctx.stepper.F.info
    back = info.backward
    if back is None:
        return
    back.sweeps += 1
    if ctx.first:
        back.steps.copy_(info.steps)
        back.rejected.copy_(info.rejected)
        if info.on_backward is not None:
            info.on_backward(back)


def controlled_advance(mode: str, st: Stepper, params: Sequence[torch.Tensor]):
    """One sweep as ``mode`` (``"checkpoint"``/``"symplectic"``) records it, its clocks carried by autograd."""
    fn = ControlledCheckpointSweep if mode == "checkpoint" else ControlledSymplecticSweep

    def advance(y: torch.Tensor, k0: torch.Tensor, rows: RowClocks) -> Sweep:
        box: list[Sweep] = []
        y1, k1, t0, dt, t1, prev, *values = fn.apply(
            st, rows, box, y, k0, rows.t0, rows.dt, rows.t1, rows.prev, *params
        )
        sw = box[0]
        sw.y, sw.k0, sw.values = y1, k1, values
        sw.rows = with_clocks(sw.rows, t0, dt, t1, prev)
        return sw

    return advance
