"""Forward Euler and explicit Runge-Kutta schemes: ``y_{l+1} = y_l + h Σ b_i k_i``, stage ``i`` at ``t_l + c_i h``."""

from __future__ import annotations

import torch

from ..steppers.tableaux import TABLEAUX
from .base import Scheme, Tableau, axpy

__all__ = ["Euler", "RungeKutta", "Midpoint", "RK4", "RK4Classical"]


class Euler(Scheme):
    """Forward Euler ``y_{l+1} = y_l + h F_l(y_l)``: ResNet block, H1-DNN (Galimberti et al. 2023, eq. 9), Ruseckas's
    residual (eq. R109), NAIS-Net block (Ciccone et al. 2018, eq. 3)."""

    name, order, equation, description = "euler", 1, "H9, R109, N3", "forward Euler: y + h F(y)"

    def step(self, f, l, state, h, coef=None, t=None):
        y = state[0]
        return (axpy(y, h, f.evaluate(l, y, t=l * h if t is None else t)),)


class RungeKutta(Scheme):
    """Explicit Runge-Kutta on :attr:`tableau`: stage ``i`` at time ``t_l + c_i h``."""

    tableau: Tableau

    def evaluations(self, l):
        return len(self.tableau.b)

    def step(self, f, l, state, h, coef=None, t=None):
        y, t0 = state[0], l * h if t is None else t
        ks: list[torch.Tensor] = []
        for row, ci in zip(self.tableau.a, self.tableau.c):
            yi = y
            for aij, kj in zip(row, ks):
                if aij:
                    yi = axpy(yi, h * aij, kj)
            ks.append(f.evaluate(l, yi, t=t0 + ci * h))
        for bi, ki in zip(self.tableau.b, ks):
            if bi:
                y = axpy(y, h * bi, ki)
        return (y,)


class Midpoint(RungeKutta):
    """Explicit midpoint (RK2), for comparison."""

    name, order, description = "midpoint", 2, "explicit midpoint (RK2)"
    tableau = TABLEAUX["midpoint"].tableau


class RK4(RungeKutta):
    """Fourth-order Runge-Kutta by Kutta's 3/8 rule (Kutta 1901): the ``rk4`` of continuous mode and of
    torchdiffeq, for comparison."""

    name, order, description = "rk4", 4, "Runge-Kutta, Kutta's 3/8 rule (torchdiffeq's rk4)"
    tableau = TABLEAUX["rk4"].tableau


class RK4Classical(RungeKutta):
    """The classical fourth-order Runge-Kutta tableau (Kutta 1901), for comparison."""

    name, order, description = "rk4_classical", 4, "classical Runge-Kutta"
    tableau = TABLEAUX["rk4_classical"].tableau
