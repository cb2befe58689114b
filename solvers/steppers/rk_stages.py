r"""The arithmetic of one explicit Runge-Kutta step rounded as torchdiffeq rounds it: stage sums, error ratio and
dense output.

torchdiffeq (the integrator of record, ``_runge_kutta_step`` and ``_interp_fit`` of its ``rk_common.py``) forms
each stage input as ``Y_i = y_0 + Σ_j k_j (h a_ij)``: the weights ``h a_ij`` rounded to the state's dtype, the
products rounded, summed over the stages' axis, added to ``y_0``; the error estimate ``Σ_j k_j (h e_j)`` alike;
the error ratio is ``RMS(err / (atol + rtol max(|y_0|, |y_1|)))`` (for a tuple state the largest of its parts'
RMS norms, :mod:`solvers.norms`); the dense output is the quartic through ``y_0``,
``y_{1/2} = y_0 + Σ_j k_j (h m_j)`` and ``y_1`` with end slopes ``k_1``, ``k_s`` (Shampine 1986, "Some practical
Runge-Kutta formulas", Math. Comp. 46), evaluated as ``e + x d + x² c + x³ b + x⁴ a``.

Every other formulation of these sums rounds differently in the last bit. A reduction over a short last axis is
not sequential (on CPU, seven terms add as ``x_0 + x_4 + x_5 + x_6 + x_1 + x_2 + x_3``), and a fused multiply-add
(``addmv``, ``add(alpha=)``, ``addcmul``) rounds once where torchdiffeq rounds twice. In float32 such an ulp at
the first iteration grows under training (RMSprop divides each update by the gradient's running scale). So the
same kernels run here on the same operands in the same order, and the values are torchdiffeq's bit for bit. The
gradients are too where the autograd engine sums each tensor's parts as torchdiffeq's graph does: one view node
(:func:`_alias`) stands where torchdiffeq's stage buffer gathers a stage's uses, and the nodes are made in its
order. (At some sizes a field's own backward reductions see its gradient laid out otherwise than as a column of
torchdiffeq's buffer and round the last bit otherwise: seen in float64 from 512 elements, and in float32 for a
field that reads ``t`` at 32768.)

What is saved is the rest: the stages are not written through an autograd function per stage, the weights of a
step are one host product ``fl(fl(h) fl(a_ij))`` (IEEE, as the device's), the error ratio is computed without a
graph (its square root by the device: torch's float32 ``sqrt`` is not always correctly rounded) and read back once
with a finiteness probe, and the dense output is fitted only for a step that holds an output time.

:class:`Buffered` (no graph) keeps the stages in one ``(..., s)`` buffer and writes every result into reused
buffers, :class:`StageMajor` (no graph, from a few hundred elements on the CPU) keeps them stage-major and reduces over
rows in torch's own order; :class:`Graph` (``backprop``) keeps the field's outputs as they are and stacks them for
each sum (over rows, in that order, from 8192 elements on the CPU).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..transforms import outside_transforms
from .tableaux import MethodTableau

__all__ = ["Buffered", "Graph", "StageMajor", "Stages", "sum_order"]

Scalar = float | torch.Tensor  # a time quantity: a float, or a 0-d float64 tensor while it carries a graph


class Stages:
    """What both engines share: the weight rows of a step (``a_1 … a_{s−1}``, then ``last``: ``b`` for a fixed
    step, the error weights ``e`` for an FSAL adaptive one, ``b`` and ``e`` for another adaptive one; then the
    midpoint weights ``m`` when the method has them), each as long as torchdiffeq's, and the rounding of ``h`` and
    ``x`` to the state's dtype on the host. Row ``s − 1`` gives a non-FSAL step's end, row :attr:`err_row` its
    error estimate."""

    graph = False

    def __init__(
        self,
        y0: torch.Tensor,
        tab: MethodTableau,
        last: Sequence[Sequence[float]],
        rtol: float,
        atol: float,
        parts: Sequence[int] | None = None,
    ):
        self.s, self.shape, self.n = tab.stages, y0.shape, y0.numel()
        self.kw: dict[str, Any] = dict(dtype=y0.dtype, device=y0.device)
        self.np = np.float32 if y0.dtype == torch.float32 else np.float64
        self.last = tuple(tuple(row) for row in last)
        self.widths, self.table = _table(tab, self.last, self.np)
        self.err_row = tab.stages - 2 + len(self.last)
        self.rtol, self.atol = rtol, atol
        self.norm: Callable[[torch.Tensor], torch.Tensor] | None = None  # a norm of the user's, if any
        self.parts = None if parts is None else list(parts)  # a tuple state's part sizes (solvers.norms)
        self.host_h: float = math.nan  # h in the state's dtype, on the host

    def largest_part_rms(self, squares: torch.Tensor) -> torch.Tensor:
        """``max_i √mean(e_i²)`` over the parts ``e_i`` of the flat state, from the squares ``e²``: torchdiffeq's
        norm of a tuple state (:class:`~solvers.norms.StateNorm`), each part's mean over its own elements."""
        assert self.parts is not None
        return torch.stack([part.mean().sqrt() for part in squares.reshape(-1).split(self.parts)]).amax()

    def round(self, x: float) -> float:
        return float(self.np(x))

    def mul(self, x: float, y: float) -> float:
        """``x y`` rounded once to the state's dtype (``x``, ``y`` already in it)."""
        return float(self.np(x) * self.np(y))

    def host_weights(self, h: float) -> np.ndarray:
        self.host_h = self.round(h)
        return self.table * self.np(self.host_h)

    def fit(self, y0: torch.Tensor, y1: torch.Tensor, ks: Sequence[torch.Tensor], h: Scalar, ymid: torch.Tensor):
        """torchdiffeq's ``_interp_fit``: the coefficients ``[e, d, c, b, a]`` of the quartic, ``h`` in the state's
        dtype (a float, or a tensor carrying a graph)."""
        f0, f1 = ks[0], ks[-1]
        a = 2 * h * (f1 - f0) - 8 * (y1 + y0) + 16 * ymid
        b = h * (5 * f0 - 3 * f1) + 18 * y0 + 14 * y1 - 32 * ymid
        c = h * (f1 - 4 * f0) - 11 * y0 - 5 * y1 + 16 * ymid
        return [y0, h * f0, c, b, a]

    def evaluate(self, coeffs: list[torch.Tensor], x: Scalar) -> torch.Tensor:
        """torchdiffeq's ``_interp_evaluate`` at ``x`` in the state's dtype: ``e + x d``, then ``+ x^p`` times each
        coefficient, the powers formed by repeated products."""
        total = coeffs[0] + x * coeffs[1]
        power = x
        for coefficient in coeffs[2:]:
            power = power * x if isinstance(power, torch.Tensor) else self.mul(power, x)  # type: ignore[arg-type]
            total = total + power * coefficient
        return total


@functools.cache
def _table(tab: MethodTableau, last: tuple[tuple[float, ...], ...], dtype: type) -> tuple[list[int], np.ndarray]:
    """The widths of a step's weight rows and the rows, zero-padded to ``s``, in ``dtype`` (read-only)."""
    rows = [list(r) for r in (*tab.tableau.a[1:], *last)] + ([list(tab.mid)] if tab.mid is not None else [])
    table: np.ndarray = np.zeros((len(rows), tab.stages), dtype=dtype)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    table.flags.writeable = False
    return [len(r) for r in rows], table


class Buffered(Stages):
    """Stages without a graph, in one buffer ``K`` of shape ``(*y.shape, s)`` as torchdiffeq lays them out; each
    sum's products go to a contiguous buffer of its width (so the reduction runs as torchdiffeq's does), every
    result into a reused buffer."""

    def __init__(
        self,
        y0: torch.Tensor,
        tab: MethodTableau,
        last: Sequence[Sequence[float]],
        rtol: float,
        atol: float,
        parts: Sequence[int] | None = None,
    ):
        super().__init__(y0, tab, last, rtol, atol, parts)
        shape, kw = y0.shape, self.kw
        self.sum = torch.empty(shape, **kw)
        # the state, the next state, a scratch stage input; the caller's y0 until the first step is accepted
        self.ys = [torch.empty(shape, **kw) for _ in range(3)] + [y0]
        self.cur, self.nxt = 3, 3
        self.err, self.tol = torch.empty(shape, **kw), torch.empty(shape, **kw)
        self.absy = [torch.empty(shape, **kw), torch.empty(shape, **kw)]
        self.a_cur = self.a_new = torch.abs(y0, out=self.absy[0])
        self.pair = torch.empty(2, **kw)
        self._stage_buffers()

    def _stage_buffers(self) -> None:
        s, shape, kw = self.s, self.shape, self.kw
        self.K = torch.zeros((*shape, s), **kw)
        self.cols = [self.K[..., i] for i in range(s)]
        self.firsts = {m: self.K[..., :m] for m in set(self.widths)}
        self.prods = {m: torch.empty((*shape, m), **kw) for m in set(self.widths)}
        self.W = torch.zeros(self.table.shape, **kw)
        self.w = [self.W[i, :m] for i, m in enumerate(self.widths)]

    def set(self, i: int, k: torch.Tensor) -> None:
        self.cols[i].copy_(k)

    def get(self, i: int) -> torch.Tensor:
        return self.cols[i]

    def weights(self, h: Scalar) -> Scalar:
        self.W.copy_(torch.from_numpy(self.host_weights(float(h))))
        return self.host_h

    def _sum(self, row: int, out: torch.Tensor) -> torch.Tensor:
        m = self.widths[row]
        return torch.sum(torch.mul(self.firsts[m], self.w[row], out=self.prods[m]), -1, out=out)

    def _combine(self, y: torch.Tensor, row: int, out: torch.Tensor) -> torch.Tensor:
        return torch.add(y, self._sum(row, self.sum), out=out)

    def run_stages(self, func: Callable, times: Sequence[torch.Tensor], fsal: bool) -> torch.Tensor:
        """Stages ``1..s−1`` from the current state; returns the new state (the last stage input when ``fsal``)."""
        s, y = self.s, self.ys[self.cur]
        nxt = 1 if self.cur == 0 else 0
        for i in range(1, s):
            Y = self._combine(y, i - 1, self.ys[nxt if fsal and i == s - 1 else 2])
            self.set(i, func(times[i - 1], Y))
        if not fsal:
            self._combine(y, s - 1, self.ys[nxt])
        self.nxt = nxt
        return self.ys[nxt]

    def ratio(self, y_new: torch.Tensor) -> tuple[float, bool]:
        """``RMS(err / (atol + rtol max(|y_0|, |y_1|)))`` and whether ``y_1`` is finite: one read-back."""
        err = self._error()
        a_new = self.absy[1] if self.a_cur is self.absy[0] else self.absy[0]
        torch.abs(y_new, out=a_new)
        tol = torch.maximum(self.a_cur, a_new, out=self.tol)
        tol.mul_(self.rtol).add_(self.atol)
        err.div_(tol).mul_(err)
        if self.parts is None:
            torch.sqrt(torch.mean(err.view(-1), 0, keepdim=True, out=self.pair[:1]), out=self.pair[:1])
        else:
            self.pair[0] = self.largest_part_rms(err)
        torch.amax(a_new, out=self.pair[1])
        norm, top = self.pair.tolist()
        self.a_new = a_new
        return norm, math.isfinite(top)

    def _error(self) -> torch.Tensor:
        return self._sum(self.err_row, self.err)

    def accept(self, y_new: torch.Tensor) -> torch.Tensor:
        self.cur = self.nxt
        self.a_cur = self.a_new
        return y_new

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return y.clone()

    def dense(self, y0: torch.Tensor, y1: torch.Tensor, h: Scalar) -> list[torch.Tensor]:
        ymid = y0 + self._sum(len(self.widths) - 1, self.sum)
        return self.fit(y0, y1, [self.get(0), self.get(self.s - 1)], self.host_h, ymid)


class StageMajor(Buffered):
    """:class:`Buffered` with the stages stage-major, for the CPU: each sum's products one vectorised product
    over stage rows and the sum one or two vectorised reductions over rows, which add in order from zero.

    torch's CPU sum over a last axis of seven or fewer adds in one of two orders, by dtype and batch size: four
    partial sums (``x_0 + x_4 + x_5 + x_6``, then ``x_1, x_2, x_3``: ``order="ilp"``) or the tail past a vector
    of four first (``x_4 + x_5 + x_6``, then ``x_0 … x_3``: ``order="tail"``). For "ilp", ``k_0`` is stored
    twice, in rows 0 and 4 (``[k_0, k_1, k_2, k_3, k_0, k_4, k_5, k_6]``); for "tail", row 0 is a slot
    (``[·, k_0, …, k_6]``). A sum of more than four terms reduces the rows past the first four terms into row 0,
    then row 0 and those four. :func:`sum_order` finds the order once per dtype and size on random data; where
    neither matches (another reduction, another device), :class:`Buffered` runs."""

    def __init__(
        self,
        y0: torch.Tensor,
        tab: MethodTableau,
        last: Sequence[Sequence[float]],
        rtol: float,
        atol: float,
        order: str,
        parts: Sequence[int] | None = None,
    ):
        self.order = order
        super().__init__(y0, tab, last, rtol, atol, parts)
        self.flat = {id(b): b.view(-1) for b in (self.sum, self.err)}

    def _stage_buffers(self) -> None:
        s, n, kw, order = self.s, self.n, self.kw, self.order
        self.pos = _positions(s, order)
        self.K, self.P = torch.zeros((_rows(s, order), n), **kw), torch.empty((_rows(s, order), n), **kw)
        self.krows = [self.K[p].view(self.shape) for p in self.pos]
        self.twice = (self.K[4], self.K[0]) if order == "ilp" and s > 4 else None  # k_0 again in row 4
        self.table = _arranged(self.table, self.pos, order)
        self.W = torch.zeros((*self.table.shape, 1), **kw)
        self.W_flat = self.W.view(self.table.shape)
        # every sum's operands sliced once: a step makes a dozen sums of a few kernels each
        self.views = [_row_views(self.K, self.W[r], self.P, m, order) for r, m in enumerate(self.widths)]

    def set(self, i: int, k: torch.Tensor) -> None:
        self.krows[i].copy_(k)
        if i == 0 and self.twice is not None:
            self.twice[0].copy_(self.twice[1])

    def get(self, i: int) -> torch.Tensor:
        return self.krows[i]

    def weights(self, h: Scalar) -> Scalar:
        self.W_flat.copy_(torch.from_numpy(self.host_weights(float(h))))
        return self.host_h

    def _sum(self, row: int, out: torch.Tensor) -> torch.Tensor:
        _sum_views(self.views[row], self.flat[id(out)])
        return out


def _perm(m: int, order: str) -> list[int]:
    """The stages of an ``m``-term sum in :meth:`Graph._combine_rows`' rows: for "ilp", ``k_1, k_2, k_3`` first
    (added last, to the sum of the rest), then ``k_0, k_4, …``; otherwise in order."""
    return [1, 2, 3, 0, *range(4, m)] if order == "ilp" and m > 4 else list(range(m))


def _rows(s: int, order: str) -> int:
    return s + 1 if s > 4 or order == "tail" else s


def _positions(s: int, order: str) -> list[int]:
    """Row of stage ``j`` in the buffer of :class:`StageMajor`."""
    if order == "tail":
        return [j + 1 for j in range(s)]
    return [j if j < 4 else j + 1 for j in range(s)]


def _arranged(table: np.ndarray, pos: list[int], order: str) -> np.ndarray:
    out = np.zeros((table.shape[0], _rows(len(pos), order)), dtype=table.dtype)
    out[:, pos] = table
    if order == "ilp" and len(pos) > 4:
        out[:, 4] = table[:, 0]
    return out


def _row_sum(K: torch.Tensor, w: torch.Tensor, P: torch.Tensor, out: torch.Tensor, m: int, order: str) -> None:
    """``Σ_j k_j w_j`` over ``m`` stages into ``out`` (flat), adding as torch's CPU sum over a last axis does."""
    _sum_views(_row_views(K, w, P, m, order), out)


RowViews = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]


def _row_views(K: torch.Tensor, w: torch.Tensor, P: torch.Tensor, m: int, order: str) -> RowViews:
    """The operands of :func:`_row_sum`: stages, weights and products of the ``m`` terms, the products past the
    first four (``None`` for four or fewer), row 0 (where those go) and the products the last reduction adds."""
    lo, hi = (1, m + 1) if order == "tail" else (0, m + 1 if m > 4 else m)
    if m > 4:  # the terms past the first four (and, for "ilp", k_0 again) into row 0, then row 0 and those four
        return K[lo:hi], w[lo:hi], P[lo:hi], P[lo + 4 : hi], P[0], P[: lo + 4]
    return K[lo:hi], w[lo:hi], P[lo:hi], None, P[0], P[lo:hi]


def _sum_views(views: RowViews, out: torch.Tensor) -> None:
    k, w, prods, tail, first, head = views
    torch.mul(k, w, out=prods)
    if tail is not None:
        torch.sum(tail, 0, out=first)
    torch.sum(head, 0, out=out)


@functools.cache
def sum_order(dtype: torch.dtype, n: int) -> str | None:
    """The order in which torch's CPU sum over a last axis of at most seven adds, for ``n`` rows of ``dtype``:
    "ilp", "tail", or ``None`` for neither. Probed on at least a thousand random rows of every width (terms of
    both signs within a few binades of each other, so that another order rounds differently), with the very
    kernels :class:`StageMajor` runs, against ``(x * w).sum(-1)``."""
    with outside_transforms():  # a first call under torch.func.grad would make the probe's tensors its wrappers
        return _probe_sum_order(dtype, n)


def _probe_sum_order(dtype: torch.dtype, n: int) -> str | None:
    g = torch.Generator().manual_seed(0)
    for order in ("ilp", "tail"):
        ok = True
        for m in [*range(1, 8)] * max(1, 1024 // n):  # at least a thousand rows of every width
            x = torch.randn(n, m, generator=g, dtype=torch.float64)
            x = (x * 2.0 ** torch.randint(-4, 5, (n, m), generator=g)).to(dtype)
            w = torch.randn(m, generator=g, dtype=torch.float64).to(dtype)
            pos = _positions(m, order)
            K = torch.zeros(_rows(m, order), n, dtype=dtype)
            K[pos] = x.t()
            if order == "ilp" and m > 4:
                K[4] = x[:, 0]
            W = torch.from_numpy(_arranged(w.numpy()[None], pos, order)[0]).view(-1, 1)
            out = torch.empty(n, dtype=dtype)
            _row_sum(K, W, torch.empty_like(K), out, m, order)
            ok = ok and torch.equal(out, (x * w).sum(-1))
        if ok:
            return order
    return None


class Graph(Stages):
    """Stages with a graph (``backprop``): the field's outputs kept as they are, stacked along a last axis for each
    sum. The weights carry a graph in a step whose size does (torchdiffeq differentiates its first step size), as
    torchdiffeq's ``a_i h`` per row."""

    graph = True

    def __init__(
        self,
        y0: torch.Tensor,
        tab: MethodTableau,
        last: Sequence[Sequence[float]],
        rtol: float,
        atol: float,
        parts: Sequence[int] | None = None,
    ):
        super().__init__(y0, tab, last, rtol, atol, parts)
        self.rows = _rows_on(tab, self.last, y0.dtype, y0.device)
        self.ks: list[torch.Tensor] = [y0] * self.s
        self.w: list[torch.Tensor] = []
        self.hy: torch.Tensor | None = None  # the step in the state's dtype while it carries a graph
        self.fsal: torch.Tensor | None = None  # the last stage through its own view, made where torchdiffeq does
        self.cur = y0
        self.a_cur = self.a_new = y0.detach().abs()
        # stage-major sums where they pay, in the order torch's last-axis sum adds (see StageMajor); not where the
        # weights carry a graph, whose gradient torchdiffeq reduces over its own layout
        big = y0.device.type == "cpu" and self.n >= 8192 and self.s <= 7  # it costs four more nodes a sum
        self.order = sum_order(y0.dtype, self.n) if big else None
        self.wr: list[torch.Tensor] = []
        self.bcast = (-1, *([1] * y0.dim()))

    def set(self, i: int, k: torch.Tensor) -> None:
        self.ks[i] = k if k is self.fsal else _alias(k)

    def get(self, i: int) -> torch.Tensor:
        return self.fsal if i == self.s - 1 and self.fsal is not None else self.ks[i]

    def weights(self, h: Scalar) -> Scalar:
        if isinstance(h, torch.Tensor):  # each row's weights made as its stage runs (run_stages)
            self.hy = h.to(self.kw["dtype"])
            self.host_h = float(self.hy.detach())
            return self.hy
        self.hy = None
        W = self.host_weights(h)
        device = self.kw["device"]
        self.w = [torch.from_numpy(W[i, :m]).to(device) for i, m in enumerate(self.widths)]
        if self.order is not None:
            order = self.order
            self.wr = [
                torch.from_numpy(W[i, _perm(m, order)]).to(device).view(self.bcast) for i, m in enumerate(self.widths)
            ]
        return self.host_h

    def _combine(self, y: torch.Tensor, w: torch.Tensor, m: int) -> torch.Tensor:
        return y + torch.sum(torch.stack(self.ks[:m], -1) * w, -1)

    def _combine_rows(self, y: torch.Tensor, row: int) -> torch.Tensor:
        """:meth:`_combine` over stage-major rows, the sum in the order torch's last-axis sum adds
        (:class:`StageMajor`): the same values, and the same gradient for every stage (one product each)."""
        m, order = self.widths[row], self.order
        assert order is not None
        P = torch.stack([self.ks[j] for j in _perm(m, order)]) * self.wr[row]
        if m > 4:
            split = 3 if order == "ilp" else 4
            return y + torch.cat([P[split:].sum(0, keepdim=True), P[:split]]).sum(0)
        return y + P.sum(0)

    def stage_sum(self, y: torch.Tensor, ks: Sequence[torch.Tensor], row: int) -> torch.Tensor:
        """Row ``row``'s sum ``y + Σ_j k_j (h a_j)`` over the slopes ``ks`` (the weights of the last
        :meth:`weights`), formed as :meth:`run_stages` forms it: a replay of a recorded step computes the forward
        solve's values with it, bit for bit."""
        self.cur = y
        self.ks[: len(ks)] = ks
        return self._stage(row, None)

    def _stage(self, row: int, hy: torch.Tensor | None) -> torch.Tensor:
        if hy is not None:
            return self._combine(self.cur, self.rows[row] * hy, self.widths[row])
        if self.order is not None:
            return self._combine_rows(self.cur, row)
        return self._combine(self.cur, self.w[row], self.widths[row])

    def run_stages(self, func: Callable, times: Sequence[torch.Tensor], fsal: bool) -> torch.Tensor:
        s, Y, hy = self.s, self.cur, self.hy
        for i in range(1, s):
            t = times[i - 1]  # the time first, then the weights, as torchdiffeq makes them
            Y = self._stage(i - 1, hy)
            self.ks[i] = func(t, Y)
        if fsal:
            self.fsal = _alias(self.ks[-1])
            return Y
        return self._stage(s - 1, hy)

    def ratio(self, y_new: torch.Tensor) -> tuple[float, bool]:
        with torch.no_grad():
            m = self.widths[self.err_row]
            e = self.w[self.err_row] if self.hy is None else self.rows[self.err_row] * self.hy
            err = torch.sum(torch.stack(self.ks[:m], -1) * e, -1)
            a_new = y_new.abs()
            tol = torch.maximum(self.a_cur, a_new)
            tol.mul_(self.rtol).add_(self.atol)
            err.div_(tol)
            if self.norm is not None:  # a norm of the user's, on the scaled error as torchdiffeq calls it
                ratio = self.norm(err).abs()
            else:
                err.mul_(err)
                ratio = err.mean().sqrt() if self.parts is None else self.largest_part_rms(err)
            norm, top = torch.stack((ratio, a_new.amax())).tolist()
        self.a_new = a_new
        return norm, math.isfinite(top)

    def ratio_graph(self, y0: torch.Tensor, y_new: torch.Tensor) -> torch.Tensor:
        """The error ratio of :meth:`ratio` as a function of the step's stages, its start, end and size (the value
        agrees with :meth:`ratio`'s to rounding): what the step-size controller reads, differentiated
        (:mod:`solvers.gradients.step_sizes`)."""
        m = self.widths[self.err_row]
        e = self.w[self.err_row] if self.hy is None else self.rows[self.err_row] * self.hy
        err = torch.sum(torch.stack(self.ks[:m], -1) * e, -1)
        tol = torch.maximum(y0.abs(), y_new.abs()) * self.rtol + self.atol
        if self.norm is not None:
            return self.norm(err / tol).abs()
        q = (err / tol).pow(2)
        return q.mean().sqrt() if self.parts is None else self.largest_part_rms(q)

    def accept(self, y_new: torch.Tensor) -> torch.Tensor:
        self.cur, self.a_cur = y_new, self.a_new
        return y_new

    def output(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def dense(self, y0: torch.Tensor, y1: torch.Tensor, h: Scalar) -> list[torch.Tensor]:
        hy: Scalar
        if isinstance(h, torch.Tensor):  # torchdiffeq casts the step again for its fit
            hy = h.to(self.kw["dtype"])
            wmid = hy * self.rows[-1]
        else:
            hy, wmid = self.host_h, self.w[-1]
        if self.order is not None and not isinstance(h, torch.Tensor):
            ymid = self._combine_rows(y0, len(self.widths) - 1)
        else:
            ymid = self._combine(y0, wmid, self.widths[-1])
        return self.fit(y0, y1, [_alias(self.ks[0]), _alias(self.ks[-1])], hy, ymid)


@functools.lru_cache(maxsize=64)
def _rows_on(tab: MethodTableau, last: tuple[tuple[float, ...], ...], dtype: torch.dtype, device: torch.device):
    """The weight rows as tensors (never written: a graph may hold them)."""
    widths, table = _table(tab, last, np.float32 if dtype == torch.float32 else np.float64)
    with torch.inference_mode(False):  # usable by every later call, made in whichever mode the first one ran
        return [torch.tensor(table[i, :m], dtype=dtype, device=device) for i, m in enumerate(widths)]


def _alias(k: torch.Tensor) -> torch.Tensor:
    """``k`` through a view: one autograd node that sums the gradients of its uses before they reach ``k``, as
    torchdiffeq's column of its stage buffer does (``k[..., i]``), so that the sums are associated as its are."""
    return k.view(k.shape)
