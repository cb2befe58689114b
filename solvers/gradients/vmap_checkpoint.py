r"""Checkpointed replay under ``torch.vmap``: the forward solve keeps each attempt's start, the backward pass
recomputes one attempt at a time and pulls the cotangent back through it (Zhuang et al. 2020, "Adaptive checkpoint
adjoint method", on the loop of tensor decisions of :mod:`solvers.steppers.vmappable`).

The loop's attempt is a map ``(t_0, y, k_0, h) ↦ (t_0', y', k_0', h')`` with the attempted step
``s = (t_0, t_1, h, y_0, y_1, k_1, …, k_s)`` on the side, kept as the instance's last step where it is accepted
(``last' = s`` where ``ok``, ``last`` elsewhere); each output is the dense output of the last step at its time.
The forward solve keeps every attempt's ``(t_0, y, k_0, h)`` and acceptance and each output time's last step,
without a graph; the backward pass walks the attempts in reverse, recomputes each with a graph and applies its
vector-Jacobian product (the acceptance splits ``last``'s cotangent: to the attempt where it was accepted, on to
the earlier last step elsewhere). The gradient is backprop's through the same loop, to rounding (the same
operations, the same step-size dependence of ``steps``); the memory is the attempts' starts, not their stages.

It runs as an ``autograd.Function`` written the way ``torch.func`` takes one (``setup_context``,
``generate_vmap_rule``), so under ``vmap`` every instance replays its own attempts; the kept starts are extra
outputs (stacked over the attempts, the same count for every instance: the loop runs as long as the longest),
marked non-differentiable. Tensors the field closes over are taken as inputs as the adjoint's
(:func:`solvers.gradients.vmap_adjoint.field_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import vjp

from ..steppers.tableaux import TABLEAUX
from ..steppers.vmappable import _Loop, odeint_vmappable
from ..transforms import tracked
from .vmap_adjoint import _Swapped, applied, field_inputs, live

__all__ = ["checkpoint_vmapped"]

_LAST = ("t0", "t1", "h", "y0", "y1")


def _unpack_last(parts: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    return {**dict(zip(_LAST, parts[:5])), "ks": list(parts[5].unbind(0))}


def _pack_last(last: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return (*(last[k] for k in _LAST), torch.stack(last["ks"]))


Pull = Callable[..., tuple[list, list]]


def replayed(field_with: Callable, make: Callable, fn: Callable, primals: tuple, tensors: tuple, cots: Any):
    """The cotangents of ``primals`` and of the field's ``tensors`` from those of ``fn(loop, *primals)``'s
    outputs, by one vector-Jacobian product through ``fn`` recomputed whole (every field evaluation in its graph);
    ``make(func)`` builds the loop on a field, ``field_with(tensors)`` the field on the given tensors."""
    n = len(primals)

    def whole(*a: torch.Tensor) -> Any:
        return fn(make(field_with(a[n:])), *a[:n])

    pulled = vjp(whole, *primals, *tensors)[1](cots)
    return list(pulled[:n]), list(pulled[n:])


class _Intervals:
    """Where the forward solve leaves its attempts' output intervals for the backward pass (an object, not a
    container: ``torch.func`` rebuilds the containers among a Function's inputs)."""

    of: list[int]


class _VmapCheckpoint(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(y0: torch.Tensor, t: torch.Tensor, cfg: dict, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        record: list = []
        with torch.no_grad():
            ys = odeint_vmappable(_Swapped(cfg["func"], cfg["slots"], tensors), y0, t, record=record, **cfg["forward"])
        starts = [r for r in record if isinstance(r, tuple)]
        accepted = [r for r in record if isinstance(r, torch.Tensor)]
        lasts = [_pack_last(r) for r in record if isinstance(r, dict)]
        cfg["intervals"].of = [r[0] for r in starts]  # each attempt's output interval: the same in every instance
        kept = tuple(torch.stack([r[i] for r in starts]) for i in range(1, 5))
        last = tuple(torch.stack([r[i] for r in lasts]) for i in range(6))
        return (ys, *kept, torch.stack(accepted), *last)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        y0, t, cfg, tensors = inputs[0], inputs[1], inputs[2], inputs[3:]
        ctx.mark_non_differentiable(*output[1:])
        ctx.cfg, ctx.n = cfg, len(tensors)
        ctx.save_for_backward(y0, t, *tensors, *output[1:])

    @staticmethod
    def backward(ctx: Any, grad_ys: torch.Tensor, *_: Any) -> tuple:
        cfg = ctx.cfg
        y0, t, *rest = (live(x) for x in ctx.saved_tensors)
        tensors, (T0, Y, K0, H, OK, *L) = rest[: ctx.n], rest[ctx.n :]
        field, fw = _Swapped(cfg["func"], cfg["slots"], tensors), cfg["forward"]
        tab = TABLEAUX[fw["method"]]

        def make(func: Any) -> _Loop:
            return _Loop(func, y0, tab, fw["rtol"], fw["atol"], fw["options"], 0, fw["steps"])

        def pull(fn: Any, primals: tuple, cots: Any) -> tuple[list, list]:
            return cfg["pull"](field.with_tensors, make, fn, primals, tensors, cots)

        def add(acc: list, new: Sequence[Any]) -> list:
            return [a + b for a, b in zip(acc, new)]

        g = [torch.zeros_like(p) for p in tensors]
        cot = [torch.zeros_like(x[0]) for x in (T0, Y, K0, H)]  # of the carry after the last attempt: unused
        cot_last = [torch.zeros_like(x[0]) for x in L]
        intervals = cfg["intervals"].of
        k = len(intervals) - 1
        for j in range(t.shape[-1] - 1, 0, -1):
            tj = t[..., j]

            def output(lp: _Loop, *a: torch.Tensor, tj: torch.Tensor = tj) -> torch.Tensor:
                return lp.interpolate(_unpack_last(a), tj)

            pulled, got = pull(output, tuple(x[j - 1] for x in L), grad_ys[j])
            cot_last, g = add(cot_last, pulled), add(g, got)
            while k >= 0 and intervals[k] == j:
                ok = OK[k]
                if k == 0:  # the first attempt is the last step whatever its acceptance
                    cot_step, cot_last = cot_last, [torch.zeros_like(c) for c in cot_last]
                else:
                    cot_step = [torch.where(ok, c, torch.zeros_like(c)) for c in cot_last]
                    cot_last = [torch.where(ok, torch.zeros_like(c), c) for c in cot_last]

                def attempt(lp: _Loop, *a: torch.Tensor, tj: torch.Tensor = tj) -> tuple[torch.Tensor, ...]:
                    carry, step, _, _ = lp.advance(tj, *a)
                    return (*carry, *_pack_last(step))

                cot, got = pull(attempt, (T0[k], Y[k], K0[k], H[k]), (*cot, *cot_step))
                g = add(g, got)
                k -= 1

        def start(lp: _Loop, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            t0, k0, h = lp.start(t, y, fw["options"].get("first_step"))
            return t0, y, k0, h

        pulled, got = pull(start, (y0,), tuple(cot))
        return (pulled[0] + grad_ys[0], None, None, *add(g, got))


def checkpoint_vmapped(run: Any, gradient: Any, options: dict, pull: Pull = replayed) -> torch.Tensor | None:
    """The engine's solve of ``run`` under ``torch.vmap`` with ``gradient="checkpoint"`` (a
    :class:`~solvers.gradients.Checkpoint` without a budget): the states at ``run.t``, gradients by the replay of
    each instance's attempts; ``None`` where nothing the solve reads is differentiated (the plain loop serves).
    ``pull``: how each recomputed piece is pulled back (:func:`replayed`, or the stage-by-stage product of
    :mod:`solvers.gradients.vmap_symplectic`)."""
    if getattr(gradient, "budget", None) is not None:
        raise ValueError(
            f"{gradient!r} under torch.func: the vmapped replay keeps every attempt's start (each instance's steps "
            "fall at different times, so a binomial schedule has no common placement); drop `budget`, or use "
            "gradient='adjoint' for memory flat in the steps."
        )
    func, groups, tensors = field_inputs(run, gradient.name)
    if not (tracked(run.y0) or any(tracked(p) for p in tensors)):
        return None
    s = run.solver
    forward = dict(
        method=s.method,
        rtol=s.rtol,
        atol=s.atol,
        options=options,
        max_steps=s.max_steps,
        steps=getattr(gradient, "steps", "differentiated"),
    )
    cfg = dict(func=func, slots=groups, forward=forward, intervals=_Intervals(), pull=pull)
    return applied(_VmapCheckpoint, gradient.name, run.y0, run.t, cfg, *tensors)[0]
