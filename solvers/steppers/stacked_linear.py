r"""The ``nn.Linear`` layers of a field whose weights differ per ``torch.vmap`` instance (an ensemble: the field
called under ``torch.func.functional_call`` with stacked parameters), evaluated as one batched product on the
stacked instances while :func:`~solvers.steppers.vmappable.solve_vmapped` runs the loop on them.

Member ``i`` of the ensemble computes ``x_i W_iᵀ + b_i``. ``vmap``'s batching of ``nn.Linear`` reaches that through
a batched product, a scaling of the bias and a broadcast addition, each dispatched per evaluation; the stacked form
is one ``baddbmm`` of the stacked biases, inputs and transposed weights, the hand-written ensemble's product. Each
layer keeps running inside its module's ``__call__`` (hooks included) and the field's own ``forward`` runs at
every evaluation as before: only the layer's arithmetic is taken over, and only where its weight is batched at the
solve's level and that level is the innermost transform. A subclass of ``nn.Linear``, a layer whose weight is
shared, a call under a transform of the field's own (``vmap(jacrev(f))`` for a divergence), under ``torch.autocast``
(which torch does not apply to a vmapped ``nn.Linear``) or from another thread keep ``vmap``'s batching.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..transforms import VmapLevel

_F = torch._C._functorch

__all__ = ["stacked_linears"]


def _members(level: VmapLevel, func: Any) -> list[nn.Linear]:
    if not isinstance(func, nn.Module):  # a wrapper holding the module (a block's field with its call's input)
        func = getattr(func, "field", None)
        if not isinstance(func, nn.Module):
            return []
    return [
        m for m in func.modules() if type(m) is nn.Linear and "forward" not in m.__dict__ and level.batched(m.weight)
    ]


def _stacked_forward(level: VmapLevel, layer: nn.Linear):
    # the stacked transposed weight and bias, built again when the layer's tensors are swapped or the grad mode
    # changes (views taken under no_grad or inference mode carry no graph to the weight)
    seen: list[Any] = [None] * 5
    thread = threading.get_ident()  # torch's transform stack is per thread: another thread's call is its own

    def forward(input: torch.Tensor) -> torch.Tensor:
        w, b = layer.weight, layer.bias
        # vmap's rule where the solve's level is not the innermost transform (a transform inside the field), under
        # autocast (torch does not autocast a vmapped nn.Linear: the stacked product would run in another dtype
        # than vmap's rule) and on another thread
        if (
            _F.maybe_current_level() != level.level
            or torch._C._is_any_autocast_enabled()
            or threading.get_ident() != thread
        ):
            return nn.Linear.forward(layer, input)
        grad_mode = torch.is_grad_enabled()  # False under inference mode too
        if w is not seen[0] or b is not seen[1] or grad_mode is not seen[2]:
            if not level.batched(w):  # a shared weight swapped in by the field itself: vmap's rule
                return nn.Linear.forward(layer, input)
            ws = level.stack(w).transpose(1, 2)
            seen[:] = [w, b, grad_mode, ws, None if b is None else level.stack(b).unsqueeze(1)]
        xs, ws, bs = level.stack(input), seen[3], seen[4]
        rows = xs if xs.dim() == 3 else xs.reshape(level.size, -1, xs.shape[-1])
        out = torch.bmm(rows, ws) if bs is None else torch.baddbmm(bs, rows, ws)
        return level.instance(out if xs.dim() == 3 else out.reshape(*xs.shape[:-1], out.shape[-1]))

    return forward


@contextmanager
def stacked_linears(level: VmapLevel, func: Any) -> Iterator[None]:
    """Within the block, each ``nn.Linear`` of ``func`` whose weight is batched at ``level`` computes its ensemble's
    products as one ``baddbmm`` (put back after, also on an exception)."""
    layers = _members(level, func)
    for layer in layers:
        layer.forward = _stacked_forward(level, layer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
