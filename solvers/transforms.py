"""Host reads that ``torch.func`` transforms allow: a solve under ``torch.vmap`` asks the host only whether a
condition holds in any (or every) instance, read on the tensor beneath every ``functorch`` wrapper, never computed
with. Used by the vmapped adaptive loop (:mod:`solvers.steppers.vmappable`) and by the doors' input checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch._C._functorch import TransformType

__all__ = [
    "PER_SAMPLE_UNDER_VMAP",
    "VmapLevel",
    "batched",
    "differentiated",
    "host_all",
    "host_any",
    "innermost_vmap",
    "outside_transforms",
    "physical",
    "tracked",
    "forward_mode_only",
    "transform_counts",
    "under_transform",
    "under_vmap",
    "wrapped",
]

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


def under_transform() -> bool:
    """Whether any ``torch.func`` transform (``vmap``, ``grad``/``jacrev``/``vjp``, ``jvp``/``jacfwd``) is active."""
    return _F.peek_interpreter_stack() is not None


def forward_mode_only() -> bool:
    """Whether every active ``torch.func`` transform is forward mode (``jvp``; ``jacfwd`` without its ``vmap``)."""
    stack = _F.get_interpreter_stack() or ()
    return bool(stack) and all(level.key() == TransformType.Jvp for level in stack)


def transform_counts() -> tuple[int, int]:
    """The active reverse-mode (``grad``/``jacrev``/``vjp``) and forward-mode (``jvp``/``jacfwd``) levels."""
    stack = _F.get_interpreter_stack() or ()
    keys = [level.key() for level in stack]
    return keys.count(TransformType.Grad), keys.count(TransformType.Jvp)


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


def differentiated(x: torch.Tensor) -> bool:
    """:func:`tracked`, or ``x`` wrapped at a forward-mode (``jvp``/``jacfwd``) level, whose tangent torch does not
    expose there: ``x`` may carry one (a conservative answer, never a missed tangent)."""
    jvp_levels = {level.level() for level in _F.get_interpreter_stack() or () if level.key() == TransformType.Jvp}
    while _F.is_functorch_wrapped_tensor(x):
        if x.requires_grad or _F.maybe_get_level(x) in jvp_levels:
            return True
        x = _F.get_unwrapped(x)
    return x.requires_grad


def batched(x: torch.Tensor) -> bool:
    """Whether ``x`` is batched by some ``torch.vmap`` level (it holds a value per instance)."""
    while _F.is_functorch_wrapped_tensor(x):
        if _F.is_batchedtensor(x):
            return True
        x = _F.get_unwrapped(x)
    return False


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


class VmapLevel:
    """The innermost ``torch.vmap`` level, for a solve that runs on its instances stacked along a leading axis, as a
    batching rule does: :meth:`stack` takes a tensor to that stacked form (the instances along axis 0, broadcast
    where the tensor is shared by every instance), :meth:`instance` gives a stacked tensor back as each instance's
    value at this level. Inside :meth:`popped` the level is off torch's transform stack, so the stacked tensors'
    operations run as plain ones (without ``vmap``'s dispatch on every operation); :meth:`evaluate` puts it back
    for one call that sees the instances."""

    def __init__(self, level: int, size: int) -> None:
        self.level, self.size = level, size
        self._saved: list = []

    def batched(self, x: torch.Tensor) -> bool:
        return bool(_F.is_batchedtensor(x)) and _F.maybe_get_level(x) == self.level

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        inner, dim = _F._unwrap_batched(x, self.level)
        if dim is None:
            return x.expand(self.size, *x.shape)
        return inner if dim == 0 else inner.movedim(dim, 0)

    def instance(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return _F._add_batch_dim(x, dim, self.level)

    @contextmanager
    def popped(self) -> Iterator[None]:
        self._saved.append(_F.pop_dynamic_layer_stack())
        try:
            yield
        finally:
            _F.push_dynamic_layer_stack(self._saved.pop())

    def evaluate(self, func: Callable[..., torch.Tensor], *stacked: torch.Tensor) -> torch.Tensor:
        """``func`` called inside :meth:`popped` with the level put back, on each instance's view of the stacked
        arguments (code that sees the instances: the field, which may close over tensors batched at this level),
        its result stacked."""
        _F.push_dynamic_layer_stack(self._saved[-1])
        try:
            return self.stack(func(*[_F._add_batch_dim(x, 0, self.level) for x in stacked]))
        finally:
            self._saved[-1] = _F.pop_dynamic_layer_stack()


@contextmanager
def outside_transforms() -> Iterator[None]:
    """Every ``torch.func`` level off torch's transform stack for the block's duration (put back after, also on an
    exception): for a probe whose tensors must be plain ones, whatever transform its first caller runs under."""
    saved = []
    try:
        while _F.peek_interpreter_stack() is not None:
            saved.append(_F.pop_dynamic_layer_stack())
        yield
    finally:
        for layer in reversed(saved):
            _F.push_dynamic_layer_stack(layer)


def innermost_vmap() -> VmapLevel | None:
    """The innermost transform when it is a ``torch.vmap`` (``None`` under a ``grad``/``jvp`` level or none)."""
    top = _F.peek_interpreter_stack()
    if top is None or top.key() != TransformType.Vmap:
        return None
    return VmapLevel(top.level(), _F.CVmapInterpreterPtr(top).batchSize())
