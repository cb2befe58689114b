r"""Directional derivatives of a solve, without its Jacobian: ``jvp(block_or_func, y0, t, tangent_y0, tangent_params)``.

For the outputs ``y(t)`` of a solve from ``y0`` with parameters ``θ``, one solve in tangent mode (forward-mode
differentiation through the solver's steps, Griewank & Walther 2008, "Evaluating Derivatives", §3.1) gives

    ẏ(t) = ∂y(t)/∂y0 · v0 + ∂y(t)/∂θ · vθ,

at the cost of one solve carrying a tangent beside every value. The step sizes of an adaptive method are functions
of the state, and their tangents are carried too (:mod:`cde_nets.solvers.gradients.step_sizes`), so ``ẏ`` is the
derivative of the computed solution, the same one ``gradient="backprop"`` differentiates. For ``y' = A y``, ``ẏ(t) =
e^{At} v0`` up to the solver's error. The full Jacobian, for gradients with few parameters, is ``gradient="forward"``
(:class:`~cde_nets.solvers.gradients.Forward`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from cde_nets.blocks.ode import ODEBlock
from cde_nets.functional import odeint

from .solvers.gradients import Backprop
from .solvers.gradients.step_sizes import check_steps
from .solvers.gradients.tangents import dual_solve, find_slots
from .solvers.steppers.fast_rk import FAST_METHODS

__all__ = ["jvp"]


def jvp(
    model: ODEBlock | Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor | None = None,
    tangent_y0: torch.Tensor | None = None,
    tangent_params: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | None = None,
    *,
    params: Sequence[torch.Tensor] | None = None,
    u: torch.Tensor | None = None,
    steps: str = "differentiated",
    **odeint_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The solution and its directional derivative ``(y, ẏ)``, ``ẏ = ∂y/∂y0 · tangent_y0 + ∂y/∂θ · tangent_params``.

    Args:
        model: an :class:`~cde_nets.ODEBlock` (``y`` is ``block.solve(y0, u, t=t)``'s ``ys``, or its final state
            when ``t`` is ``None``), or a field ``func(t, y)`` solved by :func:`cde_nets.odeint` with
            ``odeint_kwargs`` (``rtol``, ``atol``, ``method``, ``options``).
        y0: the initial state, a tensor.
        t: the output times (required for a ``func``).
        tangent_y0: the direction in ``y0``'s shape (``None``: zero).
        tangent_params: the direction in the parameters: for a model that is an ``nn.Module``, a mapping from
            parameter names (as ``named_parameters()`` gives them) to tensors of their shapes, the others zero;
            for a plain function, one tensor per tensor of ``params`` (the tensors it closes over).
        steps: ``"differentiated"`` (the default: the step sizes' tangents carried) or ``"fixed"`` (held).

    Returns:
        ``(y, ẏ)`` of the same shape, without a graph.
    """
    check_steps(steps)
    if steps == "torchdiffeq":
        raise ValueError("jvp takes steps='differentiated' (the default) or 'fixed'; got 'torchdiffeq'.")
    if not isinstance(y0, torch.Tensor):
        raise TypeError(f"`y0` must be a tensor, got {type(y0).__name__}.")
    if tangent_y0 is not None and (tangent_y0.shape != y0.shape or tangent_y0.dtype != y0.dtype):
        raise ValueError(
            f"`tangent_y0` must have y0's shape {tuple(y0.shape)} and dtype {y0.dtype}, got "
            f"{tuple(tangent_y0.shape)} {tangent_y0.dtype}."
        )
    tensors, tangents = _directions(model, tangent_params, params)
    if tangent_y0 is not None:
        tangents[id(y0)] = tangent_y0
    inputs = {id(y0): y0, **{id(x): x for x in tensors}}
    slots = find_slots(model, {id(x): x for x in tensors})
    missing = slots.missing({id(x): x for x in tensors})
    if missing:
        raise ValueError(
            f"a tensor of `params` (shape {tuple(missing[0].shape)}) is not held by `model` (neither a parameter, "
            "buffer or attribute of its modules nor a closure variable of the function): jvp sets each tangent "
            "where the field reads the tensor."
        )
    return dual_solve(_solver(model, t, u, steps, odeint_kwargs), y0, inputs, tangents, slots)


def _directions(
    model: Any, tangent_params: Any, params: Sequence[torch.Tensor] | None
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """The tensors the solve reads (every parameter of a module, else ``params``) and the tangents given, by
    identity."""
    if isinstance(model, nn.Module):
        if params is not None:
            raise ValueError("`params` is for a plain function; a module's directions are named in `tangent_params`.")
        if tangent_params is not None and not isinstance(tangent_params, Mapping):
            raise TypeError("`tangent_params` of a module must map parameter names to tangents.")
        named: dict[str, torch.Tensor] = dict(model.named_parameters())
        given = dict(tangent_params or {})
        unknown = sorted(set(given) - set(named))
        if unknown:
            raise ValueError(
                f"`tangent_params` names {unknown}, which are not parameters of the model: {sorted(named)}."
            )
        pairs = [(named[k], v, f"tangent_params[{k!r}]") for k, v in given.items()]
        tensors: list[torch.Tensor] = list(named.values())
    else:
        tensors = list(params or ())
        given_seq = list(tangent_params or ())
        if isinstance(tangent_params, Mapping) or len(given_seq) not in (0, len(tensors)):
            raise ValueError(
                f"for a plain function, `tangent_params` is one tensor per tensor of `params` ({len(tensors)}), "
                "in its order."
            )
        pairs = [(x, v, f"tangent_params[{i}]") for i, (x, v) in enumerate(zip(tensors, given_seq))]
    for x, v, name in pairs:
        if not isinstance(v, torch.Tensor) or v.shape != x.shape:
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"`{name}` must be a tensor of its parameter's shape {tuple(x.shape)}, got {got}.")
    return tensors, {id(x): v.to(x.dtype) for x, v, _ in pairs}


def _solver(model: Any, t, u, steps: str, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """The solve from a start state, on the library's stepper with the step sizes' tangents as ``steps`` says."""
    if isinstance(model, ODEBlock):
        if kwargs:
            raise TypeError(f"{sorted(kwargs)} are odeint's arguments; an ODEBlock solves with its own settings.")
        if model.method not in FAST_METHODS or model.solver.controller != "batch" or model.stop is not None:
            raise ValueError(
                f"jvp runs the block on the library's Runge-Kutta stepper with one step size for the batch: "
                f"method={model.method!r} must be one of {sorted(FAST_METHODS)}, with controller='batch' and no "
                "`stop`."
            )

        def solve_block(start: torch.Tensor) -> torch.Tensor:
            kept = model.gradient
            model.gradient = Backprop(steps=steps)
            try:
                sol = model.solve(start, u, t=t)
            finally:
                model.gradient = kept
            return sol.y if t is None else sol.ys

        return solve_block
    if t is None:
        raise ValueError("`t` (the output times) is required to solve a function.")
    if u is not None:
        raise ValueError("`u` is a block input; a function closes over its own inputs.")
    method = kwargs.get("method") or "dopri5"
    refused = sorted(k for k in ("gradient", "event_fn", "controller", "adjoint_params") if k in kwargs)
    if method not in FAST_METHODS or refused:
        raise ValueError(
            f"jvp solves the function on the library's Runge-Kutta stepper: method={method!r} must be one of "
            f"{sorted(FAST_METHODS)}" + (f", and it sets {refused} itself (drop them)." if refused else ".")
        )
    return lambda start: odeint(model, start, t, gradient=Backprop(steps=steps), **kwargs)
