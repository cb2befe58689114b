"""The one result type of every block's :meth:`solve`: the final state, saved states, statistics, stopping."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cde_nets.solvers.counting import SolverStats

__all__ = ["Solution"]


@dataclass
class Solution:
    """What a solve produced. Calling a block returns ``solution.y`` alone; ``block.solve(...)`` returns this.

    Attributes:
        y: the final state, ``(batch, *state_shape)``: ``y(T)``, the last layer's output, or each sample's state
            where it stopped.
        ts: the times at which states were saved (float64, increasing; decreasing backwards in time), or
            ``None`` when only ``y`` was asked for. In discrete mode layer ``l`` sits at time ``l h``, so both
            modes share one time axis.
        ys: the saved states, ``(len(ts), batch, *state_shape)``, or ``None``.
        stats: a :class:`~cde_nets.solvers.counting.SolverStats` in every mode (read like a dict) —
            ``nfe_forward``, ``nfe_backward`` (filled in when ``backward()`` runs), ``steps_forward``,
            ``rejected_forward``, ``steps_backward``, ``rejected_backward``. In discrete mode a step is a layer,
            ``nfe_forward`` counts field evaluations (rows of the batch are not counted), and the backward
            counts stay 0 (autograd differentiates the layers; nothing is solved backwards).
        stop_times: per-sample stopping times ``(batch,)`` float64 when the block stops each sample on its own
            (``stop=``), else ``None``.
        depths: per-sample depths ``(batch,)`` long in discrete mode with ``stop=`` (the layers each sample
            took; its stopping time is ``depth · h``), else ``None``.
        fired: ``(batch,)`` bool with per-sample events (``event=``, ``t_end=``, ``stop=``): True where the sample
            stopped on its event, False where it ran to the end of the span; else ``None``. ``stop_times`` then
            holds the event times, differentiable (implicit function theorem).
        unconverged: discrete mode with ``stop=``: how many samples took ``max_depth`` layers without meeting
            the stopping test (depth ``max_depth`` by the limit, not by convergence; a NAIS net whose weights
            break its stability condition never converges), else ``None``.
        interpolant: the dense output of a ``solve(..., dense=True)`` (anything with ``evaluate(t)``), read
            through :meth:`evaluate`; else ``None``.
        regularisation: a block built with ``regularisers=``: each integrated term's batch mean (in the graph),
            e.g. ``{"kinetic": ∫‖F‖² dt, "jacobian": ∫‖∂F/∂y‖²_F dt}`` (:mod:`~cde_nets.blocks.regularisers`);
            else empty. Calls nested in a model reach the loss through :func:`~cde_nets.integrated_terms`.
    """

    y: torch.Tensor
    ts: torch.Tensor | None = None
    ys: torch.Tensor | None = None
    stats: SolverStats = field(default_factory=SolverStats)
    stop_times: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    fired: torch.Tensor | None = None
    interpolant: Any = None
    unconverged: int | None = None
    regularisation: dict[str, torch.Tensor] = field(default_factory=dict)

    def evaluate(self, t: float | Sequence[float] | torch.Tensor) -> torch.Tensor:
        """States at any times ``t`` within the solved span, from the solver's interpolant: ``(batch, ...)`` for
        one time, ``(len(t), batch, ...)`` for a 1-D sequence (differentiable like ``y``)."""
        if self.interpolant is None:
            raise ValueError(
                "this Solution has no dense output; solve with `block.solve(y0, dense=True)` to "
                "evaluate states between the saved times."
            )
        return self.interpolant.evaluate(t)
