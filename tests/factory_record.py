"""A TorchFunctionMode that records the floating-point tensors factory functions make, for the tests that check
that every tensor the library creates follows the input's dtype and device."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.eye, torch.arange, torch.linspace,
    torch.rand, torch.randn, torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
    torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
    torch.Tensor.new_tensor,
}  # fmt: skip


class Record(TorchFunctionMode):
    """``made``: ``(name, dtype, device, shape)`` of every floating-point tensor a factory function made."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, torch.dtype, torch.device, tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in FACTORIES and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.made.append((getattr(func, "__name__", str(func)), out.dtype, out.device, tuple(out.shape)))
        return out
