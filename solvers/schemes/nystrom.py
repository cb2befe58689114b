r"""Runge-Kutta-Nyström layers for second-order fields (:mod:`solvers.steppers.nystrom_tableaux`): one step of
``q'' = f(q, q')`` per layer on the state ``(q, q')``.

On the seeds' second-order field ``x' = v``, ``v' = −γ v + η f(x)`` (blog §8; Hauser's C² net when ``γ = 0``) a
``nystrom4`` layer is the fourth-order Nyström step, four evaluations of the acceleration and none of ``x' = v``;
``dprkn6`` (``q'' = f(q)``: the undamped field) the sixth-order step of Dormand & Prince (1987).
"""

from __future__ import annotations

import copy

import torch

from ..steppers.nystrom_ode import check_second_order, nystrom_step
from ..steppers.nystrom_tableaux import NYSTROM_TABLEAUX
from .base import Scheme

__all__ = ["DPRKN6", "DPRKN8", "Nystrom", "Nystrom4"]


class Nystrom(Scheme):
    """A Nyström method as a layer (subclasses set :attr:`name`, the table's name)."""

    state = "velocity"

    def for_field(self, field, split=None):
        if split is not None:
            raise ValueError(f"`split` does not apply to {self.name!r}, which splits y = (q, q') itself; drop it.")
        check_second_order(field, self.name)
        return copy.copy(self)

    def evaluations(self, l):
        return NYSTROM_TABLEAUX[self.name].stages

    def init(self, y0):
        n = y0.shape[-1] // 2
        return (y0[..., :n], y0[..., n:])

    def readout(self, state):
        return torch.cat(state, -1)

    def with_readout(self, state, y):
        return self.init(y)

    def step(self, f, l, state, h, coef=None, t=None):
        q, v = state
        t = l * h if t is None else t

        def accel(_t, Q, V):
            return f.evaluate_part(l, torch.cat([Q, V], -1), 1)

        q1, v1, _ = nystrom_step(NYSTROM_TABLEAUX[self.name], accel, t, h, q, v, None)
        return (q1, v1)


class Nystrom4(Nystrom):
    """Nyström's fourth-order method for ``q'' = f(t, q, q')`` (Abramowitz & Stegun 1964, eq. 25.5.20)."""

    name, order, equation = "nystrom4", 4, "Abramowitz & Stegun 1964, eq. 25.5.20"
    description = "Nyström RKN step of order 4 on (x, v): four accelerations, none of x' = v"


class DPRKN6(Nystrom):
    """Dormand & Prince's sixth-order Nyström step for ``q'' = f(q)`` (Dormand & Prince 1987)."""

    name, order, equation = "dprkn6", 6, "Dormand & Prince 1987"
    description = "Dormand-Prince RKN step of order 6 on (x, v), q'' = f(q)"


class DPRKN8(Nystrom):
    """The eighth-order Nyström step of Dormand, El-Mikkawy & Prince (1987) for ``q'' = f(q)``."""

    name, order, equation = "dprkn8", 8, "Dormand, El-Mikkawy & Prince 1987"
    description = "Dormand-El-Mikkawy-Prince RKN step of order 8 on (x, v), q'' = f(q)"
