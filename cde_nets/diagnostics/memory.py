"""Peak memory held for backward, measured from the autograd graph itself.

On CPU there is no resettable allocator peak (``resource.getrusage`` gives the process's lifetime maximum RSS,
which only grows and so cannot separate one configuration from the next, and ``tracemalloc`` does not see
torch's allocator). :class:`SavedTensorMemory` instead uses ``torch.autograd.graph.saved_tensors_hooks``: every
tensor autograd saves for the backward pass is wrapped in a handle that counts its storage's bytes while the
graph keeps it alive (storages shared by several saved tensors count once; parameters and inputs are
excluded, as they exist anyway). Use it around the forward pass: ``current`` at its end is what the backward
pass will need and ``peak_bytes`` the most held at any time (including graphs of rejected steps and step-size
control, freed when dropped). That is the memory a gradient mode costs beyond the model: O(steps) for backprop
through the solver, O(1) for the adjoint, whose forward solve records no graph (its backward solve holds one
vector-Jacobian product's graph at a time, not counted here).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["SavedTensorMemory"]


class _Held:
    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: int | None, tracker: SavedTensorMemory):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self) -> None:
        if self.key is not None:
            self.tracker._release(self.key)


class SavedTensorMemory:
    """Context manager: ``peak_bytes`` of tensors saved for backward while it is active.

    Args:
        exclude: tensors whose storages are not counted (parameters, inputs).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}
        self.current = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Held:
        if t.layout != torch.strided:
            return _Held(t, None, self)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return _Held(t, None, self)
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current)
        else:
            entry[0] += 1
        return _Held(t, key, self)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    def __enter__(self) -> SavedTensorMemory:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
