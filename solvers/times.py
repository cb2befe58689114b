"""Times: the one check of requested output times, and the tag by which fixed-grid solves hand a stage time's
value to the field without reading it back from the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
