r"""The interpolating adjoint under ``torch.vmap``: each vmapped instance's adjoint solved backwards on its own
steps, ``y(t)`` read off that instance's own forward dense output.

For ``y' = F(t, y, θ)`` and a loss ``ℒ(y(t_0), …, y(t_N))``, Pontryagin's adjoint (Chen et al. 2018, "Neural
ordinary differential equations", eqs. 4-5) runs backwards from ``t_N``,

    ``a' = −aᵀ ∂F/∂y(t, y(t))``,   ``g' = −aᵀ ∂F/∂θ(t, y(t))``,   ``a(t_N) = ∂ℒ/∂y(t_N)``,   ``g(t_N) = 0``,

``a`` jumping by ``∂ℒ/∂y(t_i)`` at each output time; ``∂ℒ/∂y_0 = a(t_0)``, ``∂ℒ/∂θ = g(t_0)``. ``y(t)`` is not
solved backwards but read off the forward solve's dense output (Daulbaev et al. 2020, "Interpolation technique to
speed up gradients propagation in neural ODEs"; SciMLSensitivity's ``InterpolatingAdjoint``, Rackauckas et al.
2020), as :mod:`solvers.gradients.interpolating` does outside ``vmap``.

On the loop of tensor decisions (:mod:`solvers.steppers.vmappable`) the forward solve keeps, for every attempt
``n``, its start ``t_n``, its step ``h_n``, its acceptance and the coefficients of its dense output,
``y(t_n + x h_n) = Σ_p C_{n,p} x^p`` (``C_{n,0} = y_n``, ``C_{n,p+1} = h_n Σ_i W_{pi} k_i``: the method's own
continuous extension, or the quartic through its midpoint). An instance's ``y(t)`` is the polynomial of its last
accepted attempt with ``t_n ≤ t`` (the last past the end: the single solve's choice), picked by tensor
operations, so every instance reads its own steps; the backward solve lands on ``t_0``, as the single solve's
does, and reads nothing before it. The backward solve of ``(a, g)`` runs on the
same loop in ``s = −t`` with the backward tolerances and method of :class:`~solvers.gradients.Interpolating`, its
error norm ``a``'s RMS alone (the single solve's seminorm), so each instance's backward steps are those of its
single solve. ``Interpolating(checkpoints=…)`` gives the same gradient here; the coefficients of every attempt are
kept (memory ``(d + 1) K`` states for ``K`` attempts).

It runs as an ``autograd.Function`` written the way ``torch.func`` takes one (``setup_context``,
``generate_vmap_rule``): torch runs the forward and the backward under ``vmap``; the kept attempts are extra
outputs (the same count for every instance: the loop runs as long as the longest), marked non-differentiable.
Tensors the field closes over are its inputs, as the adjoint's (:func:`solvers.gradients.vmap_adjoint.field_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import vjp

from ..steppers.tableaux import TABLEAUX
from ..steppers.vmappable import _Loop, odeint_vmappable, vmap_methods
from ..transforms import tracked
from .vmap_adjoint import _Swapped, applied, field_inputs, live

__all__ = [
    "Attempts",
    "Caught",
    "DenseAttempts",
    "DenseRecorded",
    "coefficients",
    "horner",
    "interpolating_vmapped",
    "record_dense",
]


class Caught:
    """The field, with its evaluations between an attempt's start and its acceptance caught: the attempt's
    stages after the first (which the loop carries)."""

    def __init__(self, field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.field = field
        self.caught: list[torch.Tensor] | None = None

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.field(t, y)
        if self.caught is not None:
            self.caught.append(out)
        return out


class Attempts(list):
    """The ``record`` of :func:`~solvers.steppers.vmappable.odeint_vmappable` that hands each attempt to
    ``seen(t_0, h, y_0, coefficients, ok)`` once its acceptance is known (the loop appends the attempt's start
    before it and its acceptance after; the stages are those ``field`` caught in between)."""

    def __init__(self, field: Caught, loop: _Loop, seen: Callable[..., None]):
        super().__init__()
        self.field, self.loop, self.seen = field, loop, seen
        self.start: tuple = ()

    def append(self, item: Any) -> None:
        if isinstance(item, tuple):
            self.start = item
            self.field.caught = []
        elif isinstance(item, torch.Tensor):  # the acceptance (an output time's last step, a dict, is not needed)
            _, t0, y, k0, dt = self.start
            ks, self.field.caught = [k0, *(self.field.caught or [])], None
            loop = self.loop
            h = torch.where(torch.isfinite(dt), dt, torch.full_like(dt, loop.min_step))
            h = h.clamp(loop.min_step, loop.max_step)  # the step the loop attempted
            self.seen(t0, h, y, coefficients(loop, t0, h, y, ks), item)


def coefficients(loop: _Loop, t0: torch.Tensor, h: torch.Tensor, y0: torch.Tensor, ks: list) -> torch.Tensor:
    """``(C_0, …, C_d)`` of an attempt's dense output ``Σ_p C_p x^p``: ``C_0 = y_0``, ``C_{p+1} = h Σ_i W_{pi}
    k_i`` (dopri8's extension stages evaluated first)."""
    assert loop.dense is not None
    if loop.tab.dense_stages:
        ks = loop.extension({"t0": t0, "h": h, "y0": y0}, list(ks))
    hy = h.to(loop.dtype)
    out = [y0]
    for row in loop.dense:
        c = torch.zeros_like(y0)
        for w, k in zip(row, ks):
            if w != 0.0:
                c = c + (w * hy) * k
        out.append(c)
    return torch.stack(out)


def horner(c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``Σ_p c_p x^p``."""
    y = c[-1]
    for p in range(c.shape[0] - 2, -1, -1):
        y = y * x + c[p]
    return y


class DenseAttempts:
    """One instance's dense output from its stacked attempts ``(t_n, h_n, ok_n, C_n)``: at ``t``, the polynomial
    of the last accepted attempt starting at or before ``t`` (the first accepted one before the start)."""

    def __init__(self, t0: torch.Tensor, h: torch.Tensor, ok: torch.Tensor, coeffs: torch.Tensor):
        self.t0, self.h, self.ok, self.coeffs = t0, h, ok, coeffs
        self.pos = torch.arange(t0.shape[0], device=t0.device)
        self.first = torch.where(ok, self.pos, torch.full_like(self.pos, t0.shape[0] - 1)).amin()

    def index(self, t: torch.Tensor) -> torch.Tensor:
        before = torch.where(self.ok & (self.t0 <= t), self.pos, torch.full_like(self.pos, -1)).amax()
        return torch.where(before >= 0, before, self.first)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        n = self.index(t).reshape(1)  # an index tensor, not a Python int: vmap batches it
        t0, h = self.t0.index_select(0, n)[0], self.h.index_select(0, n)[0]
        x = ((t.to(torch.float64) - t0) / h).to(self.coeffs.dtype)
        return horner(self.coeffs.index_select(0, n)[0], x)


def record_dense(
    func: Callable, y0: torch.Tensor, t: torch.Tensor, forward: dict
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The forward solve (no graph) and its attempts stacked: ``(ys, (t_n, h_n, ok_n, C_n))``."""
    caught = Caught(func)
    tab = TABLEAUX[forward["method"]]
    loop = _Loop(caught, y0, tab, forward["rtol"], forward["atol"], forward["options"], 0, "fixed")
    rows: list[tuple[torch.Tensor, ...]] = []

    def seen(t0: torch.Tensor, h: torch.Tensor, y: torch.Tensor, c: torch.Tensor, ok: torch.Tensor) -> None:
        rows.append((t0, h, ok, c))

    with torch.no_grad():
        ys = odeint_vmappable(caught, y0, t, record=Attempts(caught, loop, seen), **forward)
    return ys, tuple(torch.stack(col) for col in zip(*rows))


class DenseRecorded(torch.autograd.Function):
    """The forward solve both continuous adjoints on a dense output share: the states at ``t`` and each attempt's
    start, step, acceptance and dense coefficients (non-differentiable outputs, saved with ``t`` and the field's
    tensors for the backward pass a subclass gives)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(y0: torch.Tensor, t: torch.Tensor, cfg: dict, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ys, kept = record_dense(_Swapped(cfg["func"], cfg["slots"], tensors), y0, t, cfg["forward"])
        return (ys, *kept)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        t, cfg, tensors = inputs[1], inputs[2], inputs[3:]
        ctx.mark_non_differentiable(*output[1:])
        ctx.cfg = cfg
        ctx.save_for_backward(t, *output[1:], *tensors)

    @staticmethod
    def saved(ctx: Any) -> tuple[dict, torch.Tensor, _Swapped, DenseAttempts, list[torch.Tensor]]:
        """For the backward pass: the settings, the times, the field with the saved tensors swapped in, the forward
        solve's dense output and those tensors."""
        t, T0, H, OK, C, *tensors = (live(x) for x in ctx.saved_tensors)
        cfg = ctx.cfg
        return cfg, t, _Swapped(cfg["func"], cfg["slots"], tensors), DenseAttempts(T0, H, OK, C), tensors


class _VmapInterpolating(DenseRecorded):
    @staticmethod
    def backward(ctx: Any, grad_ys: torch.Tensor, *_: Any) -> tuple:
        cfg, t, field, dense, tensors = DenseRecorded.saved(ctx)
        shape, n = grad_ys.shape[1:], grad_ys[0].numel()
        sizes = [p.numel() for p in tensors]

        def reversed_time(s: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            """``d(a, g)/ds = (aᵀ ∂F/∂y, aᵀ ∂F/∂θ)`` at ``t = −s``, ``y`` off the dense output."""
            a = state[:n].reshape(shape)
            pull = vjp(lambda z, *p: field.with_tensors(p)(-s, z), dense(-s), *tensors)[1]
            return torch.cat([v.reshape(-1) for v in pull(a)])

        def norm(x: torch.Tensor) -> torch.Tensor:  # a's alone
            return x[:n].pow(2).mean().sqrt()

        a, g = grad_ys[-1], [torch.zeros(k, dtype=grad_ys.dtype, device=grad_ys.device) for k in sizes]
        for i in range(len(t) - 1, 0, -1):
            state = torch.cat([a.reshape(-1), *g])
            span = -t[i - 1 : i + 1].flip(0)
            # the last interval lands on t_0 (before it the dense output is the first step's extrapolation)
            end = odeint_vmappable(reversed_time, state, span, options={"norm": norm}, land=i == 1, **cfg["backward"])[
                -1
            ]
            a = end[:n].reshape(shape) + grad_ys[i - 1]
            g = list(end[n:].split(sizes)) if sizes else []
        return (a, None, None, *(x.reshape(p.shape).to(p.dtype) for x, p in zip(g, tensors)))


def interpolating_vmapped(run: Any, gradient: Any, options: dict) -> torch.Tensor | None:
    """The engine's solve of ``run`` under ``torch.vmap`` with the interpolating adjoint (``gradient``, an
    :class:`~solvers.gradients.Interpolating`): the states at ``run.t``, gradients with respect to ``run.y0``,
    ``run.params`` and every tracked tensor the field reaches by each instance's backward solve; ``None`` where
    nothing the solve reads is differentiated (the plain loop serves)."""
    s = run.solver
    method = gradient.method or s.method
    if method not in vmap_methods():
        raise ValueError(
            f"{gradient!r} under torch.func: the backward solve runs on the adaptive loop, whose methods are "
            f"{vmap_methods()}; pick one of them as its `method`."
        )
    func, groups, tensors = field_inputs(run, "interpolating")
    if not (tracked(run.y0) or any(tracked(p) for p in tensors)):
        return None
    rtol = s.rtol if gradient.rtol is None else gradient.rtol
    atol = s.atol if gradient.atol is None else gradient.atol
    cfg = dict(
        func=func,
        slots=groups,
        forward=dict(method=s.method, rtol=s.rtol, atol=s.atol, options=options, max_steps=s.max_steps),
        backward=dict(method=method, rtol=rtol, atol=atol, max_steps=s.max_steps),
    )
    return applied(_VmapInterpolating, "interpolating", run.y0, run.t, cfg, *tensors)[0]
