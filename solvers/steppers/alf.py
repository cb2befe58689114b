r"""The asynchronous leapfrog integrator (ALF) and its reversible gradient: MALI (Zhuang, Dvornek, Tatikonda &
Duncan 2021, "MALI: a memory efficient and reverse accurate integrator for neural ODEs", ICLR).

ALF carries a velocity ``v ≈ F(t, z)`` beside the state ``z``; one step of size ``h`` from ``(z_0, v_0)`` at
``t_0`` with damping ``η`` (their Algorithm 1 with the damped update of §3.3; ``η = 1`` is undamped) is

    ``z_½ = z_0 + (h/2) v_0``,   ``u = F(t_0 + h/2, z_½)``,   ``v_1 = v_0 + 2η (u − v_0)``,
    ``z_1 = z_½ + (h/2) v_1``,

starting from ``v_0 = F(t_0, z_0)``. It is second order and exactly invertible (for ``η ≠ 1/2``):

    ``z_½ = z_1 − (h/2) v_1``,   ``u = F(t_0 + h/2, z_½)``,   ``v_0 = (v_1 − 2η u) / (1 − 2η)``,
    ``z_0 = z_½ − (h/2) v_0``,

one evaluation per step either way.

Parameter jumps. Across a jump of a piecewise field the carried ``v`` is the old piece's slope; ALF would drag
that mismatch along (undamped for ``η = 1``) and the step-size control would shrink the steps to nothing. At
every piece boundary the velocity is therefore re-read, ``v ← F(τ_l, z)`` on the new piece, and the old ``v``
kept: memory ``O(L |z|)`` for ``L`` pieces, still independent of the number of steps.

``gradient="reversible"`` keeps only the end state and the accepted step sizes; the backward pass rebuilds
``(z_n, v_n)`` from ``(z_{n+1}, v_{n+1})`` with the inverse and backpropagates through that one step: the
gradient of the integrator's map (up to the rounding of the reconstruction) in memory constant in the number
of steps, two evaluations and one product per step.
``"backprop"`` differentiates the same loop directly.

Step sizes (ours, not MALI's estimator): the local error is estimated by the distance to the Euler step,
``(h/2) (v_1 − v_0)`` (as for the embedded Heun–Euler pair), measured in torchdiffeq's mixed RMS norm
``‖e / (atol + rtol max(|z_0|, |z_1|))‖``; a step is accepted when that is ``≤ 1`` and the next size is
``h · clip(safety · ratio^{−1/2}, dfactor, ifactor)``. Steps end exactly on every output time and on every
parameter jump, so the single stage at ``t_0 + h/2`` always lies inside one piece. With a ``grid`` the steps
are the grid's intervals (fixed steps).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..counting import Counted
from ..errors import Reason, SolverError, check_positive, nonfinite_forward
from ..gradients.piece_grads import Grads, LazyPieces, piece_slots
from ..gradients.piecewise_adjoint import PiecewiseParam
from ..gradients.second_order import first_order, remember_inputs
from ..run import Settings
from ..schemes.leapfrog import leapfrog_inverse, leapfrog_step

__all__ = ["alf_step", "alf_inverse", "integrate_alf"]


def _time(t: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(t, dtype=torch.float64).to(like.dtype).to(like.device)


def alf_step(func, z: torch.Tensor, v: torch.Tensor, t0: float, h: float, eta: float):
    """One ALF step of ``func`` from time ``t0``: ``(z_1, v_1)`` (:func:`~solvers.schemes.leapfrog_step`)."""
    tm = _time(t0 + 0.5 * h, z)
    return leapfrog_step(lambda zm: func(tm, zm), z, v, h, eta)


def alf_inverse(func, z1: torch.Tensor, v1: torch.Tensor, t0: float, h: float, eta: float):
    """The step's exact inverse: ``(z_0, v_0)`` from ``(z_1, v_1)`` (``t0``: the step's start, as stepped)."""
    tm = _time(t0 + 0.5 * h, z1)
    return leapfrog_inverse(lambda zm: func(tm, zm), z1, v1, h, eta)


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def _options(options: dict, rtol: float, atol: float) -> dict[str, float]:
    # η < 1 damps the velocity mismatch forwards, so the inverse amplifies it by 1/|1 − 2η| per step: the
    # reconstruction is exact to rounding only for η = 1 (the default) or few steps
    eta = float(options.get("eta", 1.0))
    if not (0.0 < eta <= 1.0) or eta == 0.5:
        raise ValueError(
            f"`options['eta']` (ALF damping) must lie in (0, 1] and differ from 1/2 (where the step "
            f"cannot be inverted), got {eta!r}; 1 is undamped."
        )
    out = {"eta": eta, "safety": 0.9, "ifactor": 10.0, "dfactor": 0.2, "max_step": math.inf, "rtol": rtol, "atol": atol}
    for k in ("safety", "ifactor", "dfactor", "max_step", "first_step"):
        if k in options:
            out[k] = check_positive(f"options['{k}']", options[k])
    return out


def _first_step(func, z: torch.Tensor, f: torch.Tensor, opts: dict, span: float) -> float:
    if "first_step" in opts:
        return opts["first_step"]
    scale = opts["atol"] + opts["rtol"] * z.abs()
    d0, d1 = _rms(z / scale), _rms(f / scale)
    h = 1e-6 if d0 < 1e-5 or d1 < 1e-5 else 0.01 * d0 / d1
    return min(h, span)


def _run(
    func,
    z: torch.Tensor,
    t: Sequence[float],
    stops: Sequence[float],
    opts: dict,
    adaptive: bool,
    stats: Any,
    steps: list[tuple[float, float]],
    resync: set[float],
    kept: list[torch.Tensor],
):
    """The forward loop (with a graph when grad is on). Returns the states at ``t`` and the final ``(z, v)``;
    ``steps`` receives the accepted ``(t_0, h)``, ``kept`` the velocities replaced at the ``resync`` times."""
    eta = opts["eta"]
    v = func(_time(t[0], z), z)
    outs = [z]
    tc = t[0]
    h = _first_step(func, z.detach(), v.detach(), opts, t[-1] - t[0]) if adaptive else 0.0
    k = bisect.bisect_right(stops, tc)
    while k < len(stops):
        target = stops[k]
        h_try = min(h, opts["max_step"], target - tc) if adaptive else target - tc
        lands = h_try >= target - tc or tc + h_try >= target  # a step that rounds onto the target lands on it
        func.callback_step(tc, z, h_try)
        z1, v1 = alf_step(func, z, v, tc, h_try, eta)
        if adaptive:
            with torch.no_grad():
                scale = opts["atol"] + opts["rtol"] * torch.maximum(z.abs(), z1.abs())
                ratio = _rms((0.5 * h_try) * (v1 - v) / scale)
            if not math.isfinite(ratio):
                ratio = math.inf
            accept = ratio <= 1.0
            lo = 1.0 if accept else opts["dfactor"]  # an accepted step never shrinks the next
            factor = opts["ifactor"] if ratio == 0 else min(opts["ifactor"], max(opts["safety"] * ratio**-0.5, lo))
            h = h_try * factor
        else:
            accept = True
        if not accept:
            func.callback_reject_step(tc, z, h_try)
            continue
        stats.steps_forward += 1
        steps.append((tc, h_try))
        z, v = z1, v1
        tc = target if lands else tc + h_try
        if lands:
            k += 1
            if target in t:
                outs.append(z)
            if target in resync and k < len(stops):
                kept.append(v)
                v = func(_time(target, z), z)
    if not all(bool(torch.isfinite(o).all()) for o in (z, v)):
        raise nonfinite_forward("alf", stats.nfe_forward)
    return outs, z, v


class _Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: dict, y0: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        remember_inputs(ctx, y0, *params)
        steps: list[tuple[float, float]] = []
        kept: list[torch.Tensor] = []
        with torch.no_grad():
            outs, z, v = _run(
                cfg["func"],
                y0,
                cfg["t"],
                cfg["stops"],
                cfg["opts"],
                cfg["adaptive"],
                cfg["stats"],
                steps,
                cfg["resync"],
                kept,
            )
        ctx.cfg, ctx.steps, ctx.n_params = cfg, steps, len(params)
        # the end state and the velocities replaced at jumps only: memory constant in the steps
        ctx.save_for_backward(z, v, *params, *kept)
        return torch.stack(outs)

    @staticmethod
    @first_order("reversible")
    def backward(ctx, grad_ys: torch.Tensor):
        cfg, steps = ctx.cfg, ctx.steps
        func, stats, eta, t = cfg["func"], cfg["stats"], cfg["opts"]["eta"], cfg["t"]
        z, v, *rest = ctx.saved_tensors
        params, kept = rest[: ctx.n_params], list(rest[ctx.n_params :])
        pieces: list[PiecewiseParam] = cfg["pieces"]
        slot = cfg["slot"]
        lazies = [LazyPieces(p) for p in pieces]
        acc = Grads([p for p, j in zip(params, slot) if j is None], lazies)
        out_at = {tj: j for j, tj in enumerate(t)}
        lz, lv = torch.zeros_like(z), torch.zeros_like(v)
        try:
            for p, lazy in zip(pieces, lazies):
                p.set_views(lazy)
            for n in range(len(steps) - 1, -1, -1):
                t0, h = steps[n]
                t1 = steps[n + 1][0] if n + 1 < len(steps) else t[-1]
                if t1 in out_at:
                    lz = lz + grad_ys[out_at[t1]]
                if t1 in cfg["resync"] and n + 1 < len(steps):  # v was re-read there: v = F(t1, z)
                    with torch.enable_grad():
                        zl = z.detach().requires_grad_()
                        acc.fresh()
                        f = func(_time(t1, zl), zl)
                        wrt, keys = acc.inputs()
                        g = torch.autograd.grad(f, [zl, *wrt], lv, allow_unused=True)
                    acc.add(g[1:], keys)
                    lz = lz + g[0] if g[0] is not None else lz
                    lv = torch.zeros_like(lv)
                    v = kept.pop()
                with torch.no_grad():
                    z, v = alf_inverse(func, z, v, t0, h, eta)
                with torch.enable_grad():
                    zl, vl = z.detach().requires_grad_(), v.detach().requires_grad_()
                    acc.fresh()
                    z1, v1 = alf_step(func, zl, vl, t0, h, eta)
                    wrt, keys = acc.inputs()
                    g = torch.autograd.grad((z1, v1), [zl, vl, *wrt], (lz, lv), allow_unused=True)
                acc.add(g[2:], keys)
                lz = g[0] if g[0] is not None else torch.zeros_like(z)
                lv = g[1] if g[1] is not None else torch.zeros_like(v)
                stats.steps_backward += 1
            with torch.enable_grad():  # v_0 = F(t_0, z_0)
                zl = z.detach().requires_grad_()
                acc.fresh()
                f = func(_time(t[0], zl), zl)
                wrt, keys = acc.inputs()
                g = torch.autograd.grad(f, [zl, *wrt], lv, allow_unused=True)
            acc.add(g[1:], keys)
            lz = lz + (g[0] if g[0] is not None else 0) + grad_ys[0]
        finally:
            for p in pieces:
                p.set_views(None)
        if not bool(torch.isfinite(lz).all()):
            raise SolverError(
                f"the gradient became non-finite (NaN/inf) in the reversible backward pass after "
                f"{stats.nfe_backward} field evaluations; try a damping options={{'eta': 0.9}}, "
                "tighter tolerances, or gradient='backprop'.",
                reason=Reason.NONFINITE_GRADIENT,
                nfe=stats.nfe_backward,
            )
        g_o = iter(acc.g_others)
        return (None, lz, *(next(g_o) if j is None else acc.g_pieces[j] for j in slot))


def integrate_alf(
    func: Counted,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    solver: Settings,
    reversible: bool,
    params: Sequence[torch.Tensor] | None,
    pieces: Sequence[PiecewiseParam] | None,
    jump_t: torch.Tensor | None,
    grid: torch.Tensor | None,
) -> torch.Tensor:
    """Solve ``y' = func(t, y)`` at times ``t`` with ALF: adaptive, or on ``grid`` (fixed steps, which then
    contains ``t``). ``reversible``: the gradient of the module docstring; else backpropagation through the steps.
    ``func`` is the counting wrapper of an adaptive method (:class:`~solvers.counting.CountedAdaptive`)."""
    if t.requires_grad:
        raise ValueError("method='alf' does not differentiate the output times `t`; detach them.")
    stats = func.stats
    opts = _options(dict(solver.options), solver.rtol, solver.atol)
    ts = [float(s) for s in t.tolist()]
    adaptive = grid is None
    extra = [] if grid is None else grid.tolist()
    if adaptive and jump_t is not None:
        extra = jump_t.tolist()
    stops = sorted({s for s in [*ts[1:], *extra] if ts[0] < s <= ts[-1]})
    bounds = {float(b) for p in (pieces or ()) for b in p.boundaries}
    resync = {s for s in stops if s in bounds and s < ts[-1]}
    if not reversible:
        outs, _, _ = _run(func, y0, ts, stops, opts, adaptive, stats, [], resync, [])
        return torch.stack(outs)
    pcs = list(pieces or ())
    ps, used, slot = piece_slots(params or (), pcs)
    cfg = dict(
        func=func,
        t=ts,
        stops=stops,
        opts=opts,
        adaptive=adaptive,
        stats=stats,
        pieces=[pcs[j] for j in used],
        slot=slot,
        resync=resync,
    )
    return _Reversible.apply(cfg, y0, *ps)


def reconstruction_error(field, y0: torch.Tensor, T: float, steps: int, eta: float = 1.0) -> float:
    """Relative error of ``y0`` rebuilt by ``steps`` inverse ALF steps from the state after ``steps`` forward
    steps of size ``T / steps`` (no gradients): the rounding the reversible gradient carries."""
    h = T / steps
    with torch.no_grad():
        z, v = y0, field(_time(0.0, y0), y0)
        for n in range(steps):
            z, v = alf_step(field, z, v, n * h, h, eta)
        for n in range(steps - 1, -1, -1):
            z, v = alf_inverse(field, z, v, n * h, h, eta)
    return float((z - y0).abs().max() / y0.abs().max())
