r"""Per-sample adaptive step control: every sample of a batch on its own time, step size and error ratio.

A shared-step solver (torchdiffeq, :mod:`solvers.fast_rk`) measures one error norm over the whole batch, so the
stiffest sample sets everyone's step: on a batch of Van der Pol oscillators with ``μ`` drawn from ``[1, 25]`` it
takes about 2.7 times the steps of the median sample. Here each sample ``b`` carries its own clock: the step of
Hairer, Nørsett & Wanner ("Solving Ordinary Differential Equations I", §II.4) is taken on every row at once,

    ``Y_i = y + h_b Σ_{j<i} a_ij k_j``,   ``k_i = F(t_b + c_i h_b, Y_i)``,   ``err_b = h_b Σ_i e_i k_i``,

with the error ratio ``r_b = ‖err_b / (atol_b + rtol_b max(|y_b|, |y_{b,1}|))‖_RMS`` taken over the sample's own
components; the sample's step is accepted where ``r_b ≤ 1`` and its next step is
``h_b · min(ifactor, max(safety · r_b^(−1/p), dfactor))`` (``dfactor`` only after a rejection), the initial step
that of Hairer, Nørsett & Wanner's algorithm on the sample alone. Acceptance, the step update and the state update
are ``torch.where`` on the device. Every round makes one batched field evaluation per stage over the samples still
running; samples that pass their last output time leave the batch (their rows are dropped once a quarter of the
running rows have finished; until then they ride along frozen at their end), so late rounds cost less. One small
tensor is read back per round (how many samples still run, whether any failed, whether an output time was
passed), and one more per output time passed. So every sample takes the steps it would take alone, and the field
is called ``max_b(nfe_b)`` times: the count of the sample that needs the most.

Outputs are read off the accepted step that holds them, with the method's dense output (:mod:`solvers.fast_rk`):
``y(t_0 + x h) = y_0 + h Σ_i β_i(x) k_i``. Methods: ``dopri5`` and ``bosh3`` (:mod:`solvers.tableaux`).

The field sees ``t`` of shape ``(m,)`` (one time per running row, in the state's dtype) and ``y`` of shape
``(m, *state)``, the rows in batch order; it must be row-wise (a row's derivative depends on that row alone).
Gradients: the solve is differentiable by backpropagation through its operations; the step sizes are constants of
the backward pass (the controller works on detached ratios), so the gradient is that of the steps taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import Reason, SolverError
from .fast_rk import _dense_weights
from .options import validate_tolerances
from .tableaux import TABLEAUX

__all__ = ["PER_SAMPLE_METHODS", "PerSampleInfo", "odeint_per_sample"]

PER_SAMPLE_METHODS = ("dopri5", "bosh3")
_OPTIONS = {"first_step", "max_step", "min_step", "safety", "ifactor", "dfactor"}

Tol = float | torch.Tensor
_LANES = 16  # a multiple of every CPU vector width in float64


@dataclass
class PerSampleInfo:
    """What one per-sample solve did: ``steps``/``rejected``: ``(batch,)`` accepted and rejected steps of each
    sample; ``rounds``: batched steps taken (the most any sample attempted); ``nfe``: batched field calls;
    ``rows``: field evaluations summed over rows (the work a row-parallel field does)."""

    steps: torch.Tensor
    rejected: torch.Tensor
    rounds: int = 0
    nfe: int = 0
    rows: int = 0


def _times(t: Any, t_end: Any, y0: torch.Tensor) -> torch.Tensor:
    """The output times as ``(batch, n)`` float64 on ``y0``'s device, checked."""
    B = y0.shape[0]
    kw: dict[str, Any] = dict(dtype=torch.float64, device=y0.device)
    if t_end is not None:
        te = torch.as_tensor(t_end).detach().to(**kw)
        if te.shape != (B,):
            raise ValueError(
                f"`t_end` must have shape (batch,) = ({B},), one end time per sample; got {tuple(te.shape)}."
            )
        start = torch.zeros((), **kw) if t is None else torch.as_tensor(t).detach().to(**kw).reshape(-1)
        if start.numel() != 1:
            raise ValueError(
                "with `t_end`, `t` is the common start time (a number or None for 0); pass per-sample "
                "output times as `t` of shape (batch, n) instead of `t_end`."
            )
        times = torch.stack((start.expand(B), te), 1)
    else:
        if t is None:
            raise ValueError("pass the output times `t` ((n,) or (batch, n)) or the end times `t_end` ((batch,)).")
        times = torch.as_tensor(t).to(**kw)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError("per-sample control does not differentiate output times; pass `t.detach()`.")
        if times.dim() == 1:
            times = times.expand(B, -1)
        if times.dim() != 2 or times.shape[0] != B or times.shape[1] < 2:
            raise ValueError(
                f"`t` must have shape (n,) or (batch, n) = ({B}, n) with n >= 2 (start and end); "
                f"got {tuple(times.shape)}."
            )
    if not bool(torch.isfinite(times).all()):
        raise ValueError("`t` holds NaN/inf; output times must be finite.")
    bad = ~(times[:, 1:] > times[:, :-1]).all(1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"the output times of sample {i} are not strictly increasing ({times[i].tolist()}); per-sample control "
            "integrates forwards: sort each row of `t` (and give each `t_end` after the start)."
        )
    return times.contiguous()


def _tolerance(name: str, value: Tol, B: int, y0: torch.Tensor) -> torch.Tensor:
    """A tolerance as a ``(m, 1)`` column in the state's dtype: a number for all, or ``(batch,)`` per sample."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.shape != (B,):
            raise ValueError(f"`{name}` must be a number or a (batch,) = ({B},) tensor; got {tuple(value.shape)}.")
        for v in value.tolist():
            validate_tolerances(v, v)
        return value.detach().to(dtype=y0.dtype, device=y0.device).reshape(B, 1)
    v = float(value)
    validate_tolerances(v, v)
    return torch.full((B, 1), v, dtype=y0.dtype, device=y0.device)


def _root(x: torch.Tensor, p: int) -> torch.Tensor:
    """``x^(1/p)`` of a vector, elementwise, independent of the vector's length: padded to whole SIMD vectors, as
    a vectorised ``pow`` and the scalar one of a short tail differ in the last bit (which would make a sample's
    steps depend on its place in the batch)."""
    m = x.shape[0]
    return torch.nn.functional.pad(x, (0, -m % _LANES)).pow_(1.0 / p)[:m]


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(1).sqrt()


class _Field:
    """The user's field on ``(m, N)`` rows, counted; every call checks the output's shape (a field that
    broadcasts a scalar-time assumption or full-batch data against fewer rows would otherwise go wrong)."""

    def __init__(self, func: Callable, shape: torch.Size, info: PerSampleInfo, rows: bool):
        self.func, self.shape, self.info, self.rows = func, shape, info, rows
        self.flat = len(shape) == 1  # a (batch, N) state: no reshaping
        self.ids: torch.Tensor | None = None  # the batch rows running, passed to a field that asks for them

    def _call(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.func(t, y, self.ids) if self.rows else self.func(t, y)

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m = y.shape[0]
        try:
            k = self._call(t, y if self.flat else y.view(m, *self.shape))
        except Exception as exc:
            note = getattr(exc, "add_note", None)  # Python 3.11+: the user's exception, unchanged but for a note
            if note is not None:
                note(
                    f"controller='per_sample' calls the field with `t` of shape ({m},) and the {m} rows still "
                    "running: a field that needs a scalar `t` must use the shared step (controller='batch'); one "
                    "with per-sample data must gather it for those rows (odeint_per_sample(..., rows=True))."
                )
            raise
        if not isinstance(k, torch.Tensor) or k.shape != (y.shape if self.flat else (m, *self.shape)):
            got = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
            raise ValueError(
                f"the field returned {got} for a state of shape {(m, *self.shape)} and `t` of shape ({m},); "
                "controller='per_sample' passes one time per running sample: broadcast `t` against the rows "
                "(e.g. t[:, None]) and gather per-sample data for the rows running (odeint_per_sample(..., "
                "rows=True)), or use the shared step (controller='batch')."
            )
        self.info.nfe += 1
        self.info.rows += m
        return k if self.flat else k.reshape(m, -1)


def odeint_per_sample(
    func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: Any = None,
    *,
    t_end: Any = None,
    method: str = "dopri5",
    rtol: Tol = 1e-6,
    atol: Tol = 1e-8,
    options: Mapping[str, Any] | None = None,
    max_steps: int = 100_000,
    rows: bool = False,
    gradient: Any = "backprop",
    return_info: bool = False,
) -> Any:
    """Solve ``y_b' = func(t, y)_b`` for every sample ``b`` of ``y0`` (``(batch, *state)``) on its own steps.

    Args:
        t: output times, ``(n,)`` for all samples or ``(batch, n)`` per sample, each row strictly increasing; the
            first column is each sample's start, the last its end.
        t_end: instead of ``t``: ``(batch,)`` end times (``t`` then a common start, default 0).
        rtol, atol: numbers, or ``(batch,)`` tensors of per-sample tolerances.
        options: ``first_step``, ``max_step``, ``min_step``, ``safety`` (0.9), ``ifactor`` (10), ``dfactor`` (0.2).
        max_steps: attempted steps allowed per sample before :class:`~solvers.errors.SolverError`.
        rows: call ``func(t, y, rows)`` with ``rows`` the ``(m,)`` batch indices of the running rows (for a field
            with per-sample data: gather it with ``data[rows]``).
        gradient: ``"backprop"`` (or ``Backprop()``), the only gradient method that serves per-sample steps yet.
        return_info: also return the :class:`PerSampleInfo`.

    Returns ``(n, batch, *state)``: ``out[j, b]`` is sample ``b`` at ``t[b, j]`` (and the info if asked).
    """
    if method not in PER_SAMPLE_METHODS:
        raise ValueError(
            f"controller='per_sample' serves methods {list(PER_SAMPLE_METHODS)}, not {method!r}; use one of them, "
            "or the shared step (controller='batch') for other methods."
        )
    if not isinstance(y0, torch.Tensor) or y0.dim() < 1 or y0.shape[0] == 0 or not y0.is_floating_point():
        raise ValueError("`y0` must be a float tensor of shape (batch, *state) with batch >= 1.")
    name = gradient if isinstance(gradient, str) else getattr(gradient, "name", repr(gradient))
    if name != "backprop":
        raise ValueError(
            f"gradient={name!r} does not replay per-sample steps; controller='per_sample' takes gradient='backprop' "
            "(differentiate through the steps taken). For checkpoint, adjoint or symplectic gradients use the "
            "shared step (controller='batch')."
        )
    opts = dict(options or {})
    unknown = set(opts) - _OPTIONS
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for controller='per_sample'; valid: {sorted(_OPTIONS)}.")
    times = _times(t, t_end, y0)
    B = y0.shape[0]
    info = PerSampleInfo(
        steps=torch.zeros(B, dtype=torch.long, device=y0.device),
        rejected=torch.zeros(B, dtype=torch.long, device=y0.device),
    )
    loop = _Loop(_Field(func, y0.shape[1:], info, rows), y0, times, TABLEAUX[method], info, opts, max_steps)
    out = loop.run(_tolerance("rtol", rtol, B, y0), _tolerance("atol", atol, B, y0))
    return (out, info) if return_info else out


class _Work:
    """Buffers of a solve without a graph for ``m`` running rows: the stages ``K`` (``s × m × N``) and the views
    of their combinations, made once per batch size."""

    def __init__(self, s: int, m: int, N: int, dtype: torch.dtype, device: torch.device):
        self.m = m
        self.K = torch.empty((s, m, N), dtype=dtype, device=device)
        self.flat = self.K.view(s, m * N)
        self.KT = [self.flat[:i].t() for i in range(s + 1)]
        self.rows = list(self.K.unbind(0))
        self.buf = torch.empty(m * N, dtype=dtype, device=device)
        self.bufv = self.buf.view(m, N)


class _Loop:
    """The rounds of a per-sample solve. Per-row tensors (``y``, ``k0``, clocks, tolerances, output cursor) are
    kept for the running rows only; ``ids`` maps them to batch rows."""

    def __init__(
        self, F: _Field, y0: torch.Tensor, times: torch.Tensor, tab, info: PerSampleInfo, opts: dict, max_steps: int
    ):
        self.F, self.y0, self.times, self.tab, self.info = F, y0, times, tab, info
        self.dtype = y0.dtype
        self.order = tab.order
        self.min_step = float(opts.get("min_step", 0.0))
        self.max_step = float(opts.get("max_step", math.inf))
        self.safety = float(opts.get("safety", 0.9))
        self.ifactor = float(opts.get("ifactor", 10.0))
        self.dfactor = float(opts.get("dfactor", 0.2))
        self.first_step = opts.get("first_step")
        self.max_steps = max_steps
        kw: dict[str, Any] = dict(dtype=y0.dtype, device=y0.device)
        s = tab.stages
        self.s = s
        self.c = tab.tableau.c
        self.e = torch.tensor(tab.error, **kw)
        self.P = torch.tensor(_dense_weights(tab), **kw)  # (4, s)
        self.zero, self.one, self.dfactor_t = (
            torch.tensor(v, dtype=torch.float64, device=y0.device) for v in (0.0, 1.0, self.dfactor)
        )

    def _initial_step(self, t0: torch.Tensor, y: torch.Tensor, f0: torch.Tensor, rtol, atol) -> torch.Tensor:
        """Hairer, Nørsett & Wanner's initial step (§II.4) for each row, in the state's dtype, as float64."""
        with torch.no_grad():
            scale = atol + y.abs() * rtol
            d0, d1 = _rms(y / scale), _rms(f0 / scale)
            h0 = torch.where((d0 < 1e-5) | (d1 < 1e-5), torch.full_like(d0, 1e-6), 0.01 * d0 / d1)
        f1 = self.F((t0 + h0.to(torch.float64)).to(self.dtype), (y + h0[:, None] * f0).detach())
        with torch.no_grad():
            d2 = _rms((f1.detach() - f0) / scale) / h0
            small = (d1 <= 1e-15) & (d2 <= 1e-15)
            h1 = torch.where(small, torch.clamp(h0 * 1e-3, min=1e-6), _root(0.01 / torch.maximum(d1, d2), self.order))
            return torch.minimum(100 * h0, h1.abs()).to(torch.float64)

    def _next_step(self, dt: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
        """``h · min(ifactor, max(safety · r^(−1/p), dfactor))``, ``dfactor`` only where ``r ≥ 1`` (``r = 0``
        gives ``ifactor``: ``safety / 0 = inf``)."""
        ratio = ratio.to(torch.float64)  # the step in float64 whatever the state's dtype
        factor = torch.maximum(self.safety / _root(ratio, self.order), torch.where(ratio < 1, self.one, self.dfactor_t))
        factor.clamp_(max=self.ifactor).mul_(dt)
        return factor.clamp_(self.min_step, self.max_step) if self.min_step > 0 or self.max_step < math.inf else factor

    def run(self, rtol: torch.Tensor, atol: torch.Tensor) -> torch.Tensor:
        y0, times, info, F, s, dtype = self.y0, self.times, self.info, self.F, self.s, self.dtype
        B, n = times.shape
        device = y0.device
        graph = torch.is_grad_enabled()
        y = y0.reshape(B, -1)
        N = y.shape[1]
        ids = torch.arange(B, device=device)
        t0 = times[:, 0].clone()
        tl = times[:, -1].clone()
        F.ids = ids
        k0 = F(t0.to(dtype), y)
        dt = (
            self._initial_step(t0, y, k0.detach(), rtol, atol)
            if self.first_step is None
            else torch.full((B,), float(self.first_step), dtype=torch.float64, device=device)
        ).clamp(self.min_step, self.max_step)
        ay_cur = y.detach().abs()  # |y|, carried from step to step
        cursor = torch.ones(B, dtype=torch.long, device=device)  # the next output each row owes
        t_next = times[:, 1].clone()  # its time (inf once every output is given)
        tt = torch.cat((times, times.new_full((B, 1), math.inf)), 1)
        accepted = torch.zeros(B, dtype=torch.long, device=device)
        attempts = torch.zeros(B, dtype=torch.long, device=device)
        live = torch.ones(B, dtype=torch.bool, device=device)  # rows not yet past their end
        flat_pos: list[torch.Tensor] = [ids]  # position j * B + b of each value in the output
        values: list[torch.Tensor] = [y]
        c = torch.tensor(self.c, dtype=torch.float64, device=device)[:, None]
        tail = self.c.index(1.0)  # the stages at c = 1 close the tableau (dopri5: the last two; bosh3: the last)
        assert all(ci == 1.0 for ci in self.c[tail:])
        neg_inf = torch.tensor(-math.inf, dtype=dtype, device=device)
        a = [torch.tensor(row, dtype=dtype, device=device) for row in self.tab.tableau.a]
        e = self.e
        W: _Work | None = None
        rounds = 0
        while True:
            rounds += 1
            if rounds > self.max_steps:
                raise SolverError(
                    f"per-sample control took max_steps={self.max_steps} rounds without finishing "
                    f"({len(ids)} samples still running); raise `max_steps` or loosen `rtol`/`atol`.",
                    nfe=info.nfe,
                    reason=Reason.MAX_STEPS,
                )
            m = len(ids)
            t1 = t0 + dt
            ts = (t0 + c * dt).to(dtype)  # (s, m): the stage times of every row
            ts[tail:] = torch.nextafter(t1.to(dtype), neg_inf)  # stages at c = 1: just before t_1, as the shared step
            h = dt.to(dtype)[:, None]
            tsr = ts.unbind(0)
            if graph:  # every stage its own tensor, stacked for each combination
                ks = [k0]
                Y = y
                for i in range(1, s):
                    Y = torch.addcmul(y, h, torch.mv(torch.stack(ks).view(i, m * N).t(), a[i]).view(m, N))
                    ks.append(F(tsr[i], Y))
                K = torch.stack(ks)
                flat = K.view(s, m * N)
                k_last = ks[-1]
            else:  # stages in a reused stage-major buffer, each combination one matrix-vector product
                if W is None or W.m != m:
                    W = _Work(s, m, N, dtype, device)
                K, flat = W.K, W.flat
                W.rows[0].copy_(k0)
                Y = y
                hN = h.expand(m, N).contiguous()  # same-shaped operands take the vectorised kernel
                for i in range(1, s):
                    torch.mv(W.KT[i], a[i], out=W.buf)
                    Y = torch.addcmul(y, hN, W.bufv)
                    W.rows[i].copy_(F(tsr[i], Y))
                k_last = W.rows[s - 1]
            with torch.no_grad():
                err = torch.mv((flat.detach() if graph else flat).t(), e).view(m, N).mul_(h)
                ay = (Y.detach() if graph else Y).abs()
                tol = torch.addcmul(atol, torch.maximum(ay_cur, ay), rtol)
                ratio = torch.linalg.vector_norm(err.div_(tol), dim=1).div_(math.sqrt(N))
                ok = ratio <= 1
                if self.min_step > 0:
                    ok |= dt <= self.min_step
                accepted += ok & live
                attempts += live
                t_new = torch.where(ok, t1, t0)
                due = ok & (t_next <= t1)
                alive = t_new < tl
                # a finished row rides along frozen (zero steps at its end), never evaluated past its end
                dt_next = torch.where(alive, self._next_step(dt, ratio), self.zero)
                bad = ~(t_new + dt_next > t_new) & alive  # NaN, or a step lost in rounding
                n_alive, n_due, n_bad = torch.stack((alive, due, bad)).sum(1).tolist()
            if n_bad:
                row = int(bad.nonzero()[0])
                b = int(ids[row])
                nonfinite = not math.isfinite(float(ratio[row]))
                what = (
                    "the state became non-finite (NaN/inf)"
                    if nonfinite
                    else f"the step size underflowed (t={float(t0[row]):g})"
                )
                raise SolverError(
                    f"per-sample control: {what} in sample {b} after {info.nfe} batched field evaluations; "
                    "tighten `rtol`/`atol`, use float64, or check that sample's input.",
                    nfe=info.nfe,
                    reason=Reason.NONFINITE if nonfinite else Reason.UNDERFLOW,
                )
            while n_due:  # outputs within this round's accepted steps, from the dense output
                r = due.nonzero()[:, 0]
                with torch.no_grad():
                    x = ((t_next[r] - t0[r]) / (t1[r] - t0[r])).to(dtype)[:, None]
                    P = self.P
                    w = x * (P[0] + x * (P[1] + x * (P[2] + x * P[3]))) * h[r]  # (r, s)
                values.append(y[r] + torch.einsum("rs,srn->rn", w, K[:, r]))
                flat_pos.append(cursor[r] * B + ids[r])
                cursor = cursor + due
                t_next = tt.gather(1, cursor[:, None])[:, 0]
                due = due & (t_next <= t1)
                n_due = int(due.sum())
            okc = ok[:, None]
            y = torch.where(okc, Y, y)
            ay_cur = torch.where(okc, ay, ay_cur)
            k0 = torch.where(okc, k_last, k0)
            t0, dt = t_new, dt_next
            live = alive
            if n_alive == 0:
                break
            # compaction: finished samples leave the batch once a quarter of it has finished (until then they
            # ride along, counted and checked no more, their outputs given)
            if n_alive <= m * 3 // 4:
                done = ~alive
                info.steps[ids[done]] = accepted[done]
                info.rejected[ids[done]] = attempts[done] - accepted[done]
                keep = alive.nonzero()[:, 0]
                y, ay_cur, k0, t0, dt, tl, tt, cursor, t_next, ids, accepted, attempts, live = (
                    v.index_select(0, keep)
                    for v in (y, ay_cur, k0, t0, dt, tl, tt, cursor, t_next, ids, accepted, attempts, live)
                )
                rtol, atol = rtol.index_select(0, keep), atol.index_select(0, keep)
                F.ids = ids
        info.steps[ids] = accepted
        info.rejected[ids] = attempts - accepted
        info.rounds = rounds
        out = y0.new_zeros(n * B, N).index_put((torch.cat(flat_pos),), torch.cat(values))
        return out.view(n, *y0.shape)
