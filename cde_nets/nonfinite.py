"""Naming where a solve went non-finite, so that NaN is never passed on silently.

A block checks its result once per call (one fused ``isfinite(y).all()``: a single host synchronisation). Only
when that fails does it spend time finding the cause: a parameter that already holds NaN/inf (typically after a
diverged optimiser step), or else the first time, step or layer at which the field returned a non-finite value,
found by re-running the solve without gradients and watching every evaluation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["nonfinite_parameter", "Watch", "check_result"]


def nonfinite_parameter(module: nn.Module) -> str | None:
    """The name of the first parameter or buffer of ``module`` holding NaN/inf, else ``None``."""
    for name, p in module.state_dict(keep_vars=True).items():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            return name
    return None


class Watch:
    """Wraps a callable ``f(t, y)``: records the first time at which it returned a non-finite value."""

    def __init__(self, f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.f = f
        self.t: float | None = None
        self.evaluations = 0

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.f(t, y)
        self.evaluations += 1
        if self.t is None and not bool(torch.isfinite(out).all()):
            self.t = float(t)
        return out

    def __getattr__(self, name: str):
        if name == "f":
            raise AttributeError(name)
        return getattr(self.f, name)


def check_result(y: torch.Tensor, explain: Callable[[], str]) -> None:
    """Raise :class:`~cde_nets.solvers.errors.SolverError` with ``explain()`` unless ``y`` is all finite."""
    from cde_nets.solvers.errors import Reason, SolverError

    with torch.no_grad():  # isfinite is composite (|y| != inf): with grad on, it would save y for a backward
        finite = bool(torch.isfinite(y).all())
    if not finite:
        raise SolverError(explain(), reason=Reason.NONFINITE)
