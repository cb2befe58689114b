r"""The sweeps of a per-sample solve (:mod:`solvers.per_sample.solve`): each running row takes one attempted step.

A sweep is a pure function of the rows' state ``(y, k_1)`` and their clocks (:class:`RowClocks`):

    ``Y_i = y + h_b Σ_{j<i} a_ij k_j``,   ``k_i = F(t_b + c_i h_b, Y_i)``,   ``err_b = h_b Σ_i e_i k_i``,

the error ratio ``r_b = ‖err_b / (atol_b + rtol_b max(|y_b|, |Y_{b,s}|))‖_RMS`` over the sample's own components,
acceptance ``r_b ≤ 1`` (Hairer, Nørsett & Wanner, "Solving Ordinary Differential Equations I", §II.4) and the
next step from a PI controller (:mod:`solvers.per_sample.control`), taken on every row at once, decided by
``torch.where`` on the device. Outputs due inside an accepted step are read off the
method's dense output ``y(t_0 + x h) = y_0 + h Σ_i β_i(x) k_i``. Being pure, a sweep can be replayed: the
gradient methods (:mod:`solvers.per_sample.grads`) recompute it from its stored inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..steppers.fast_rk import _dense_weights
from ..steppers.tableaux import MethodTableau
from .control import Controller, Decision, in_dtype

__all__ = ["TIME_SPAN", "PerSampleInfo", "Sweep", "RowClocks", "Stepper", "dense", "root"]

_LANES = 16  # a multiple of every CPU vector width in float64

# attribute of the time tensors a field sees, with ``spans``: ``(least, greatest)`` of their values, on the host
TIME_SPAN = "_time_span"


def root(x: torch.Tensor, p: int) -> torch.Tensor:
    """``x^(1/p)`` of a vector, elementwise, independent of the vector's length: padded to whole SIMD vectors, as
    a vectorised ``pow`` and the scalar one of a short tail differ in the last bit (which would make a sample's
    steps depend on its place in the batch)."""
    m = x.shape[0]
    padded = torch.nn.functional.pad(x, (0, -m % _LANES))
    return (padded.pow(1.0 / p) if x.requires_grad else padded.pow_(1.0 / p))[:m]


@dataclass
class PerSampleInfo:
    """What one per-sample solve did: ``steps``/``rejected``: ``(batch,)`` accepted and rejected steps of each
    sample; ``sweeps``: batched steps taken (the most any sample attempted); ``nfe``: batched field calls;
    ``rows``: field evaluations summed over rows (the work a row-parallel field does); ``backward``: the same for
    the backward pass, once it has run: the adjoint's backward solve (steps summed over its output intervals) or
    the replay of the sweeps (``checkpoint``, ``symplectic``: the forward's steps, and the evaluations the replay
    made); ``on_backward``, if set, is called with ``backward`` when the backward pass is done."""

    steps: torch.Tensor
    rejected: torch.Tensor
    sweeps: int = 0
    nfe: int = 0
    rows: int = 0
    backward: PerSampleInfo | None = None
    on_backward: Callable[[PerSampleInfo], None] | None = None

    @staticmethod
    def zeros(B: int, device: torch.device) -> PerSampleInfo:
        z = torch.zeros(B, dtype=torch.long, device=device)
        return PerSampleInfo(steps=z, rejected=z.clone())


@dataclass
class RowClocks:
    """The clocks of the running rows (float64, ``(m,)`` each; ``tt``: ``(m, n + 1)`` output times padded with
    ``inf``): ``ids`` their batch rows, ``t1`` the end of the step about to be taken (``t0 + dt``, or the jump it
    was shortened to land on, ``on_jump``), ``cursor`` the next output each owes and ``t_next`` its time,
    ``rtol``/``atol`` ``(m, 1)`` in the state's dtype (``(m, N)`` for a few components), ``prev``/``cap`` the
    controller's memory of the row (:mod:`solvers.per_sample.control`); ``span`` the least and greatest time of
    the sweep on the host (with ``Stepper.spans``)."""

    ids: torch.Tensor
    t0: torch.Tensor
    dt: torch.Tensor
    t1: torch.Tensor
    on_jump: torch.Tensor
    tl: torch.Tensor
    tt: torch.Tensor
    cursor: torch.Tensor
    t_next: torch.Tensor
    rtol: torch.Tensor
    atol: torch.Tensor
    prev: torch.Tensor
    cap: torch.Tensor
    span: tuple[float, float] | None = None

    def select(self, keep: torch.Tensor) -> RowClocks:
        """The rows ``keep``; the float64 clocks are gathered together (one gather for seven; where the moving clocks
        carry graphs, apart from the constant ones, which must not join those graphs)."""
        if self.t0.requires_grad or self.dt.requires_grad or self.prev.requires_grad:
            t0, dt, t1, prev = (v.index_select(0, keep) for v in (self.t0, self.dt, self.t1, self.prev))
            tl, t_next, cap = torch.stack((self.tl, self.t_next, self.cap)).index_select(1, keep)
        else:
            t0, dt, t1, tl, t_next, prev, cap = torch.stack(
                (self.t0, self.dt, self.t1, self.tl, self.t_next, self.prev, self.cap)
            ).index_select(1, keep)
        other = (self.ids, self.on_jump, self.tt, self.cursor, self.rtol, self.atol)
        ids, on_jump, tt, cursor, rtol, atol = (v.index_select(0, keep) for v in other)
        return RowClocks(ids, t0, dt, t1, on_jump, tl, tt, cursor, t_next, rtol, atol, prev, cap, self.span)

    def clocks(self, t0: torch.Tensor, dt: torch.Tensor, t1: torch.Tensor, on_jump: torch.Tensor) -> RowClocks:
        """These rows with new clocks (a direct construction: ``dataclasses.replace`` costs a sweep ~10 µs)."""
        clocks = (on_jump, self.tl, self.tt, self.cursor, self.t_next, self.rtol, self.atol, self.prev, self.cap)
        return RowClocks(self.ids, t0, dt, t1, *clocks, self.span)


@dataclass
class Sweep:
    """One sweep's result: the new ``(y, k_1)``; ``values`` the outputs given (rows ``out_rows`` of this sweep,
    dense weights ``out_w`` ``(r, s)`` on the stored ``h k_i``, at flat positions ``j · B + b`` of the output);
    the control's decisions, detached."""

    y: torch.Tensor
    k0: torch.Tensor
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    out_rows: list[torch.Tensor]
    out_w: list[torch.Tensor]
    out_t: list[torch.Tensor]  # the output times of those rows
    rows: RowClocks  # the clocks after the sweep
    jumped: torch.Tensor | None  # rows whose accepted step ended on a jump: k_1 re-read on its far side
    ok: torch.Tensor
    ratio: torch.Tensor  # √N times the error ratio (valid until the next sweep)
    decision: Decision  # the controller's (a replay rebuilds the sweep's graph on its branches)
    alive: torch.Tensor
    bad: torch.Tensor | None  # running rows whose step failed, when there are any
    n_alive: int
    n_bad: int


class _Work:
    """Buffers of a sweep without a graph for ``m`` running rows: the stages ``K`` (``s × m × N``), the views
    of their combinations and the stage inputs (nothing of a sweep outlives it: the new state is a fresh
    ``torch.where``). Made once per solve, for the whole batch; a compacted batch takes views of the same
    memory."""

    store: tuple[torch.Tensor, list[torch.Tensor]]  # the stages (s, B, N) and the stage inputs (B N,)

    def __init__(self, s: int, m: int, N: int, dtype: torch.dtype, device: torch.device, old: _Work | None):
        if old is None or old.store[0].shape[1] < m or old.store[0].shape[2] != N:
            # one tensor each: a field that differentiates its input (the adjoint's) keeps it in a graph, and
            # views of one tensor share its version counter, so writing the next stage input would void that graph
            inputs = [torch.empty(m * N, dtype=dtype, device=device) for _ in range(s)]
            self.store = (torch.empty((s, m, N), dtype=dtype, device=device), inputs)
        else:
            self.store = old.store
        K, inputs = self.store
        self.m = m
        self.h = torch.empty((m, N), dtype=dtype, device=device)
        self.hT = self.h.t()  # the step is copied into it as a row: on every component of its sample
        self.K = K[:, :m]
        self.flat = K.view(s, -1)[:, : m * N]
        flat_t = self.flat.t()
        self.KT = [flat_t[:, :i] for i in range(s + 1)]  # (a view each: made at every new row count)
        self.rows = list(self.K.unbind(0))
        inputs_flat = [v[: m * N] for v in inputs[1:]]
        # what stage i (1 ≤ i < s) reads and writes: the stages before it, its input (flat and (m, N)), its row
        self.plan = list(zip(self.KT[1:s], inputs_flat, [v.view(m, N) for v in inputs_flat], self.rows[1:s]))


_CONSTANTS: dict[tuple, tuple] = {}


def _constants(tab: MethodTableau, dtype: torch.dtype, device: torch.device) -> tuple:
    """A method's tensors, made once per dtype and device (read only): error weights ``e``, dense-output
    weights ``P`` (``(4, s)``), the rows of ``a``, the nodes ``c`` (``(s, 1)``, float64) and ``−inf``."""
    key = (tab.name, dtype, device)
    made = _CONSTANTS.get(key)
    if made is None:
        kw: dict[str, Any] = dict(dtype=dtype, device=device)
        made = _CONSTANTS[key] = (
            torch.tensor(tab.error, **kw),
            torch.tensor(_dense_weights(tab), **kw),
            [torch.tensor(row, **kw) for row in tab.tableau.a],
            torch.tensor(tab.tableau.c, dtype=torch.float64, device=device)[:, None],
            torch.tensor(-math.inf, **kw),
        )
    return made


class Stepper:
    """A method's sweep on ``(m, N)`` rows: ``F(t, y, ids)`` the counted field (``t``: ``(m,)`` in the state's
    dtype), ``B`` the batch size (for output positions)."""

    def __init__(self, F: Any, tab: MethodTableau, y0: torch.Tensor, opts: dict, B: int):
        self.F, self.tab, self.B, self.options = F, tab, B, opts
        self.dtype, self.device = y0.dtype, y0.device
        self.order, self.s = tab.order, tab.stages
        self.control = Controller(tab.order, opts, y0.device)
        self.min_step, self.max_step = self.control.min_step, self.control.max_step
        self.e, self.P, self.a, self.c, self.neg_inf = _constants(tab, y0.dtype, y0.device)
        self.P_rows = self.P.unbind(0)
        self.a_rows = self.a[1:]  # the rows of a that make the stage inputs
        self.b = tab.tableau.b
        c = tab.tableau.c
        self.tail = c.index(1.0)  # the stages at c = 1 close the tableau (dopri5: the last two; bosh3: the last)
        assert all(ci == 1.0 for ci in c[self.tail :])
        self.fsal = True  # k_1 of a step is the last stage of the step before (the adjoint re-evaluates it)
        self.jumps: torch.Tensor | None = None  # times where the field jumps (float64, increasing), + inf
        self.work: _Work | None = None
        self.recorded = 0  # sweeps recorded for a replay in the backward pass
        self.spans = False  # True: every time tensor the field sees carries its span (TIME_SPAN)
        self.c_head = self.c[: self.tail]  # the nodes before those at c = 1
        self.times_buffer: tuple | None = None  # (rows, buffer, its last row, the stage times: views of it)
        # a sweep with a graph carries the clocks' dependence on the state (solvers.gradients.step_sizes)
        self.differentiated = False
        self.keep = False  # keep the controller's factor in each sweep's decision (a replay rebuilds its graph)

    def plan(self, rows: RowClocks, t0: torch.Tensor, dt: torch.Tensor, t1: torch.Tensor | None = None) -> RowClocks:
        """The next step of every row: ``t1 = min(t0 + dt, t_end)`` (given ``t1``, as the controller clips it),
        shortened to land on the next jump of the field strictly inside it (as torchdiffeq's ``jump_t``:
        ``dt = t_jump − t0``)."""
        if t1 is None:
            t1 = torch.minimum(t0 + dt, rows.tl)
            dt = t1 - t0
        on_jump = rows.on_jump
        if self.jumps is not None:
            jump = self.jumps[torch.searchsorted(self.jumps, t0, right=True)]
            on_jump = (t0 < jump) & (jump < t1)
            dt, t1 = torch.where(on_jump, jump - t0, dt), torch.where(on_jump, jump, t1)
        return rows.clocks(t0, dt, t1, on_jump)

    def stage_times(
        self, t0: torch.Tensor, dt: torch.Tensor, t1: torch.Tensor | None = None, span: tuple | None = None
    ) -> list[torch.Tensor]:
        """The ``s`` stage times (``(m,)`` each, in the state's dtype); those at ``c = 1`` just before ``t_1``, as
        the shared step evaluates them. Each carries ``span`` (:data:`TIME_SPAN`) when given."""
        ts = torch.addcmul(t0, self.c, dt)
        end = t0 + dt if t1 is None else t1
        if self.dtype != torch.float64:
            ts, end = ts.to(self.dtype), end.to(self.dtype)
        out = list(ts.unbind(0))
        if end.requires_grad:  # the neighbour below, with the end's derivative (nextafter has none)
            below = end + (torch.nextafter(end.detach(), self.neg_inf) - end.detach())
        else:
            below = torch.nextafter(end, self.neg_inf)
        out[self.tail :] = [below] * (self.s - self.tail)
        if span is not None:
            for t in out[: self.tail + 1]:
                setattr(t, TIME_SPAN, span)
        return out

    def reused_times(self, rows: RowClocks) -> list[torch.Tensor]:
        """:meth:`stage_times` (float64 states) written into a buffer made once per row count: the same values,
        without a new tensor a stage (a sweep without a graph: the field sees these times during its call only,
        as it sees the stage inputs in reused buffers)."""
        m = rows.t0.shape[0]
        made = self.times_buffer
        if made is None or made[0] != m:
            buf = torch.empty((self.tail + 1, m), dtype=torch.float64, device=self.device)
            views = list(buf.unbind(0))
            made = self.times_buffer = (
                m,
                buf[: self.tail],
                views[self.tail],
                views + views[-1:] * (self.s - self.tail - 1),
            )
        _, head, tail, out = made
        torch.addcmul(rows.t0, self.c_head, rows.dt, out=head)
        torch.nextafter(rows.t1, self.neg_inf, out=tail)
        if rows.span is not None:
            for t in out[: self.tail + 1]:
                setattr(t, TIME_SPAN, rows.span)
        return out

    def stages(self, y, k0, rows: RowClocks, graph: bool, inputs: list | None = None, ts: list | None = None):
        """The stages times the step, ``h k_i`` (``(s, m, N)``), their flat view, the last stage input ``Y_s``
        and the last stage ``k_s`` itself; ``inputs`` collects every stage input ``Y_i``. Each stage input is
        ``Y_i = y + Σ_j a_ij (h k_j)``: one product with the stored stages, as the shared step's ``addmv``."""
        m, N, s = y.shape[0], y.shape[1], self.s
        dt = rows.dt if self.dtype == torch.float64 else rows.dt.to(self.dtype)
        tsr = self.stage_times(rows.t0, rows.dt, rows.t1, rows.span) if ts is None else ts
        a, F, ids = self.a, self.F, rows.ids
        Y, k = y, k0
        if inputs is not None:
            inputs.append(y)
        if graph:  # every stage its own tensor, stacked for each combination
            h = dt[:, None]
            hks, yf = [h * k0], y.view(m * N)
            for i in range(1, s):
                Y = torch.addmv(yf, torch.stack(hks).view(i, m * N).t(), a[i]).view(m, N)
                if inputs is not None:
                    inputs.append(Y)
                k = F(tsr[i], Y, ids)
                hks.append(h * k)
            K = torch.stack(hks)
            return K, K.view(s, m * N), Y, k
        W = self.work
        if W is None or W.m != m:  # stages in a reused stage-major buffer, each combination one product
            W = self.work = _Work(s, m, N, self.dtype, self.device, W)
        W.hT.copy_(dt)  # the step on every component: each scaling below then broadcasts nothing
        h = W.h
        torch.mul(k0, h, out=W.rows[0])
        yf = y.view(m * N)
        for (KT, Y_flat, Y, K_row), a_i, t in zip(W.plan, self.a_rows, tsr[1:]):
            torch.addmv(yf, KT, a_i, out=Y_flat)
            if inputs is not None:
                inputs.append(Y)
            k = F(t, Y, ids)
            torch.mul(k, h, out=K_row)
        return W.K, W.flat, Y, k

    def sweep(self, y: torch.Tensor, k0: torch.Tensor, rows: RowClocks, graph: bool) -> Sweep:
        """One attempted step of every row (``graph``: keep the autograd graph of the values); the control
        (:mod:`solvers.per_sample.control`) works on detached values."""
        if graph or self.dtype != torch.float64:
            ts = self.stage_times(rows.t0, rows.dt, rows.t1, rows.span)
        else:
            ts = self.reused_times(rows)
        if not self.fsal:
            k0 = self.F(ts[0], y, rows.ids)
        K, flat, Y, k_last = self.stages(y, k0, rows, graph, ts=ts)
        jumps = self.jumps is not None
        keep = self.differentiated or self.keep
        if graph:
            with torch.no_grad():
                d = self.control.decide(
                    rows, flat.detach().t(), self.e, y.detach(), Y.detach(), jumps, self.spans, keep
                )
            if self.differentiated:
                d = _attached(d, self.control.differentiated(rows, d, K, self.e, y, Y))
        else:  # run under no-grad already (the stages went to buffers)
            assert self.work is not None
            d = self.control.decide(rows, self.work.KT[self.s], self.e, y, Y, jumps, self.spans, keep)
        outs = _Outputs() if d.n_due else _NONE
        cursor, t_next, due, n_due = rows.cursor, rows.t_next, d.due, d.n_due
        t0, t1 = rows.t0, rows.t1
        while due is not None and n_due and not d.n_bad:  # outputs within the accepted steps: dense output
            r = due.nonzero()[:, 0]
            outs.add(self, y, K, r, t_next[r], t0[r], t1[r], (cursor * self.B + rows.ids)[r])
            cursor = cursor + due
            t_next = rows.tt.gather(1, cursor[:, None])[:, 0]
            due = due & (t_next <= t1)
            n_due = int(due.sum())
        okc = d.ok[:, None] if d.ok_n is None else d.ok_n
        clocks = (d.t_new, d.dt, d.t1, rows.on_jump, rows.tl, rows.tt, cursor, t_next, rows.rtol, rows.atol)
        new = RowClocks(rows.ids, *clocks, d.prev, d.cap, d.span)
        if not d.n_bad and self.jumps is not None:
            new = self.plan(new, d.t_new, d.dt, d.t1)
        k_new = torch.where(okc, k_last, k0)
        jr = d.jumped.nonzero()[:, 0] if d.jumped is not None and not d.n_bad else None
        if jr is not None:  # past a jump of the field: the next step's first stage on its far side
            k_new = k_new.index_put((jr,), self.after_jump(t1[jr], Y[jr], rows.ids[jr], rows.span))
        bad = d.alive & ~d.moved if d.n_bad else None
        y_new = torch.where(okc, Y, y)
        # positional: a dataclass takes its keywords about 1 µs slower (the fields' order: see Sweep)
        return Sweep(
            y_new,
            k_new,
            outs.values,
            outs.positions,
            outs.rows,
            outs.weights,
            outs.times,
            new,
            jr,
            d.ok,
            d.norm,
            d,
            d.alive,
            bad,
            d.n_alive,
            d.n_bad,
        )

    def after_jump(self, t1: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, span: tuple | None) -> torch.Tensor:
        """``F`` just after the jump ``t1`` (as torchdiffeq re-reads it, ``nextafter(t1, +inf)``); ``span``
        that of the sweep ending on it."""
        return self.F(self.after_time(t1, span), y, ids)

    def after_time(self, t1: torch.Tensor, span: tuple | None) -> torch.Tensor:
        """The time just after the jump ``t1`` in the state's dtype, with ``t1``'s derivative where it has one."""
        t = t1.to(self.dtype)
        if t.requires_grad:
            t = t + (torch.nextafter(t.detach(), -self.neg_inf) - t.detach())
        else:
            t = torch.nextafter(t, -self.neg_inf)
        if span is not None:
            setattr(t, TIME_SPAN, (span[0], math.nextafter(span[1], math.inf)))
        return t


def _attached(d: Decision, graphs: tuple[torch.Tensor, ...]) -> Decision:
    """``d`` with its new clocks carrying the graphs of :meth:`Controller.differentiated` (values ``d``'s own)."""
    t_new, dt, t1, prev = ((g - g.detach()) + v for v, g in zip((d.t_new, d.dt, d.t1, d.prev), graphs))
    return d._replace(t_new=t_new, dt=dt, t1=t1, prev=prev)


class _Outputs:
    """The outputs a sweep gives: ``y_0 + Σ_i β_i(x) (h k_i)`` on rows ``r`` at ``x = (t − t_0) / h``."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.times: list[torch.Tensor] = []

    def add(self, st: Stepper, y, K, r: torch.Tensor, tj, t0, t1, positions: torch.Tensor) -> None:
        """The outputs at times ``tj`` on rows ``r`` of the step ``[t0, t1]`` (``(r,)`` each)."""
        w = dense_weights(st, (tj - t0) / (t1 - t0))
        self.values.append(dense(y, K, r, w))
        self.positions.append(positions)
        self.rows.append(r)
        self.weights.append(w)
        self.times.append(tj)


_NONE = _Outputs()  # a sweep without outputs (never added to)


def dense_weights(st: Stepper, x: torch.Tensor) -> torch.Tensor:
    """The dense output's weights ``β_i(x)`` ``(r, s)`` at the rows' ``x`` ``(r,)``, differentiable in ``x`` when
    it carries a graph (a differentiated step's times)."""
    with torch.set_grad_enabled(x.requires_grad):
        x = x.to(st.dtype)[:, None]
        P0, P1, P2, P3 = st.P_rows
        w = torch.addcmul(P2, x, P3)
        w = torch.addcmul(P1, x, w)
        return torch.addcmul(P0, x, w) * x


def dense(y: torch.Tensor, K: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``y_0 + Σ_i w_i (h k_i)`` on rows ``r``: ``w`` ``(r, s)``, the stages times the step ``K`` ``(s, m, N)``."""
    return y[r] + torch.bmm(w[:, None], K[:, r].transpose(0, 1))[:, 0]


def initial_step(
    stepper: Stepper, t0: torch.Tensor, y: torch.Tensor, f0: torch.Tensor, rows: RowClocks
) -> torch.Tensor:
    """Hairer, Nørsett & Wanner's initial step (§II.4) for each row, in the state's dtype, as float64; a function
    of ``y`` and ``f0`` where the steps are differentiated (:mod:`solvers.gradients.step_sizes`), else a constant."""
    graph = stepper.differentiated and torch.is_grad_enabled()
    if not graph:
        y, f0 = y.detach(), f0.detach()
    with torch.set_grad_enabled(graph):
        scale = rows.atol + y.abs() * rows.rtol
        d0, d1 = _rms(y / scale), _rms(f0 / scale)
        tiny = (d0 < 1e-5) | (d1 < 1e-5)
        # the branch not taken is divided by one instead of a zero: the same values where it is taken, and no
        # infinite derivative multiplied by the zero cotangent torch.where sends it (NaN)
        h0 = torch.where(tiny, torch.full_like(d0, 1e-6), 0.01 * d0 / torch.where(tiny, 1.0, d1))
        Y1 = y + h0[:, None] * f0
    f1 = stepper.F((t0 + h0.to(torch.float64)).to(stepper.dtype), Y1 if graph else Y1.detach(), rows.ids)
    with torch.set_grad_enabled(graph):
        d2 = _rms(((f1 if graph else f1.detach()) - f0) / scale) / h0
        small = (d1 <= 1e-15) & (d2 <= 1e-15)
        larger = torch.where(small, 1.0, torch.maximum(d1, d2))
        h1 = torch.where(small, torch.clamp(h0 * 1e-3, min=1e-6), root(0.01 / larger, stepper.order))
        return torch.minimum(100 * h0, h1.abs()).to(torch.float64)


def _rms(x: torch.Tensor) -> torch.Tensor:
    m = x.pow(2).mean(1)
    if not m.requires_grad:
        return m.sqrt()
    # the same values, with a zero derivative where a row's norm is zero (the square root's is infinite there, and
    # the initial step's max(d1, d2) sends zero cotangents through the smaller: 0 · ∞ would be NaN)
    positive = m > 0
    return torch.where(positive, m, 1).sqrt() * positive


def _spread(tol: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A ``(B, 1)`` tolerance on every component for a state of a few components (the controller's tolerance
    is then one product without broadcasting a column over them: 0.7 µs less a sweep at ``N = 2``); else as is."""
    return tol.expand(shape).contiguous() if shape[1] < _LANES else tol


def start(stepper: Stepper, y: torch.Tensor, times: torch.Tensor, rtol, atol, first_step) -> tuple[Any, RowClocks]:
    """The first stage ``F(t_0, y_0)`` (with its graph) and every row's clocks before the first sweep."""
    B, device = times.shape[0], times.device
    ids = torch.arange(B, device=device)
    # the last output is each row's state once it finishes (its last step ends on it): it never falls due
    tt = torch.cat((times[:, :-1], times.new_full((B, 2), math.inf)), 1)
    t0 = times[:, 0].clone()
    rows = RowClocks(
        ids=ids,
        t0=t0,
        dt=t0,
        t1=t0,
        on_jump=torch.zeros(B, dtype=torch.bool, device=device),
        tl=times[:, -1].clone(),
        tt=tt,
        cursor=torch.ones(B, dtype=torch.long, device=device),
        t_next=tt[:, 1].clone(),
        rtol=_spread(rtol, y.shape),
        atol=_spread(atol, y.shape),
        prev=stepper.control.constants(y[0].numel())[2].expand(B),
        cap=torch.full((B,), stepper.control.ifactor, dtype=torch.float64, device=device),
    )
    k0 = stepper.F(t0.to(stepper.dtype), y, ids)
    if first_step is None:
        dt = initial_step(stepper, t0, y, k0, rows)
    else:
        dt = torch.full((B,), float(first_step), dtype=torch.float64, device=device)
    rows = stepper.plan(rows, t0, dt.clamp(stepper.min_step, stepper.max_step))
    if stepper.spans:  # the first sweep's span (later sweeps read theirs with the controller's counts)
        lo, hi = torch.stack((rows.t0.min(), rows.t1.max())).tolist()
        rows.span = (in_dtype(lo, stepper.dtype), in_dtype(hi, stepper.dtype))
    return k0, rows
