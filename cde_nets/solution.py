"""The one result type of every block's :meth:`solve`: the final state, saved states, statistics, stopping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["Solution"]


@dataclass
class Solution:
    """What a solve produced. Calling a block returns ``solution.y`` alone; ``block.solve(...)`` returns this.

    Attributes:
        y: the final state, ``(batch, *state_shape)``: ``y(T)``, the last layer's output, or each sample's state
            where it stopped.
        ts: the times at which states were saved (float64, increasing), or ``None`` when only ``y`` was asked
            for. In discrete mode layer ``l`` sits at time ``l h``, so both modes share one time axis.
        ys: the saved states, ``(len(ts), batch, *state_shape)``, or ``None``.
        stats: counts of the solve (read like a dict) — ``nfe_forward``, ``nfe_backward`` (filled in when
            ``backward()`` runs), ``steps_forward``, ``rejected_forward``, ``steps_backward``, ``rejected_backward``. In discrete mode
            a step is a layer and ``nfe`` counts field evaluations (rows of the batch are not counted).
        stop_times: per-sample stopping times ``(batch,)`` float64 when the block stops each sample on its own
            (``stop=``), else ``None``.
        depths: per-sample depths ``(batch,)`` long in discrete mode with ``stop=`` (the layers each sample
            took; its stopping time is ``depth · h``), else ``None``.
    """

    y: torch.Tensor
    ts: torch.Tensor | None = None
    ys: torch.Tensor | None = None
    stats: Mapping[str, int] = field(default_factory=dict)
    stop_times: torch.Tensor | None = None
    depths: torch.Tensor | None = None
