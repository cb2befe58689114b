r"""Forward sensitivities under ``torch.vmap``: each vmapped instance's tangents carried along its own steps.

The solve's outputs ``Y = (y(t_0), …, y(t_m))`` are a function of its inputs ``x = (y_0, θ)``; forward-mode
differentiation through the loop of tensor decisions (:mod:`solvers.steppers.vmappable`) carries, beside every
value, its derivative along each unit direction of ``x`` (``torch.func.jacfwd``: a batch of tangents beside one
primal), which gives the Jacobian ``J = ∂Y/∂x`` in the forward call, and the backward pass is ``∂ℒ/∂x = Jᵀ ∂ℒ/∂Y``:
the discrete forward sensitivity of Ma et al. (2021, "A comparison of automatic differentiation and continuous
sensitivity analysis for derivatives of differential equation solutions"), as :mod:`solvers.gradients.forward`
computes it outside ``vmap``. Every step decision is the primal's, so each instance's tangents ride its own steps;
with ``steps="differentiated"`` they pass through the error estimate and the controller, as backprop's gradient
does, with ``"fixed"`` the step sizes are constants.

The Jacobian reaches autograd without an ``autograd.Function``: the output is ``Ȳ + J (x − x̄)`` with ``x̄``,
``Ȳ`` the detached ``x``, ``Y`` and ``J`` a constant, whose value is ``Y`` and whose derivative in ``x`` is ``J``,
so ``grad``, ``jacrev`` and ``vjp`` over or under ``vmap`` all read ``J``. The tensors to differentiate are
``y0``, ``adjoint_params`` and every tensor a ``torch.func`` level tracks that the field reaches (swapped into
their places for each evaluation, as the vmapped adjoint takes them:
:func:`solvers.gradients.vmap_adjoint.field_inputs`); as outside ``vmap``, a tensor that only requires grad and is
not among them gets no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import jacfwd

from ..steppers.vmappable import odeint_vmappable
from ..transforms import tracked
from .vmap_adjoint import _Swapped, differentiated, field_inputs

__all__ = ["HIDDEN_REFUSAL", "forward_vmapped"]

#: the refusal where the solve depends on a differentiated tensor that forward mode cannot seed
HIDDEN_REFUSAL = (
    "gradient='forward' under torch.func: the field reaches a tensor that torch.func differentiates (by grad, "
    "jacrev or vjp) in a place forward mode cannot seed with a tangent (a global, a tuple, an object without "
    "__dict__), so its gradient would be lost. Hold it in a module, an attribute, a closure variable, a dict or a "
    "list the field reaches (and pass it in `adjoint_params`), or use gradient='backprop'."
)


def forward_vmapped(run: Any, gradient: Any, options: dict) -> torch.Tensor | None:
    """The engine's solve of ``run`` under ``torch.vmap`` with ``gradient="forward"`` (a
    :class:`~solvers.gradients.Forward`): the states at ``run.t``, whose derivative in ``run.y0``, ``run.params``
    and every tracked tensor the field reaches is the Jacobian found by one tangent solve per instance; ``None``
    where nothing the solve reads is differentiated (the plain loop serves)."""
    func, groups, tensors = field_inputs(run, "forward")
    inputs = (run.y0, *tensors)
    wrt = tuple(i for i, x in enumerate(inputs) if tracked(x))
    if not wrt:
        return None
    n = sum(inputs[i].numel() for i in wrt)
    entries = n * len(run.t) * run.y0.numel()
    if entries > gradient.max_entries:
        raise ValueError(
            f"gradient='forward' would store a Jacobian of {entries} entries per instance ({n} inputs x "
            f"{len(run.t) * run.y0.numel()} outputs), above max_entries={gradient.max_entries}: use "
            "gradient='checkpoint' (reverse mode), or raise Forward(max_entries=)."
        )
    s = run.solver

    def solve(y: torch.Tensor, *p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        field = _Swapped(func, groups, p)
        ys = odeint_vmappable(
            field,
            y,
            run.t,
            method=s.method,
            rtol=s.rtol,
            atol=s.atol,
            options=options,
            max_steps=s.max_steps,
            steps=gradient.steps,
        )
        return ys, ys

    blocks, ys = jacfwd(solve, argnums=wrt, has_aux=True)(*(x.detach() for x in inputs))
    if differentiated(ys):  # reached on a branch the first evaluation did not take
        raise ValueError(HIDDEN_REFUSAL)
    out = ys.detach()
    for i, block in zip(wrt, blocks):
        x = inputs[i]
        step = (x - x.detach()).reshape(-1)  # zero, with derivative one: the product's derivative in x is J
        out = out + (block.detach().reshape(ys.numel(), -1) @ step).reshape(ys.shape)
    return out
