"""The step-size controllers by name: one line each. ``controller="batch"`` means ``Integral()``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import Controller
from .integral import Integral
from .per_sample import PerSample

__all__ = ["CONTROLLERS", "as_controller", "controller_names", "is_per_sample"]

CONTROLLERS: dict[str, type[Controller]] = {
    "batch": Integral,
    "per_sample": PerSample,
}


def controller_names() -> tuple[str, ...]:
    return tuple(CONTROLLERS)


def as_controller(controller: str | Controller, options: Mapping[str, Any] | None = None) -> Controller:
    """The controller for a name (its constants from torchdiffeq's ``options``) or an instance; a clear error
    for anything else."""
    if isinstance(controller, Controller):
        controller.check_options(options or {})
        return controller
    if isinstance(controller, str) and controller in CONTROLLERS:
        return CONTROLLERS[controller].from_options(options or {})
    raise ValueError(
        f"`controller` must be one of {controller_names()} ('batch': one step size for the batch, "
        f"'per_sample': each sample its own) or a Controller object, got {controller!r}."
    )


def is_per_sample(controller: str | Controller) -> bool:
    """Whether ``controller`` runs every sample on its own steps (without building it)."""
    if isinstance(controller, Controller):
        return controller.per_sample
    cls = CONTROLLERS.get(controller) if isinstance(controller, str) else None
    return bool(cls is not None and cls.per_sample)
