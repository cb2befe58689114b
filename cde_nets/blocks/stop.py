"""The stopping specification shared by every block: each sample stops on its own once its state has converged.

Pattern-dependent depth (Ciccone et al. 2018, NAIS-Net, §5.3): in discrete mode a sample stops after layer ``i``
once ``‖x(i) − x(i−1)‖ < eps``; in continuous mode at the first time ``‖F(t, x)‖ = eps``, a per-sample event whose
root is located on the solver's interpolant (:mod:`cde_nets.solvers.events`; there is no checking window any
more). Finished samples leave the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cde_nets.solvers.errors import check_positive, check_positive_int

__all__ = ["Stop", "as_stop"]


@dataclass(frozen=True)
class Stop:
    """``eps``: per-sample threshold (> 0). ``max_depth``: discrete mode only, the most layers a sample takes
    (default: the field's number of pieces; layer ``i`` uses piece ``min(i, L − 1)``). In continuous mode a
    sample stops at the root of ``‖F(t, x)‖ − eps`` (at ``T`` at the latest)."""

    eps: float
    max_depth: int | None = None

    def __post_init__(self) -> None:
        check_positive("eps", self.eps, "It is the per-sample convergence threshold, e.g. 1e-4.")
        d = self.max_depth
        if d is not None:
            check_positive_int("max_depth", d, "the most layers a sample takes")


def as_stop(stop: Stop | dict[str, Any] | None, mode: str) -> Stop | None:
    """Validate ``stop`` (a :class:`Stop` or a dict of its fields) for ``mode`` (``"discrete"`` or
    ``"continuous"``); a setting the mode would ignore is refused by name."""
    if stop is None:
        return None
    if isinstance(stop, dict):
        if "window" in stop:
            raise ValueError(
                "`stop` has no `window` any more: a continuous block locates each sample's stopping "
                "time (the root of ‖F‖ − eps) on the solver's interpolant. Drop `window`."
            )
        unknown = set(stop) - {"eps", "max_depth"}
        if unknown or "eps" not in stop:
            raise ValueError(
                f"`stop` takes eps (required) and max_depth (discrete); got "
                f"{sorted(stop)}. Example: stop=Stop(eps=1e-4)."
            )
        stop = Stop(**stop)
    if not isinstance(stop, Stop):
        raise TypeError(f"`stop` must be a cde_nets.Stop or a dict, got {type(stop).__name__}.")
    if mode == "continuous" and stop.max_depth is not None:
        raise ValueError(
            "`stop.max_depth` applies to discrete mode; a continuous block stops at T at the latest. "
            "Drop `max_depth` (or set the block's T)."
        )
    return stop
