r"""Continuous mode with the Runge-Kutta-Nyström methods of :mod:`solvers.steppers.nystrom_tableaux`, on a second-order
field ``q'' = f(q, q')`` held as ``y = (q, q')``.

Fixed steps (``step_size``: each parameter piece in equal steps of at most that size, plus the requested times) or,
for a method with an embedded pair (``dprkn6``), adaptive steps: the error of a step is the root mean square over
``q`` and ``q'`` of the difference between the solution and the embedded one, in units of ``atol + rtol max(|y_0|,
|y_1|)``; a step is accepted when it is at most 1, and the next step is ``h min(10, max(0.2, 0.9 err^{−1/(p̂+1)}))``
with ``p̂`` the embedded order (Hairer, Nørsett & Wanner 1993, §II.4). Steps never cross a parameter jump of a
piecewise field. The states at the requested times come from the method's dense output (no step is shortened to land
on them), or, in fixed-step mode, from steps that end there.

Gradients: autograd through the steps (the discrete adjoint of the solve). In adaptive mode the step sizes are
computed from the error estimates as plain numbers, so the gradient is that of the steps taken with their sizes held
fixed (exact for fixed steps). Memory is one graph per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .nystrom_tableaux import NYSTROM_TABLEAUX, NystromTableau, dense_weights

__all__ = ["NYSTROM_METHODS", "NystromDense", "integrate_nystrom", "nystrom_step", "second_order_accel"]

NYSTROM_METHODS: dict[str, int] = {name: tab.order for name, tab in NYSTROM_TABLEAUX.items()}

Accel = Callable[[float, torch.Tensor, torch.Tensor], torch.Tensor]


def nystrom_step(
    tab: NystromTableau, accel: Accel, t: float, h: float, q: torch.Tensor, v: torch.Tensor, k1: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One step of ``tab`` from ``(q, v)`` at ``t``: ``(q_1, v_1, stages)``. ``accel(t, Q, V)`` is ``f``; ``k1``: the
    first stage when already known (first same as last)."""
    ks: list[torch.Tensor] = []
    for i, ci in enumerate(tab.c):
        if i == 0 and k1 is not None:
            ks.append(k1)
            continue
        Q = q if ci == 0.0 else q + (ci * h) * v
        for j, aij in enumerate(tab.a[i][:i]):
            if aij != 0.0:
                Q = Q + (aij * h * h) * ks[j]
        V = v
        if tab.av is not None:
            for j, aij in enumerate(tab.av[i][:i]):
                if aij != 0.0:
                    V = V + (aij * h) * ks[j]
        ks.append(accel(t + ci * h, Q, V))
    q1, v1 = q + h * v, v
    for bi, bpi, k in zip(tab.b, tab.bp, ks):
        if bi != 0.0:
            q1 = q1 + (bi * h * h) * k
        if bpi != 0.0:
            v1 = v1 + (bpi * h) * k
    return q1, v1, ks


def second_order_accel(field: Any, l_of: Callable[[float], int]) -> Accel:
    """``f(t, Q, V)`` of a second-order field (``y = (q, q')``, :meth:`evaluate_part` with ``part=1`` is ``q''``) on
    the piece ``l_of(t)``."""

    def accel(t: float, Q: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        return field.evaluate_part(l_of(t), torch.cat([Q, V], -1), 1)

    return accel


def check_second_order(field: Any, method: str) -> NystromTableau:
    """The method's table, or a ``ValueError`` naming the fix when ``field`` is not a second-order field it serves."""
    if method not in NYSTROM_TABLEAUX:
        raise ValueError(f"unknown Nyström method {method!r}; valid: {sorted(NYSTROM_TABLEAUX)}.")
    tab = NYSTROM_TABLEAUX[method]
    inner = getattr(field, "field", field)
    if getattr(inner, "kind", None) != "second_order" or getattr(inner, "order", 2) != 2:
        raise ValueError(
            f"method={method!r} integrates q'' = f(q, q') on a state y = (q, q'); {type(inner).__name__} is not such "
            "a field. Use SecondOrder(dim, order=2), or a first-order method (method='dopri5') for other fields."
        )
    if not tab.velocity_dependent and getattr(inner, "damping", False):
        raise ValueError(
            f"method={method!r} assumes q'' = f(q), but this SecondOrder field's damping −γ q' makes f depend on "
            "q'. Use method='nystrom4' (any f(q, q')), or SecondOrder(..., damping=False)."
        )
    return tab


class NystromDense:
    """The dense output of a Nyström solve: per step ``(t_0, h, q_0, v_0, stages)``; :meth:`evaluate` at any
    ``t`` in the span (HNW 1993, §II.14: ``q(t_0 + θh) = q_0 + θ h v_0 + (θh)² Σ b_i(θ) k_i``)."""

    def __init__(self, tab: NystromTableau):
        self.tab = tab
        self.steps: list[tuple[float, float, torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []

    def add(self, t0: float, h: float, q: torch.Tensor, v: torch.Tensor, ks: list[torch.Tensor]) -> None:
        self.steps.append((t0, h, q, v, ks))

    def at(self, t: float) -> torch.Tensor:
        """The state ``(q, q')`` at ``t``, concatenated."""
        starts = [s[0] for s in self.steps]
        k = max(0, min(len(starts) - 1, _last_le(starts, t)))
        t0, h, q, v, ks = self.steps[k]
        theta = (t - t0) / h
        bq, bv = dense_weights(self.tab, theta)
        qt, vt = q + (theta * h) * v, v
        for wq, wv, kk in zip(bq, bv, ks):
            if wq != 0.0:
                qt = qt + (wq * (theta * h) ** 2) * kk
            if wv != 0.0:
                vt = vt + (wv * theta * h) * kk
        return torch.cat([qt, vt], -1)

    def evaluate(self, t: float | Sequence[float] | torch.Tensor) -> torch.Tensor:
        ts = torch.as_tensor(t, dtype=torch.float64)
        if ts.dim() == 0:
            return self.at(float(ts))
        return torch.stack([self.at(float(x)) for x in ts])


def _last_le(starts: list[float], t: float) -> int:
    lo, hi = 0, len(starts) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] <= t:
            lo = mid
        else:
            hi = mid - 1
    return lo


def integrate_nystrom(
    field: Any,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str,
    step_size: float | None = None,
    rtol: float = 1e-6,
    atol: float = 1e-8,
    first_step: float | None = None,
    max_steps: int = 100_000,
    stats: Any = None,
    dense: bool = False,
) -> tuple[torch.Tensor, NystromDense | None]:
    """Solve the second-order ``field`` from ``y0 = (q_0, q'_0)`` ``(batch, 2 dim)`` over the increasing times
    ``t``: the states at ``t`` ``(len(t), batch, 2 dim)`` and, with ``dense`` (or always in adaptive mode), the
    dense output. ``step_size``: fixed steps; else adaptive (``rtol``, ``atol``), for a method with an embedded
    pair. ``stats``: a :class:`~solvers.counting.SolverStats` to count evaluations, steps and rejections."""
    tab = check_second_order(field, method)
    tt = [float(x) for x in torch.as_tensor(t, dtype=torch.float64).tolist()]
    if len(tt) < 1 or any(b <= a for a, b in zip(tt, tt[1:])):
        raise ValueError("`t` must be strictly increasing times (a 1-d tensor) starting at the initial time.")
    if step_size is None and not tab.adaptive:
        raise ValueError(
            f"method={method!r} has no embedded error estimate: give `step_size`, or use the adaptive 'dprkn6'."
        )
    if step_size is not None and not (isinstance(step_size, (int, float)) and step_size > 0):
        raise ValueError(f"`step_size` must be a number > 0, got {step_size!r}.")
    grid = getattr(field, "grid", None)
    jumps = [] if grid is None else [float(x) for x in grid.jumps.tolist() if tt[0] < float(x) < tt[-1]]

    def piece(t0: float, t1: float) -> Callable[[float], int]:
        l = 0 if grid is None else grid.index(0.5 * (t0 + t1))
        return lambda _t: l

    n = y0.shape[-1] // 2
    q, v = y0[..., :n], y0[..., n:]
    out: dict[int, torch.Tensor] = {0: y0}
    if dense and tab.dense_q is None:
        raise ValueError(f"method={method!r} has no dense output; drop `dense`, or use method='dprkn6'.")
    interp = NystromDense(tab) if (dense or step_size is None) and tab.dense_q is not None else None
    count = _Counter(stats)
    if step_size is not None:
        pts = _fixed_points(tt, jumps, float(step_size))
        if len(pts) - 1 > max_steps:
            raise ValueError(f"{len(pts) - 1} steps exceed max_steps={max_steps}; raise `max_steps` or `step_size`.")
        k1, last_piece = None, None
        for t0, t1 in zip(pts, pts[1:]):
            l_of = piece(t0, t1)
            if l_of(t0) != last_piece:
                k1 = None  # a new parameter piece: the previous step's last stage is not this field's
            accel = count.wrap(second_order_accel(field, l_of))
            q1, v1, ks = nystrom_step(tab, accel, t0, t1 - t0, q, v, k1)
            if interp is not None:
                interp.add(t0, t1 - t0, q, v, ks)
            q, v, last_piece = q1, v1, l_of(t0)
            k1 = ks[-1] if tab.fsal else None
            count.step()
            if t1 in tt:
                out[tt.index(t1)] = torch.cat([q, v], -1)
        return torch.stack([out[i] for i in range(len(tt))]), interp
    assert tab.embedded is not None
    return _adaptive(tab, field, q, v, tt, jumps, piece, rtol, atol, first_step, max_steps, count, interp, out)


class _Counter:
    def __init__(self, stats: Any):
        self.stats = stats

    def wrap(self, accel: Accel) -> Accel:
        def counted(t: float, Q: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
            if self.stats is not None:
                self.stats.nfe_forward += 1
            return accel(t, Q, V)

        return counted

    def step(self, rejected: bool = False) -> None:
        if self.stats is not None:
            if rejected:
                self.stats.rejected_forward += 1
            else:
                self.stats.steps_forward += 1


def _fixed_points(tt: list[float], jumps: list[float], step: float) -> list[float]:
    """Step ends: every requested time and jump, each interval between them in equal steps of at most ``step``."""
    marks = sorted(set(tt) | set(jumps))
    pts = [marks[0]]
    for a, b in zip(marks, marks[1:]):
        m = max(1, math.ceil((b - a) / step - 1e-9))
        pts += [a + (b - a) * k / m for k in range(1, m)] + [b]
    return pts


def _adaptive(tab, field, q, v, tt, jumps, piece, rtol, atol, first_step, max_steps, count, interp, out):
    """Adaptive steps with the embedded pair, stopping at each jump; outputs from the dense output, or, for a
    method without one, at steps that end on the requested times."""
    b_hat, bp_hat = tab.embedded
    eq = [bi - ei for bi, ei in zip(tab.b, b_hat)]
    ev = [bi - ei for bi, ei in zip(tab.bp, bp_hat)]
    expo = -1.0 / (tab.embedded_order + 1)
    ends = sorted(set(jumps) | {tt[-1]} | (set(tt[1:]) if interp is None else set()))
    t0 = tt[0]
    h = first_step or _initial_step(tab, field, piece, q, v, t0, ends[0], rtol, atol, count)
    k1: torch.Tensor | None = None
    steps = 0
    for end in ends:
        k1 = None  # the field changes at a jump: the stage is not reused
        while t0 < end:
            if steps >= max_steps:
                raise ValueError(f"more than max_steps={max_steps} steps; raise `max_steps` or `rtol`/`atol`.")
            h = min(h, end - t0)
            last = end - t0 - h <= 1e-12 * max(1.0, abs(end))
            if last:
                h = end - t0
            accel = count.wrap(second_order_accel(field, piece(t0, end)))
            q1, v1, ks = nystrom_step(tab, accel, t0, h, q, v, k1)
            with torch.no_grad():
                err_q = sum((w * h * h) * k for w, k in zip(eq, ks) if w != 0.0)
                err_v = sum((w * h) * k for w, k in zip(ev, ks) if w != 0.0)
                sq = atol + rtol * torch.maximum(q.abs(), q1.abs())
                sv = atol + rtol * torch.maximum(v.abs(), v1.abs())
                err = float(torch.sqrt(0.5 * ((err_q / sq) ** 2).mean() + 0.5 * ((err_v / sv) ** 2).mean()))
            steps += 1
            if not math.isfinite(err):
                err = math.inf
            factor = 0.2 if err == math.inf else min(10.0, max(0.2, 0.9 * (err + 1e-300) ** expo))
            if err <= 1.0:
                if interp is not None:
                    interp.add(t0, h, q, v, ks)
                t0 = end if last else t0 + h
                q, v = q1, v1
                k1 = ks[-1] if tab.fsal else None
                count.step()
            else:
                count.step(rejected=True)
                factor = min(factor, 1.0)
            h = h * factor
        if interp is None and end in tt:
            out[tt.index(end)] = torch.cat([q, v], -1)
    for i, ti in enumerate(tt):
        if i not in out:
            out[i] = interp.at(ti)
    return torch.stack([out[i] for i in range(len(tt))]), interp


def _initial_step(tab, field, piece, q, v, t0, end, rtol, atol, count) -> float:
    """Hairer, Nørsett & Wanner 1993, §II.4 (its first guess): ``h = 0.01 ‖y_0‖ / ‖y_0'‖`` in the tolerance's
    units, at most the span to the first jump; the controller grows it by up to 10× a step."""
    with torch.no_grad():
        a0 = count.wrap(second_order_accel(field, piece(t0, end)))(t0, q, v)
        y, dy = torch.cat([q, v], -1), torch.cat([v, a0], -1)
        scale = atol + rtol * y.abs()
        d0, d1 = float((y / scale).pow(2).mean().sqrt()), float((dy / scale).pow(2).mean().sqrt())
        h0 = 1e-6 if d0 < 1e-5 or d1 < 1e-5 else 0.01 * d0 / d1
    return min(h0, end - t0)
