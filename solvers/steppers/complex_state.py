r"""A complex state for a stepper whose arithmetic is real: ``z = x + iy`` stepped as its parts ``(x, y)``.

An explicit Runge-Kutta step (Butcher 2016, "Numerical methods for ordinary differential equations", §23) is
linear in its stages, ``Y_i = z_0 + h Σ_j a_ij k_j``, so it is the same sum on the real and the imaginary parts:
stepping ``torch.view_as_real(z)`` (last axis of size 2) under the field ``view_as_real ∘ F ∘ view_as_complex``
takes the complex method's steps. Gradients pass through both views.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..norms import StateNorm

__all__ = ["RealParts"]


class RealParts:
    """A field of a complex state ``z = x + iy`` as the field of its parts ``(x, y)`` (``torch.view_as_real``,
    last axis of size 2), for the stepper, whose arithmetic is real: every stage ``Y_i = z_0 + h Σ a_ij k_j`` is
    the same sum on either part. The error of a step is then measured on each part (``|Re e|``, ``|Im e|``
    against ``atol + rtol max(|Re y|, ...)``) rather than on ``|e|``; callbacks and a recorder see the complex
    state."""

    def __init__(self, func):
        self.func = func
        for name in ("callback_step", "callback_accept_step", "callback_reject_step"):
            callback = getattr(func, name, None)
            if callback is not None:
                setattr(self, name, lambda t0, y, dt, _cb=callback: _cb(t0, _complex(y), dt))

    @property
    def recorder(self):
        return getattr(self.func, "recorder", None)

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(self.func(t, _complex(y)))

    @classmethod
    def wrap(cls, func, y0: torch.Tensor, rtol, atol, options: Mapping):
        options = dict(options)
        norm = options.get("norm")
        if norm is not None and not isinstance(norm, StateNorm):
            options["norm"] = lambda e, _norm=norm: _norm(_complex(e))
        tols = [tol.unsqueeze(-1) if isinstance(tol, torch.Tensor) and tol.dim() else tol for tol in (rtol, atol)]
        return cls(func), torch.view_as_real(y0), tols[0], tols[1], options


def _complex(y: torch.Tensor) -> torch.Tensor:
    whole = y.stride(-1) == 1 and y.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in y.stride()[:-1])
    return torch.view_as_complex(y if whole else y.clone(memory_format=torch.contiguous_format))
