r"""Exact gradients of an adaptive solve whose step sizes are differentiated (:mod:`solvers.gradients.step_sizes`): the
``"checkpoint"`` and ``"symplectic"`` replays of :mod:`solvers.gradients.replay` over every attempted step.

An adaptive solve is a chain of attempts ``n = 0, 1, …``, each a map of its start ``(y_n, t_n, ĥ_n)`` (state,
time, proposed step size):

    ``h_n = ĥ_n`` (or ``τ − t_n`` where the step is clipped to land on a jump or ``step_t`` time ``τ``),
    ``k_i = F(t_n + c_i h_n, y_n + h_n Σ_j a_ij k_j)``,   ``y' = y_n + h_n Σ_i b_i k_i``,
    ``r_n = ‖h_n Σ_i e_i k_i / (atol + rtol max(|y_n|, |y'|))‖_RMS``,   ``ĥ_{n+1} = h_n · κ(r_n)``,

accepted (``y_{n+1} = y'``, ``t_{n+1} = t_n + h_n``) or rejected (``y_{n+1} = y_n``, ``t_{n+1} = t_n``), with
``κ`` the integral controller's factor (Hairer, Nørsett & Wanner, "Solving Ordinary Differential Equations I",
§II.4, eq. 4.13) and ``ĥ_0 = H(y_0)`` their initial step (§II.4). The forward solve records every attempt's
``t_n``, ``ĥ_n``, ``h_n``, whether it was accepted, and its start state (the accepted states: a rejected attempt
starts from the state before it, so it costs no memory). The backward pass carries the cotangents
``(λ_y, λ_t, λ_ĥ)`` from the last attempt to the first and then through ``H``:

- ``"checkpoint"`` rebuilds each attempt's graph from its start, with ``y_n``, ``t_n`` and ``ĥ_n`` as leaves, and
  backpropagates through it (a rejected attempt too: its error ratio sets the next size);
- ``"symplectic"`` recomputes the stages without a graph and carries the adjoint back one stage at a time as in
  :mod:`solvers.gradients.replay` (Matsubara, Miyatake & Yaguchi 2021), one vector-Jacobian product of the field per
  stage now taken in its time argument too; the stage-free part of the attempt (the stage inputs and times, the new
  state, the error ratio, the controller, the dense output) is differentiated as a small graph of its own.

A method that is not FSAL (``fehlberg2``, ``adaptive_heun``) starts an attempt from the last stage of the accepted
attempt before (:mod:`solvers.gradients.replay`): its start is ``(y_n, k_1, t_n, ĥ_n)``, and ``k_1`` passes through a
rejected attempt unchanged.

``steps="torchdiffeq"``: the same chain, the controller's output a constant (torchdiffeq computes it under
no-grad), so ``λ_ĥ`` reaches ``H`` from the first attempt only while ``λ_t`` still carries the first size's part
of every later time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..controllers import Controller
from ..steppers.tableaux import MethodTableau, quartic
from .binomial import OnlineSchedule, walk_back
from .piece_grads import Grads, LazyPieces, piece_slots
from .piecewise_adjoint import PiecewiseParam
from .second_order import first_order, remember_inputs

__all__ = ["Attempt", "attempts", "controlled_replay", "field_vjp", "stagewise"]

_NONE, _NEXT, _PREV = 0, 1, -1


@dataclass
class Attempt:
    """One attempted step: from ``t0`` with proposed size ``hp``, taken with ``h`` (``clip``: the time it was
    shortened to land on, else ``None``), ``accepted`` or not, from state ``y0``; its first stage read at
    ``first = (time, perturbation)``, or ``carried`` (a method that is not FSAL reuses the last stage of the
    accepted attempt before); ``jumped``: accepted on a jump of the field (the next first stage is read on its
    far side)."""

    t0: float
    hp: float
    h: float
    accepted: bool
    clip: float | None
    y0: torch.Tensor  # None in a record with a budget, where the start state is not kept
    first: tuple[float, int]
    jumped: bool = False
    carried: torch.Tensor | None = None
    carries: bool = False  # whether it takes a carried slope (kept or not, with a budget)


def attempts(rows: Sequence[list], t0: float, clips: Sequence[float]) -> list[Attempt]:
    """The attempts from a recorder's rows ``[t0, proposed, used, accepted, y0, jumped, carried, carries]``;
    ``clips``: the times a step may be shortened to land on (``jump_t``, ``step_t``), increasing."""
    out: list[Attempt] = []
    first: tuple[float, int] = (t0, _NONE)
    for start, hp, h, accepted, y0, jumped, carried, carries in rows:
        clip = None
        if h != hp and clips:  # shortened: it ends exactly on the clip time nearest its end
            end = start + h
            k = bisect.bisect_left(clips, end)
            clip = min(clips[max(k - 1, 0) : k + 1], key=lambda c: abs(c - end))
        out.append(Attempt(start, hp, h, accepted, clip, y0, first, jumped, carried, carries))
        if accepted:
            first = (out[-1].clip if out[-1].clip is not None else start + h, _NEXT if jumped else _PREV)
    return out


def _moved(t: torch.Tensor, perturb: int, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the state's dtype, moved to its neighbour above or below (``perturb``), with ``t``'s derivative."""
    v = t.to(_real(dtype))
    if not perturb:
        return v
    with torch.no_grad():
        step = torch.nextafter(v, v.new_tensor(math.inf if perturb > 0 else -math.inf)) - v
    return v + step


def _real(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a state's times: the state's, or its real part's for a complex state."""
    return torch.empty((), dtype=dtype).real.dtype if dtype.is_complex else dtype


def _rms(x: torch.Tensor) -> torch.Tensor:
    """The RMS norm; its derivative at zero is zero (a plain square root's is infinite there)."""
    return torch.linalg.vector_norm(x) / math.sqrt(max(x.numel(), 1))


@dataclass
class _Spec:
    """What every attempt's replay reads: the method, the controller's constants, the tolerances."""

    tab: MethodTableau
    rtol: float | torch.Tensor  # per element where the solve was given tensors
    atol: float | torch.Tensor
    rule: Controller
    min_step: float
    max_step: float
    differentiated: bool  # False: "torchdiffeq" (the controller's output a constant)
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None  # the error norm, if not the RMS


class _Algebra:
    """An attempt's arithmetic from its start ``(y, t, ĥ)`` and its stages: the stage inputs and times, the new
    state, the error ratio, the next proposed size and the dense output, all differentiable. ``stage(i, k)``
    gives the ``i``-th stage input and time once the stages before it are known."""

    def __init__(self, spec: _Spec, a: Attempt, y: torch.Tensor, t: torch.Tensor, hp: torch.Tensor):
        self.spec, self.a, self.y, self.t = spec, a, y, t
        if a.clip is not None:
            self.h = a.clip - t
            self.t1 = torch.full_like(t, a.clip)
        else:
            self.h = hp
            self.t1 = t + hp
        self.hy = self.h.to(y.dtype)
        self.ks: list[torch.Tensor] = []

    def stage(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tab, y = self.spec.tab, self.y
        if i == 0:
            return y, _moved(self.t, self.a.first[1], y.dtype)
        Y = y
        for j, w in enumerate(tab.all_a[i]):
            if w != 0.0:
                Y = Y + (self.hy * w) * self.ks[j]
        c = tab.all_c[i]
        T = _moved(self.t1, _PREV, y.dtype) if c == 1.0 else (self.t + c * self.h).to(_real(y.dtype))
        return Y, T

    def _sum(self, weights: Sequence[float]) -> torch.Tensor:
        """``Σ_i (h w_i) k_i``."""
        terms = [(self.hy * w) * k for w, k in zip(weights, self.ks) if w != 0.0]
        out = terms[0]
        for term in terms[1:]:
            out = out + term
        return out

    def _combine(self, weights: Sequence[float]) -> torch.Tensor:
        return self.y + self._sum(weights)

    def end(self) -> torch.Tensor:
        return self._combine(self.spec.tab.tableau.b)

    def next_size(self, y1: torch.Tensor) -> torch.Tensor | None:
        """``ĥ_{n+1} = h_n κ(r_n)`` as a function of the attempt (``None`` where it is a constant)."""
        spec, tab = self.spec, self.spec.tab
        if not spec.differentiated:
            return None
        assert tab.error is not None
        err = self._sum(tab.error)
        tol = torch.maximum(self.y.abs(), y1.abs()) * spec.rtol + spec.atol
        ratio_t = (spec.norm or _rms)(err / tol)
        ratio = float(ratio_t.detach())
        # the bound below from the forward's decision (an accepted step was at most 1: a recomputed ratio a
        # rounding away on the other side of 1 must not change the controller's branch)
        accepted_by_ratio = self.a.accepted and not self.a.h <= spec.min_step
        factor = spec.rule.factor_graph(ratio, lambda: ratio_t, tab.order, accepted_by_ratio)
        nxt = self.h * factor
        value = float(nxt.detach()) if isinstance(nxt, torch.Tensor) else nxt
        if not spec.min_step < value < spec.max_step or not isinstance(nxt, torch.Tensor):
            return None
        return nxt

    def dense(self, y1: torch.Tensor, tj: float) -> torch.Tensor:
        """The dense output at ``tj`` inside the accepted attempt (the quartic of :mod:`solvers.gradients.replay`, or
        the method's own continuous extension), ``x = (tj − t_n) / (t_{n+1} − t_n)`` differentiated in the times."""
        tab, hy, ks, y0 = self.spec.tab, self.hy, self.ks, self.y
        x = ((tj - self.t) / (self.t1 - self.t)).to(_real(y0.dtype))
        if tab.dense is not None:
            out = y0
            for i, row in enumerate(zip(*tab.dense)):
                w = sum(p * x ** (q + 1) for q, p in enumerate(row) if p != 0.0)
                if isinstance(w, torch.Tensor):
                    out = out + (hy * w) * ks[i]
            return out
        assert tab.mid is not None
        ymid = self._combine(tab.mid)
        d = hy * ks[0]
        return quartic(y0, y1, ymid, d, hy * ks[-1], x)


def _leaves(a: Attempt, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y = a.y0.detach().requires_grad_()
    t = torch.tensor(a.t0, dtype=torch.float64, device=y.device, requires_grad=True)
    hp = torch.tensor(a.hp, dtype=torch.float64, device=y.device, requires_grad=True)
    return y, t, hp


def _outputs(alg: _Algebra, y1: torch.Tensor, lam, times: Sequence[float], cots: Sequence[torch.Tensor]):
    """The attempt's outputs paired with their cotangents: ``(y_{n+1}, t_{n+1}, ĥ_{n+1}, dense outputs)``, and
    the slope the next attempt carries in (``λ_f`` not ``None``): this one's last stage if accepted, else the
    slope it carried in itself."""
    lam_y, lam_t, lam_h, lam_f = lam
    a = alg.a
    outs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    if lam_y is not None:
        outs.append(y1 if a.accepted else alg.y)
        grads.append(lam_y)
    if lam_f is not None:
        outs.append(alg.ks[alg.spec.tab.stages - 1] if a.accepted else alg.ks[0])
        grads.append(lam_f)
    outs.append(alg.t1 if a.accepted else alg.t)
    grads.append(lam_t)
    nxt = alg.next_size(y1)
    if nxt is not None:
        outs.append(nxt)
        grads.append(lam_h)
    for tj, g in zip(times, cots):
        outs.append(alg.dense(y1, tj))
        grads.append(g)
    return outs, grads


def _grad(outs, grads, wrt: list[torch.Tensor], acc: Grads, n_own: int) -> list[torch.Tensor | None]:
    """``Σ gradᵀ ∂out/∂(wrt, parameters)``: the parameters' parts go to ``acc``; the first ``n_own`` of ``wrt``
    come back."""
    params, keys = acc.inputs()
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
    if not pairs:
        return [None] * n_own
    got = torch.autograd.grad([o for o, _ in pairs], [*wrt, *params], [g for _, g in pairs], allow_unused=True)
    acc.add(got[len(wrt) :], keys)
    return list(got[:n_own])


def _n_stages(tab: MethodTableau, times: Sequence[float]) -> int:
    """The stages an attempt's replay evaluates: the dense output's own too where it gives outputs (dopri8)."""
    return len(tab.all_c) if times else tab.stages


def checkpoint_attempt(func, spec: _Spec, a: Attempt, lam, times, cots, acc: Grads) -> tuple:
    """The cotangents of attempt ``a``'s start ``(y, t, ĥ, carried slope)`` from those of its end, its graph
    rebuilt from ``a.y0``."""
    with torch.enable_grad():
        y, t, hp = _leaves(a, a.y0.dtype)
        f = None if a.carried is None else a.carried.detach().requires_grad_()
        acc.fresh()
        alg = _Algebra(spec, a, y, t, hp)
        for i in range(_n_stages(spec.tab, times)):
            if i == 0 and f is not None:
                alg.ks.append(f)
                continue
            Y, T = alg.stage(i)
            alg.ks.append(func(T, Y))
        y1 = alg.end()
        outs, grads = _outputs(alg, y1, lam, times, cots)
        wrt = [y, t, hp] if f is None else [y, t, hp, f]
        got = _grad(outs, grads, wrt, acc, len(wrt))
    g_f = None if f is None else _zero(got[3], f)
    return _zero(got[0], y), _zero(got[1], t), _zero(got[2], hp), g_f


def stagewise(
    outs: Sequence[torch.Tensor],
    cots: Sequence[torch.Tensor],
    wrt: Sequence[torch.Tensor],
    n_start: int,
    points: Sequence[tuple[torch.Tensor, torch.Tensor]],
    vjp: Callable[[int, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]],
) -> list[torch.Tensor]:
    """The cotangents of an attempt's start (the first ``n_start`` of the leaves ``wrt``) given its outputs'
    ``cots``, one field evaluation at a time: the leaves after the start are the stage slopes ``k_i``,
    ``k_i = F(T_i, Y_i)`` with ``(Y_i, T_i) = points[i]`` graphs over the leaves before ``k_i``. Stage by stage
    from the last, ``κ_i = ∂ℒ/∂k_i`` (complete once the later stages have added theirs) goes through the field,
    ``(μ_i, τ_i) = vjp(i, κ_i)`` (``(∂F/∂y)ᵀ κ_i``, ``(∂F/∂t)ᵀ κ_i``; the parameters' parts are ``vjp``'s to keep),
    and on through ``Y_i`` and ``T_i`` to the leaves before it."""
    pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    got = torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True, retain_graph=True)
    total = [_zero(g, w) for g, w in zip(got, wrt)]
    for i in range(len(points) - 1, -1, -1):
        kappa = total[n_start + i]
        if not bool(kappa.any()):
            continue
        mu, tau = vjp(i, kappa)
        Y, T = points[i]
        back = [(o, c) for o, c in ((Y, mu), (T, tau)) if c is not None and o.requires_grad]
        if back:
            lead = list(wrt[: n_start + i])
            part = torch.autograd.grad(
                [o for o, _ in back], lead, [c for _, c in back], allow_unused=True, retain_graph=True
            )
            total[: n_start + i] = [tot if p is None else tot + p for tot, p in zip(total[: n_start + i], part)]
    return total[:n_start]


def field_vjp(func, Y: torch.Tensor, T: torch.Tensor, kappa: torch.Tensor, acc: Any, *extra):
    """``(∂F/∂y)ᵀ κ`` and ``(∂F/∂t)ᵀ κ`` at ``(T, Y)`` with the graph of this one evaluation (``extra``: further
    arguments of the field); the parameters' part to ``acc``."""
    with torch.enable_grad():
        Yl, Tl = Y.detach().requires_grad_(), T.detach().requires_grad_()
        for name, value in vars(T).items():  # what the times carry on the host (a span, a grid value)
            setattr(Tl, name, value)
        acc.fresh()
        f = func(Tl, Yl, *extra)
        params, keys = acc.inputs()
        g = torch.autograd.grad(f, [Yl, Tl, *params], kappa, allow_unused=True)
    acc.add(g[2:], keys)
    return g[0], g[1]


def symplectic_attempt(func, spec: _Spec, a: Attempt, lam, times, cots, acc: Grads) -> tuple:
    """As :func:`checkpoint_attempt`, with one field evaluation's graph at a time (:func:`stagewise`): the
    stages recomputed without a graph, the attempt's stage-free arithmetic a small graph over them. A carried
    first slope is a leaf of the start: its cotangent goes back to the attempt that made it."""
    s = _n_stages(spec.tab, times)
    carried = a.carried is not None
    with torch.no_grad():
        t0 = torch.tensor(a.t0, dtype=torch.float64, device=a.y0.device)
        alg0 = _Algebra(spec, a, a.y0, t0, torch.tensor(a.hp, dtype=torch.float64, device=a.y0.device))
        points: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(s):
            Y, T = alg0.stage(i)
            points.append((Y, T))
            alg0.ks.append(a.carried if i == 0 and a.carried is not None else func(T, Y))
    with torch.enable_grad():
        y, t, hp = _leaves(a, a.y0.dtype)
        alg = _Algebra(spec, a, y, t, hp)
        alg.ks = [k.detach().requires_grad_() for k in alg0.ks]
        graphs = [alg.stage(i) for i in range(s)]
        y1 = alg.end()
        outs, grads = _outputs(alg, y1, lam, times, cots)

        skip = 1 if carried else 0  # a carried slope is no evaluation of this attempt's

        def vjp(i: int, kappa: torch.Tensor):
            return field_vjp(func, points[i + skip][0], points[i + skip][1], kappa, acc)

        got = stagewise(outs, grads, [y, t, hp, *alg.ks], 3 + skip, graphs[skip:], vjp)
    return got[0], got[1], got[2], (got[3] if carried else None)


def _zero(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def initial_size_back(func, spec: _Spec, y0: torch.Tensor, t0: float, lam_h: torch.Tensor, acc: Grads) -> torch.Tensor:
    """``λ_hᵀ ∂H/∂y_0`` for the initial step ``H(y_0)`` of Hairer, Nørsett & Wanner (§II.4), as the solvers take
    it (the parameters' part to ``acc``)."""
    with torch.enable_grad():
        y = y0.detach().requires_grad_()
        acc.fresh()
        order = spec.tab.order
        t = torch.tensor(t0, dtype=torch.float64, device=y.device)
        f0 = func(t.to(_real(y.dtype)), y)
        scale = spec.atol + y.abs() * spec.rtol
        norm = spec.norm or _rms
        d0, d1 = norm(y / scale).abs(), norm(f0 / scale).abs()
        small = bool(d0 < 1e-5) or bool(d1 < 1e-5)
        h0 = torch.full_like(d0, 1e-6) if small else 0.01 * d0 / d1
        f1 = func((t + h0.to(torch.float64)).to(_real(y.dtype)), y + h0 * f0)
        d2 = (norm((f1 - f0) / scale) / h0).abs()
        if bool(d1 <= 1e-15) and bool(d2 <= 1e-15):
            h1 = torch.maximum(torch.full_like(h0, 1e-6), h0 * 1e-3)
        else:
            # the larger picked as the solvers pick it: torch.maximum would send a zero cotangent through the
            # other, whose RMS norm at a zero slope (f0 = 0) has an infinite derivative, and 0 · inf is NaN
            h1 = (0.01 / (d2 if bool(d2 > d1) else d1)) ** (1.0 / order)
        h = torch.minimum(100 * h0, h1).to(torch.float64)
        (g,) = _grad([h], [lam_h], [y], acc, 1)
    return _zero(g, y)


StepBack = Callable[..., tuple]


class _Controlled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: dict, y0: torch.Tensor, t: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        remember_inputs(ctx, y0, *params)
        schedule = None if cfg["budget"] is None else OnlineSchedule(cfg["budget"])
        ys, tries = cfg["record"](y0, t, schedule)
        ctx.cfg = cfg
        ctx.meta = [(a.t0, a.hp, a.h, a.accepted, a.clip, a.first, a.jumped) for a in tries]
        ctx.carries = [a.carries for a in tries]
        if schedule is not None:
            # held on the context, not saved through autograd, so that the backward pass can free each one
            # when the schedule drops it (saved tensors live until the backward pass ends)
            ctx.state_of = _state_index(tries)
            ctx.kept = {i: (a.y0, a.carried) for i, a in zip(ctx.state_of, tries) if a.y0 is not None}
            ctx.carried_of = []
            ctx.held = schedule.peak
            ctx.save_for_backward(t, *params)
            ctx.n_kept = (0, 0)
            return ys
        states, ctx.state_of = _kept([a.y0 for a in tries])
        carried, ctx.carried_of = _kept([a.carried for a in tries])
        # saved through autograd so that memory accounting (saved-tensor hooks) sees the checkpoints
        ctx.save_for_backward(t, *states, *carried, *params)
        ctx.n_kept = (len(states), len(carried))
        ctx.held = len(states)
        return ys

    @staticmethod
    @first_order(lambda ctx: ctx.cfg["gradient"])
    def backward(ctx, grad_ys: torch.Tensor):
        cfg = ctx.cfg
        # reported here: a call that never runs its backward pass keeps no state for it
        cfg["stats"].stored_states = max(cfg["stats"].stored_states, ctx.held)
        saved = ctx.saved_tensors
        n_states, n_carried = ctx.n_kept
        t, states = saved[0], saved[1 : 1 + n_states]
        carried, params = saved[1 + n_states : 1 + n_states + n_carried], saved[1 + n_states + n_carried :]
        budget = cfg["budget"]
        if budget is None:
            tries = [
                Attempt(t0, hp, h, acc, clip, states[j], first, jumped, None if k < 0 else carried[k], c)
                for (t0, hp, h, acc, clip, first, jumped), j, k, c in zip(
                    ctx.meta, ctx.state_of, ctx.carried_of, ctx.carries
                )
            ]
            order: Iterator[int] = iter(range(len(tries) - 1, -1, -1))
            y_start = tries[0].y0
        else:
            tries = [
                Attempt(t0, hp, h, acc, clip, None, first, jumped, None, c)  # type: ignore[arg-type]
                for (t0, hp, h, acc, clip, first, jumped), c in zip(ctx.meta, ctx.carries)
            ]
            kept = taken(ctx)
            y_start = kept[0][0]
            order = _recomputed(tries, kept, ctx, cfg["func"], cfg["spec"], cfg["stats"])
        pieces: list[PiecewiseParam] = cfg["pieces"]
        slot = cfg["slot"]
        lazies = [LazyPieces(p) for p in pieces]
        acc = Grads([p for p, j in zip(params, slot) if j is None], lazies)
        spec: _Spec = cfg["spec"]
        stats, func, step_back = cfg["stats"], cfg["func"], cfg["step_back"]
        tl = t.tolist()
        owed = _owed(tries, tl)
        zero = torch.zeros((), dtype=torch.float64, device=grad_ys.device)
        lam_y: torch.Tensor | None = None
        lam_f: torch.Tensor | None = None  # of the slope attempt n + 1 carried in
        lam_t, lam_h = zero, zero
        try:
            for p, v in zip(pieces, lazies):
                p.set_views(v)
            for n in order:
                a = tries[n]
                js = owed.get(n, [])
                lam_y, lam_t, g_h, lam_f = step_back(
                    func, spec, a, (lam_y, lam_t, lam_h, lam_f), [tl[j] for j in js], [grad_ys[j] for j in js], acc
                )
                lam_h = g_h if spec.differentiated or n == 0 else zero
                if a.accepted:
                    stats.steps_backward += 1
                else:
                    stats.rejected_backward += 1
            assert lam_y is not None
            if cfg["first_step"] is None and bool(lam_h.any()):
                lam_y = lam_y + initial_size_back(func, spec, y_start, tl[0], lam_h, acc)
        finally:
            for p in pieces:
                p.set_views(None)
        lam_y = lam_y + grad_ys[0]
        return acc.result(lam_y, slot, cfg["gradient"], stats.nfe_backward)


def taken(ctx) -> dict:
    """The kept states of a solve with a budget, handed to its backward pass once: it frees each as its schedule
    drops it, so a second backward pass through the same solve has nothing to start from."""
    kept, ctx.kept = ctx.kept, None
    if kept is None:
        raise RuntimeError(
            "Checkpoint(budget=...) frees its states during the backward pass, so it runs once per solve; "
            "for a second backward pass through the same solve (retain_graph=True) use budget=None."
        )
    return kept


def _state_index(tries: Sequence[Attempt]) -> list[int]:
    """Each attempt's start state, numbered by the accepted attempts before it."""
    out, i = [], 0
    for a in tries:
        out.append(i)
        i += a.accepted
    return out


def _recomputed(tries: list[Attempt], kept: dict, ctx, func, spec: _Spec, stats) -> Iterator[int]:
    """The attempts last to first, each yielded with its start state (and carried slope) in place, rebuilt from
    the kept states ``kept`` by the binomial schedule (:func:`~solvers.gradients.binomial.walk_back`): a
    state is advanced by its accepted attempt."""
    state_of: list[int] = ctx.state_of
    group: dict[int, list[int]] = {}
    for n, i in enumerate(state_of):
        group.setdefault(i, []).append(n)
    tab = spec.tab
    n_stages = tab.stages - 1 if tab.fsal else tab.stages  # an FSAL method's last stage is not needed for y'

    def advance(i: int, state):
        y, k = state
        a = tries[group[i][-1]]  # the accepted attempt from state i
        with torch.no_grad():
            t0 = torch.tensor(a.t0, dtype=torch.float64, device=y.device)
            alg = _Algebra(spec, a, y, t0, torch.tensor(a.hp, dtype=torch.float64, device=y.device))
            for s in range(n_stages):
                if s == 0 and a.carries:
                    alg.ks.append(k)
                    continue
                Y, T = alg.stage(s)
                alg.ks.append(func(T, Y))
            y1 = alg.end()
        nxt = tries[group[i + 1][0]]
        return y1, (alg.ks[tab.stages - 1] if nxt.carries else None)

    counts: dict[str, int] = {}
    try:
        for i, (y, k) in walk_back(kept, state_of[-1] + 1, ctx.cfg["budget"], advance, counts):
            ns = group[i]
            for n in reversed(ns):
                tries[n].y0, tries[n].carried = y, (k if tries[n].carries else None)
                yield n
                tries[n].y0, tries[n].carried = None, None  # type: ignore[assignment]
    finally:
        stats.recomputed_steps += counts.get("advances", 0)
        stats.stored_states = max(stats.stored_states, counts.get("peak", 0))


def _kept(values: Sequence[torch.Tensor | None]) -> tuple[list[torch.Tensor], list[int]]:
    """The tensors of consecutive attempts, each once (a rejected attempt shares its start state and carried slope
    with the one before), and each attempt's index among them (``-1`` for ``None``)."""
    out: list[torch.Tensor] = []
    idx: list[int] = []
    for v in values:
        if v is not None and (not out or v is not out[-1]):
            out.append(v)
        idx.append(-1 if v is None else len(out) - 1)
    return out, idx


def _owed(tries: Sequence[Attempt], tl: Sequence[float]) -> dict[int, list[int]]:
    """Which accepted attempt gives each output ``t[j]`` (``j ≥ 1``): the first whose end reaches it."""
    ends, ids = [], []
    for n, a in enumerate(tries):
        if a.accepted:
            ends.append(a.clip if a.clip is not None else a.t0 + a.h)
            ids.append(n)
    out: dict[int, list[int]] = {}
    for j, tj in enumerate(tl[1:], start=1):
        k = min(bisect.bisect_left(ends, tj), len(ends) - 1)
        out.setdefault(ids[k], []).append(j)
    return out


def controlled_replay(
    func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor,
    params: Sequence[torch.Tensor],
    pieces: Sequence[PiecewiseParam],
    *,
    record: Callable[[torch.Tensor, torch.Tensor, OnlineSchedule | None], tuple[torch.Tensor, list[Attempt]]],
    spec_kw: dict[str, Any],
    gradient: str,
    step_back: StepBack,
    first_step: float | None,
    stats: Any,
    budget: int | None = None,
) -> torch.Tensor:
    """The solve ``record(y0, t, schedule)`` makes (its outputs and its attempts, without a graph), with the
    backward pass of ``step_back`` (:func:`checkpoint_attempt` or :func:`symplectic_attempt`) over every attempt.
    ``budget``: keep at most that many start states, the others recomputed by the online binomial schedule
    (:mod:`solvers.gradients.binomial`); ``schedule`` is then its :class:`~solvers.gradients.binomial.OnlineSchedule`,
    else ``None``."""
    params, used, slot = piece_slots(params, pieces)
    cfg = dict(
        func=func,
        record=record,
        spec=_Spec(**spec_kw),
        gradient=gradient,
        step_back=step_back,
        first_step=first_step,
        stats=stats,
        pieces=[pieces[j] for j in used],
        slot=slot,
        budget=budget,
    )
    return _Controlled.apply(cfg, y0, t, *params)
