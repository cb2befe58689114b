r"""Second derivatives under ``torch.autograd`` through the gradient methods' own backward passes: served right,
or refused by name when differentiated.

A method with a backward pass of its own (an ``autograd.Function``) returns ``∂ℒ/∂x = B(x, ∂ℒ/∂Y)`` for the
solve ``Y = S(x)``, ``x = (y_0, θ)``. A second derivative (``create_graph=True`` then a ``grad`` of the gradient,
``torch.autograd.functional.hessian``, a gradient penalty) differentiates ``B`` itself,

    ``d/dx B(x, ∂ℒ/∂Y(S(x))) = ∂B/∂x + ∂B/∂(∂ℒ/∂Y) · ∂²ℒ/∂Y² · ∂S/∂x``,

and ``B`` computed without a graph has neither term. torch's ``once_differentiable`` hangs its error node on fresh
leaves beside the real graph, so a ``grad`` of the gradient with respect to ``x`` finds no path to it and returns
``None`` (``hessian`` then reports zeros); a ``B`` that is a product with a constant Jacobian (forward
sensitivities' ``Jᵀ g``) keeps only the second term, the Gauss-Newton part of the Hessian. Here the gradient a
backward pass returns under ``create_graph=True`` hangs off a node whose inputs are the real ones (the incoming
cotangents and the solve's inputs or outputs), so differentiating it always reaches that node, which either

- serves the derivative of ``B`` by recomputing ``B`` with a graph (:class:`_Served`; the first derivative keeps the
  method's own value, bit for bit), where that is cheap and right: the continuous adjoint's backward solve
  differentiated by autograd (Chen et al. 2018, "Neural ordinary differential equations", eqs. 4-5), right to the
  adjoint's tolerance, and forward sensitivities' ``Jᵀ g`` as the vector-Jacobian product of the solver's own
  steps, exact; or
- raises a ``ValueError`` naming ``gradient=`` and the fix (:class:`_Refused`).

Nothing happens for a call that passes ``create_graph=True`` without differentiating the gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..transforms import innermost_vmap

_F = torch._C._functorch

__all__ = [
    "FIX",
    "IMPLICIT_FIX",
    "PER_SAMPLE_FIX",
    "first_order",
    "refusal",
    "refused",
    "remember_inputs",
    "served",
    "third_refusal",
]

Grads = tuple[torch.Tensor | None, ...]


#: the fix a refusal names where the solve is an explicit Runge-Kutta one
FIX = (
    "Use gradient='backprop' (autograd differentiates the solve itself, to any order), or gradient='adjoint' or "
    "'forward' (their backward passes are differentiated once more), or torch.func.jacrev(jacrev(...)) with "
    "gradient='adjoint'."
)
#: the fix where the solve is an implicit Runge-Kutta method's (whose stages no gradient method differentiates twice)
IMPLICIT_FIX = (
    "Second derivatives through an implicit Runge-Kutta method's stage solve are not served by any gradient "
    "method: use a composition method or an explicit Runge-Kutta method (e.g. 'dopri5') with gradient='backprop'."
)

#: the fix under controller='per_sample'
PER_SAMPLE_FIX = (
    "Use gradient='backprop' (autograd differentiates every sweep, to any order), or controller='batch' with "
    "gradient='adjoint' or 'forward'."
)


def refusal(name: str, fix: str = FIX) -> str:
    """The message of a second derivative through ``gradient=name``'s backward pass that is not served."""
    return (
        f"gradient={name!r} gives first derivatives only under torch.autograd: its backward pass is computed "
        "without a graph of its own, so differentiating the gradient it returned (create_graph=True then "
        "torch.autograd.grad or .backward() of it, torch.autograd.functional.hessian, a gradient penalty) would "
        f"give a wrong second derivative. {fix}"
    )


def third_refusal(name: str) -> str:
    """The message of a third derivative through ``gradient=name``'s served second derivative."""
    return (
        f"gradient={name!r} serves first and second derivatives under torch.autograd, not a third (the second is "
        "the derivative of its backward pass recomputed once with a graph). Use gradient='backprop' for "
        "derivatives of any order."
    )


def remember_inputs(ctx: Any, *tensors: Any) -> None:
    """Keep, in an ``autograd.Function``'s forward, the inputs a second derivative reaches its backward pass through
    (read by :func:`first_order`): the tensors among ``tensors`` that require grad."""
    ctx.second_order_inputs = tuple(x for x in tensors if isinstance(x, torch.Tensor) and x.requires_grad)


def _requiring(xs: Sequence[Any]) -> list[torch.Tensor]:
    return [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]


class _Refused(torch.autograd.Function):
    """Identity on the gradients; differentiated, it raises the refusal."""

    @staticmethod
    def forward(ctx: Any, message: str, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.message = message
        return tuple(x.clone() for x in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        raise ValueError(ctx.message)


def refused(message: str, outs: Grads, anchors: Sequence[torch.Tensor]) -> Grads:
    """``outs`` in value, with a graph node that raises ``message`` when differentiated, reached from ``anchors``."""
    values = [o for o in outs if o is not None]
    if not values or not anchors:
        return outs
    it = iter(_Refused.apply(message, len(values), *values, *anchors))
    return tuple(None if o is None else next(it) for o in outs)


class _Served(torch.autograd.Function):
    """The gradients in value; differentiated, the vector-Jacobian product of their recomputation with a graph,
    ``recompute(free, params)`` with the ``free`` tensors as independent leaves (passed to it explicitly) and the
    ``params`` as they are (the field reads them in place)."""

    @staticmethod
    def forward(ctx: Any, cfg: tuple, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.cfg = cfg
        ctx.save_for_backward(*tensors[n:])
        return tuple(x.clone() for x in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple:
        recompute, n_free, mask, name = ctx.cfg
        saved = ctx.saved_tensors
        third = torch.is_grad_enabled()
        with torch.enable_grad():
            free = [x.detach().requires_grad_(x.requires_grad) for x in saved[:n_free]]
            params = list(saved[n_free:])
            outs = [o for o, keep in zip(recompute(free, params), mask) if keep]
            pairs = [(o, c) for o, c in zip(outs, cotangents) if o is not None and o.requires_grad]
            wrt = [(i, x) for i, x in enumerate([*free, *params]) if x.requires_grad]
            found: Sequence[torch.Tensor | None] = [None] * len(wrt)
            if pairs and wrt:
                found = torch.autograd.grad(
                    [o for o, _ in pairs], [x for _, x in wrt], [c for _, c in pairs], allow_unused=True
                )
        grads: list[torch.Tensor | None] = [None] * len(saved)
        for (i, _), g in zip(wrt, found):
            grads[i] = g
        if third:  # the recomputation's graph ends at its own leaves
            grads = list(refused(third_refusal(name), tuple(grads), _requiring(saved)))
        return (None, None, *(None for _ in cotangents), *grads)


def served(
    name: str,
    outs: Grads,
    free: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    recompute: Callable[[list[torch.Tensor], list[torch.Tensor]], Sequence[torch.Tensor | None]],
) -> Grads:
    """``outs`` (a backward pass's gradients, computed without a graph) in value, whose derivative is that of
    ``recompute(free, params)`` (a sequence aligned with ``outs``: the same gradients computed with a graph)."""
    mask = [o is not None for o in outs]
    values = [o for o in outs if o is not None]
    if not values:
        return outs
    cfg = (recompute, len(free), mask, name)
    it = iter(_Served.apply(cfg, len(values), *values, *free, *params))
    return tuple(None if o is None else next(it) for o in outs)


def _label(name: str) -> str:
    return name if "(" in name else f"gradient={name!r}"


def batched_refusal(label: str) -> str:
    """The message of cotangents batched by torch.autograd's own vectorisation, through ``label``'s backward pass."""
    return (
        f"{label} with batched cotangents (torch.autograd.functional.jacobian or hessian with vectorize=True, "
        "torch.autograd.grad(..., is_grads_batched=True)): its backward pass steps on the host, which torch's "
        "batching of the cotangents cannot run. Use vectorize=False (is_grads_batched=False), or torch.func.jacrev "
        "/ torch.func.vjp under torch.vmap (served by every gradient method), or gradient='backprop'."
    )


def _rowwise(backward: Callable, ctx: Any, cotangents: tuple, label: str) -> Any:
    """``backward(ctx, *cotangents)``; for cotangents batched by ``torch.vmap`` (a ``vmap`` over
    ``torch.autograd.grad``), whose loop over steps on the host a batching rule cannot run, the backward pass of each
    row in turn, outside the level, the results stacked back. torch.autograd's own vectorisation batches them with
    its older mechanism, which has no such way out: where its batching fails, refused by name."""
    if any(isinstance(c, torch.Tensor) and _F.is_legacy_batchedtensor(c) for c in cotangents):
        try:  # a backward pass of tensor operations only (forward sensitivities' Jᵀ g) runs batched
            return backward(ctx, *cotangents)
        except RuntimeError as error:
            if "Batching rule" not in str(error) and "vmap" not in str(error):  # not torch's batching: the user's
                raise
            raise ValueError(batched_refusal(label)) from error
    level = innermost_vmap()
    if level is None or not any(isinstance(c, torch.Tensor) and level.batched(c) for c in cotangents):
        return backward(ctx, *cotangents)
    stacked = [level.stack(c) if isinstance(c, torch.Tensor) and level.batched(c) else None for c in cotangents]
    with level.popped():
        rows = []
        for i in range(level.size):
            row = backward(ctx, *(c if s is None else s[i] for c, s in zip(cotangents, stacked)))
            rows.append(row if isinstance(row, tuple) else (row,))
        outs = tuple(None if r[0] is None else torch.stack(list(r)) for r in zip(*rows))
    outs = tuple(None if o is None else level.instance(o) for o in outs)
    return outs if isinstance(row, tuple) else outs[0]


def first_order(
    name: str | Callable[[Any], str],
    serve: Callable[[Any, tuple, Grads], Grads | str] | None = None,
    fix: str | Callable[[Any], str] = FIX,
) -> Callable:
    """Decorate an ``autograd.Function``'s ``backward`` (in place of ``once_differentiable``): it runs without a
    graph, and under ``create_graph=True`` its gradients hang off a node reached from its incoming cotangents and
    the inputs :func:`remember_inputs` kept, which serves the second derivative (``serve(ctx, cotangents, outs)``,
    where it returns the gradients through :func:`served`; where it does not serve this call, the message it
    returns is raised when they are differentiated) or raises the refusal naming ``gradient=name`` and ``fix``
    (each a string, or read off the context)."""

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx: Any, *cotangents: Any) -> Any:
            with torch.no_grad():
                outs = _rowwise(backward, ctx, cotangents, _label(name if isinstance(name, str) else name(ctx)))
            if not torch.is_grad_enabled():
                return outs
            anchors = _requiring(cotangents) + list(getattr(ctx, "second_order_inputs", ()))
            if not anchors:
                return outs
            single = not isinstance(outs, tuple)
            grads: Grads = (outs,) if single else outs
            result = serve(ctx, cotangents, grads) if serve is not None else None
            if result is None or isinstance(result, str):
                why = (name if isinstance(name, str) else name(ctx), fix if isinstance(fix, str) else fix(ctx))
                message = result or refusal(*why)
                result = refused(message, grads, anchors)
            return result[0] if single else result

        return wrapper

    return decorate
