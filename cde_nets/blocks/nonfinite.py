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

from cde_nets.solvers.transforms import host_all

__all__ = ["Found", "nonfinite_parameter", "Watch", "check_result"]


def nonfinite_parameter(module: nn.Module) -> str | None:
    """The name of the first parameter or buffer of ``module`` holding NaN/inf, else ``None``."""
    for name, p in module.state_dict(keep_vars=True).items():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            return name
    return None


class Found(Exception):
    """Raised by a :class:`Watch` with ``stop`` at the first non-finite output: the re-run need go no further."""


class Watch:
    """Wraps a callable ``f(t, y)``: records the first time at which it returned a non-finite value and which
    evaluation that was (``first``, counting from 1); with ``stop``, raises :class:`Found` there."""

    def __init__(self, f: Callable[..., torch.Tensor], stop: bool = False):
        self.f = f
        self.stop = stop
        self.t: float | None = None
        self.evaluations = 0
        self.first = 0

    def __call__(self, t: torch.Tensor, y: torch.Tensor, **kwargs) -> torch.Tensor:
        out = self.f(t, y, **kwargs)
        self.evaluations += 1
        if self.t is None and not _finite(out):
            self.t, self.first = float(t), self.evaluations
            if self.stop:
                raise Found
        return out

    def __getattr__(self, name: str):
        if name == "f":
            raise AttributeError(name)
        return getattr(self.f, name)


def _finite(out) -> bool:
    parts = out if isinstance(out, tuple | list) else (out,)
    return all(bool(torch.isfinite(o).all()) for o in parts if isinstance(o, torch.Tensor))


def check_result(y: torch.Tensor, explain: Callable[[], str]) -> None:
    """Raise :class:`~cde_nets.solvers.errors.SolverError` with ``explain()`` unless ``y`` is all finite."""
    from cde_nets.solvers.errors import Reason, SolverError

    with torch.no_grad():  # isfinite is composite (|y| != inf): with grad on, it would save y for a backward
        finite = host_all(torch.isfinite(y))  # under torch.vmap: in every instance
    if not finite:
        raise SolverError(explain(), reason=Reason.NONFINITE)
