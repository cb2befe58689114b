"""``ODEBlock`` with ``controller="per_sample"``: every sample of the batch on its own steps
(:mod:`cde_nets.solvers.per_sample.solve`), its own output times ``t`` (``(batch, n)``) or end time ``t_end``.

The field sees the running rows and one time per row. A :class:`~cde_nets.fields.base.Field` whose time enters only
through its piece (the inherited ``forward``) is evaluated on the running rows once per piece the sweep's times
span, and each row takes the value of its own piece, found on the device (no read per evaluation); any other
module is called with ``t`` of shape ``(m,)`` and must broadcast it against its rows. A block input ``u`` is
restricted to the running rows.
"""

from __future__ import annotations

import bisect
from functools import partial
from typing import Any

import torch

from cde_nets.blocks.solution import Solution
from cde_nets.fields.base import Field
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.counting import SolverStats
from cde_nets.solvers.per_sample.solve import TIME_SPAN, PerSampleInfo, odeint_per_sample
from cde_nets.solvers.precision import autocast_field
from cde_nets.solvers.times import HOST_TIME

__all__ = ["solve_per_sample"]


class _Rows:
    """``(t, y, ids) ↦ F(t_i, y_i)`` on the running rows ``ids``; ``u`` gathered once per set of rows without
    a graph, and at every call with one (each backward pass of a replay frees the graph it used); a field whose
    ``forward`` takes ``rows`` handed their batch indices."""

    def __init__(self, bound: BoundField):
        self.bound = bound
        self.cache: tuple[torch.Tensor, BoundField] | None = None
        field = bound.field
        self.pieces = isinstance(field, Field) and type(field).forward is Field.forward and field.grid.L > 1
        self.jumps = field.grid.jumps if self.pieces else None
        self.bounds = [] if self.jumps is None else self.jumps.tolist()
        self.on_device: torch.Tensor | None = None
        self.starts: dict[tuple, torch.Tensor] = {}
        self.vjps: SolverStats | None = None  # backprop: count the vector-Jacobian products through each evaluation

    def _bound(self, ids: torch.Tensor) -> BoundField:
        if self.bound.u is None and not self.bound.with_rows:
            return self.bound
        if torch.is_grad_enabled():
            return self.bound.rows(ids)
        if self.cache is None or self.cache[0] is not ids:
            self.cache = (ids, self.bound.rows(ids))
        return self.cache[1]

    def __call__(self, t: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = self._evaluate(t, y, ids)
        if self.vjps is not None and out.requires_grad:
            out.register_hook(self.vjps.count_vjp)
        return out

    def _evaluate(self, t: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each row on the piece its time is in (``grid.index``: the boundaries passed, ``bucketize``), found on
        the device: the span of the times (carried on the host, :data:`TIME_SPAN`) says which pieces can be in
        force; the field is evaluated once on each of them and every row takes its own piece's value."""
        bound = self._bound(ids)
        if self.jumps is None:
            return bound(t, y)
        span = getattr(t, TIME_SPAN, None)
        if span is None:  # a time without its span (the solve's first two evaluations): read it
            span = torch.stack(torch.aminmax(t)).tolist()
        lo, hi = (bisect.bisect_right(self.bounds, v) for v in span)
        out = bound(self._start(lo, y), y)
        if hi == lo:
            return out
        if self.on_device is None or self.on_device.device != t.device:
            self.on_device = self.jumps.to(device=t.device)
        keys = torch.bucketize(t.to(torch.float64), self.on_device, right=True).view(-1, *(1,) * (y.dim() - 1))
        for k in range(lo + 1, hi + 1):
            out = torch.where(keys == k, bound(self._start(k, y), y), out)
        return out

    def _start(self, k: int, y: torch.Tensor) -> torch.Tensor:
        """The start of piece ``k`` as a time tensor carrying its value on the host (the field finds its piece
        without a read, and is called as a module: its hooks run)."""
        key = (k, y.dtype, y.device)
        t = self.starts.get(key)
        if t is None:
            value = 0.0 if k == 0 else self.bounds[k - 1]
            t = self.starts[key] = torch.tensor(value, dtype=y.dtype, device=y.device)
            setattr(t, HOST_TIME, value)
        return t


def solve_per_sample(
    block: Any, bound: BoundField, y0: torch.Tensor, t: Any, t_end: Any, stats: SolverStats, gradient: Any
) -> Solution:
    """The block's solve with per-sample control from ``y0`` at time 0: through the times ``t`` (``(n,)`` or
    ``(batch, n)``, increasing within ``[0, T]``) or to the end times ``t_end`` (``(batch,)``), else to ``T``;
    the call's counts go into ``stats``."""
    T, B = block.T, y0.shape[0]
    field = _Rows(bound)
    if gradient.counts_vjp:
        field.vjps = stats
    if field.jumps is not None and gradient.name == "adjoint":
        raise ValueError(
            "gradient='adjoint' with controller='per_sample' integrates the parameter gradient by each step's "
            "quadrature, which steps across the field's piece boundaries unchecked; use gradient='checkpoint' or "
            "'symplectic' (exact for the steps taken), or controller='batch' (its adjoint stops at every boundary)."
        )
    times = _times(t, t_end, T, y0)
    start = bool((times[:, 0] > 0).any())
    if start:
        times = torch.cat((times.new_zeros(B, 1), times), 1)
    s = block.solver
    out, info = odeint_per_sample(
        autocast_field(field, s.autocast),
        y0,
        times,
        method=s.method,
        rtol=s.rtol,
        atol=s.atol,
        options={
            **s.options,
            "max_num_steps": s.max_steps,
            "time_spans": field.pieces,
            "jump_t": field.jumps if block.solver.jumps else None,
        },
        rows=True,
        gradient=gradient,
        params=block._params(bound),
        return_info=True,
    )
    if start:
        out, times = out[1:], times[:, 1:]
    stats.nfe_forward = info.nfe
    stats.steps_forward = int(info.steps.max())
    stats.rejected_forward = int(info.rejected.max())
    info.on_backward = partial(_backward_counts, stats)
    ts = times if t is not None and torch.as_tensor(t).dim() == 2 else times[0]
    if t_end is not None:
        return Solution(y=out[-1], stats=stats, stop_times=times[:, -1], fired=torch.zeros_like(times[:, -1] > 0))
    return Solution(y=out[-1], ts=None if t is None else ts, ys=None if t is None else out, stats=stats)


def _backward_counts(stats: SolverStats, back: PerSampleInfo) -> None:
    """The backward pass's counts, as the shared step reports them: field evaluations (the adjoint's backward
    solve, or the replay's), and the most accepted and rejected steps of a sample."""
    stats.nfe_backward = back.nfe
    stats.steps_backward = int(back.steps.max())
    stats.rejected_backward = int(back.rejected.max())


def _times(t: Any, t_end: Any, T: float, y0: torch.Tensor) -> torch.Tensor:
    """``(batch, n)`` float64 output times within ``[0, T]``, each row strictly increasing and either starting
    at 0 for every sample or after 0 for every sample."""
    B = y0.shape[0]
    if t is not None and t_end is not None:
        raise ValueError("pass per-sample output times `t` ((batch, n)) or end times `t_end` ((batch,)), not both.")
    for name, v in (("t", t), ("t_end", t_end)):
        if isinstance(v, torch.Tensor) and v.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"controller='per_sample' does not differentiate `{name}`; pass `{name}.detach()`, or use "
                "controller='batch', whose output and end times are differentiable."
            )
    if t_end is not None:
        te = torch.as_tensor(t_end).detach().to(device=y0.device, dtype=torch.float64)
        if te.shape != (B,):
            raise ValueError(f"`t_end` must have shape (batch,) = ({B},); got {tuple(te.shape)}.")
        times = torch.stack((torch.zeros_like(te), te), 1)
    elif t is None:
        times = torch.tensor([[0.0, T]], dtype=torch.float64, device=y0.device).expand(B, 2)
    else:
        times = torch.as_tensor(t).detach().to(device=y0.device, dtype=torch.float64)
        times = times.expand(B, -1) if times.dim() == 1 else times
    if times.dim() != 2 or times.shape[0] != B or times.shape[1] < 2:
        raise ValueError(f"`t` must have shape (n,) or (batch, n) = ({B}, n), n >= 2; got {tuple(times.shape)}.")
    if not bool(((times >= 0) & (times <= T * (1 + 1e-12))).all()):
        raise ValueError(f"per-sample times must lie within [0, T] = [0, {T:g}]; raise the block's T for later ones.")
    first = times[:, 0] > 0
    if bool(first.any()) and not bool(first.all()):
        raise ValueError(
            "per-sample output times start at 0 for some samples and later for others; start every row at 0 "
            "(the state y0), or every row after 0."
        )
    if t_end is not None and not bool((times[:, 1] > 0).all()):
        raise ValueError("every `t_end` must be after 0 with controller='per_sample'.")
    return times.contiguous()
