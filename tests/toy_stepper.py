"""An explicit Runge-Kutta method added as a user would add one: this tableau, plus one registry line (see
tests/solvers/test_recipes.py). Ralston's second-order method (Ralston 1962, "Runge-Kutta methods with minimum error
bounds", Math. Comp. 16), ``c = (0, 2/3)``, ``b = (1/4, 3/4)``."""

from __future__ import annotations

from cde_nets.solvers.steppers.butcher import MethodTableau, Tableau

RALSTON = MethodTableau("ralston", 2, Tableau(a=((), (2 / 3,)), b=(1 / 4, 3 / 4), c=(0.0, 2 / 3)))
