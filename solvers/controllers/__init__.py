"""Step-size controllers: how an adaptive solve chooses its next step from the error of the last
(:class:`Controller`; the registry :data:`CONTROLLERS` maps ``controller=`` names to them)."""

from .base import Controller
from .integral import Integral
from .per_sample import PerSample
from .registry import CONTROLLERS, as_controller, controller_names, is_per_sample

__all__ = ["CONTROLLERS", "Controller", "Integral", "PerSample", "as_controller", "controller_names", "is_per_sample"]
