r"""A scheme followed by the standard projection onto invariants (:class:`~solvers.steppers.projection.Projection`;
Hairer, Lubich & Wanner 2006, §IV.4): ``Projected("rk4", Projection(field.energy))`` is an rk4 layer whose output is
moved back onto the energy level of its input.

The layer keeps the base scheme's order and its invariants to rounding, and loses what the projection breaks: a
symplectic base scheme's layer is no longer symplectic (``"symplectic"`` leaves :attr:`properties`; ``"projected"``
joins them).
"""

from __future__ import annotations

import copy

from ..steppers.projection import Projection
from .base import Scheme

__all__ = ["Projected"]


class Projected(Scheme):
    """``base`` (a scheme or its name) followed by ``projection`` after every step."""

    def __init__(self, base: Scheme | str, projection: Projection):
        from .registry import get_scheme

        if not isinstance(projection, Projection):
            raise TypeError(
                f"`projection` must be a Projection, e.g. Projection(invariant=field.energy); got {projection!r}."
            )
        self.base = get_scheme(base)
        if self.base.state not in ("plain", "split", "velocity") or isinstance(self.base, Projected):
            raise ValueError(
                f"projection needs a one-step scheme whose state is the field's (plain, split or velocity); "
                f"{self.base.name!r} carries {self.base.state!r} state. Use a Runge-Kutta, splitting, Gauss or "
                "Nyström scheme."
            )
        self.projection = projection
        self.name = f"{self.base.name}+projection"
        self.order, self.state, self.equation = self.base.order, self.base.state, self.base.equation
        self.coefficients, self.variant = self.base.coefficients, self.base.variant
        self.properties = (self.base.properties - {"symplectic"}) | {"projected"}
        self.description = f"{self.base.description}, projected onto {projection.describe()} (HLW §IV.4)"

    def options(self):
        return {"base": self.base.name, "projection": self.projection.describe()}

    def for_field(self, field, split=None):
        s = copy.copy(self)
        s.base = self.base.for_field(field, split)
        s.order, s.variant = s.base.order, s.base.variant
        s.properties = (s.base.properties - {"symplectic"}) | {"projected"}
        return s

    def architecture(self, field=None):
        name, eq = self.base.architecture(field)
        return f"{name}, projected onto {self.projection.describe()}", f"{eq}; HLW §IV.4"

    def coefficient_init(self, L, channels):
        return self.base.coefficient_init(L, channels)

    def coefficient_values(self, params, h, ndim):
        return self.base.coefficient_values(params, h, ndim)

    def evaluations(self, l):
        return self.base.evaluations(l)

    def init(self, y0):
        return self.base.init(y0)

    def readout(self, state):
        return self.base.readout(state)

    def with_readout(self, state, y):
        return self.base.with_readout(state, y)

    def end_pass(self):
        self.base.end_pass()

    def step(self, f, l, state, h, coef=None, t=None):
        t = l * h if t is None else t
        y_start = self.base.readout(state)
        stepped = self.base.step(f, l, state, h, coef, t)
        y = self.projection.project(t + 0.5 * h, y_start, self.base.readout(stepped))
        return self.base.with_readout(stepped, y)
