"""Host reads that ``torch.func`` transforms allow: a solve under ``torch.vmap`` asks the host only whether a
condition holds in any (or every) instance, read on the tensor beneath every ``functorch`` wrapper, never computed
with. Used by the vmapped adaptive loop (:mod:`solvers.steppers.vmappable`) and by the doors' input checks."""

from __future__ import annotations

import torch
from torch._C._functorch import TransformType

__all__ = ["PER_SAMPLE_UNDER_VMAP", "host_all", "host_any", "physical", "tracked", "under_vmap", "wrapped"]

_F = torch._C._functorch
#: both doors' refusal of per-sample control under vmap, which itself gives every instance its own steps
PER_SAMPLE_UNDER_VMAP = (
    "controller='per_sample' under torch.vmap: vmap already solves every instance on its own steps (each as if "
    "alone); use controller='batch' inside vmap, or per-sample control without vmap."
)


def under_vmap() -> bool:
    """Whether a ``torch.vmap`` level is active (anywhere in ``torch.func``'s interpreter stack)."""
    stack = _F.get_interpreter_stack()
    return bool(stack) and any(level.key() == TransformType.Vmap for level in stack)


def wrapped(x: torch.Tensor) -> bool:
    """Whether ``x`` is a ``functorch`` wrapper (batched by ``vmap``, or tracked by ``grad``/``jacrev``)."""
    return bool(_F.is_functorch_wrapped_tensor(x))


def tracked(x: torch.Tensor) -> bool:
    """Whether ``x`` is differentiated at some level: by a ``grad``/``jacrev`` wrapper or by autograd beneath
    them (a ``vmap`` wrapper's own ``requires_grad`` hides both)."""
    while _F.is_functorch_wrapped_tensor(x):
        if x.requires_grad:
            return True
        x = _F.get_unwrapped(x)
    return x.requires_grad


def physical(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every ``functorch`` wrapper peeled off: the tensor holding all instances' values."""
    while _F.is_functorch_wrapped_tensor(x):
        x = _F.get_unwrapped(x)
    return x


def host_any(x: torch.Tensor) -> bool:
    """Whether ``x`` holds a true value in any instance (one host read)."""
    return bool(physical(x).any())


def host_all(x: torch.Tensor) -> bool:
    """Whether ``x`` is true in every instance (one host read)."""
    return bool(physical(x).all())
