"""Times: the one check of requested output times, and the tag by which fixed-grid solves hand a stage time's
value to the field without reading it back from the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .transforms import batched, host_all
from .validation import finite_times

__all__ = ["HOST_TIME", "check_times"]

# attribute name of the host value a fixed-grid evaluation time carries (``getattr(t, HOST_TIME)``)
HOST_TIME = "_host_time"


def check_times(
    t: Sequence[float] | torch.Tensor,
    T: float,
    device: torch.device | None = None,
    *,
    backwards: bool = False,
    from_zero: bool = False,
) -> torch.Tensor:
    """``t`` as a detached float64 tensor: 1-D, at least two times, strictly increasing (or strictly decreasing when
    ``backwards``: a solve from ``T`` back towards 0), within ``[0, T]``; with ``from_zero`` it must start at 0."""
    try:
        tt = t.detach().double() if isinstance(t, torch.Tensor) else torch.as_tensor(t, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"`t` must be a 1-D sequence of times, got {type(t).__name__}.") from exc
    if tt.dim() == 1 and batched(tt):
        return _check_instances(tt, T, device, backwards, from_zero)
    if tt.dim() == 1:
        finite_times("t", tt)
    up = tt.dim() == 1 and len(tt) >= 2 and bool((tt[1:] > tt[:-1]).all())
    down = backwards and tt.dim() == 1 and len(tt) >= 2 and bool((tt[1:] < tt[:-1]).all())
    if not (up or down):
        raise ValueError(
            "`t` must be a 1-D strictly monotone sequence of at least two times: increasing (from "
            "y0 at time 0) or decreasing (from y0 at time T, backwards)."
            if backwards
            else "`t` must be a 1-D strictly increasing sequence of at least two times."
        )
    lo, hi = (float(tt[-1]), float(tt[0])) if down else (float(tt[0]), float(tt[-1]))
    if from_zero and lo != 0.0:
        raise ValueError(f"`t` must start at 0 and end at or before T={T}, got [{lo}, {hi}].")
    if lo < 0.0 or hi > T * (1 + 1e-12):
        raise ValueError(f"`t` must lie within [0, T] = [0, {T}], got [{lo}, {hi}].")
    return tt if device is None else tt.to(device)


def _check_instances(
    tt: torch.Tensor, T: float, device: torch.device | None, backwards: bool, from_zero: bool
) -> torch.Tensor:
    """:func:`check_times` of per-instance times under ``torch.vmap``: every condition in every instance, each read
    beneath the wrappers (one solve runs all instances, so they must also share a direction)."""
    if len(tt) < 2:
        raise ValueError("`t` must be a 1-D sequence of at least two times.")
    if not host_all(torch.isfinite(tt).all()):
        raise ValueError("`t` holds a non-finite time (NaN or inf) in some instance under torch.vmap.")
    rising, falling = (tt[1:] > tt[:-1]).all(), (tt[1:] < tt[:-1]).all()
    up = host_all(rising)
    down = backwards and not up and host_all(falling)
    if not (up or down):
        if backwards and host_all(rising | falling):
            raise ValueError(
                "per-instance `t` under torch.vmap: every instance's times are strictly monotone, but some increase "
                "and some decrease, and one vmapped solve runs every instance the same way; split the batch by "
                "direction (one vmap call each), or solve the instances in a loop."
            )
        raise ValueError(
            "`t` must be strictly increasing"
            + (" (or strictly decreasing, from y0 at time T)" if backwards else "")
            + " in every instance under torch.vmap."
        )
    lo, hi = (tt[-1], tt[0]) if down else (tt[0], tt[-1])
    if from_zero and not host_all(lo == 0):
        raise ValueError(f"`t` must start at 0 in every instance under torch.vmap and end at or before T={T}.")
    if not host_all((lo >= 0) & (hi <= T * (1 + 1e-12))):
        raise ValueError(f"`t` must lie within [0, T] = [0, {T}] in every instance under torch.vmap.")
    return tt if device is None else tt.to(device)
