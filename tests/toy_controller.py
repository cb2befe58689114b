"""A step-size controller written as a user would add one: this file, plus one registry line (see
tests/solvers/test_recipes.py). The elementary controller with the exponent ``1/(p+1)`` of error per step
(Hairer, Nørsett & Wanner, "Solving Ordinary Differential Equations I", §II.4, eq. 4.12 with ``q = p``):
``φ(r) = safety · r^(−1/(p+1))``."""

from __future__ import annotations

from dataclasses import dataclass

from cde_nets.solvers.controllers import Controller


@dataclass(frozen=True)
class Elementary(Controller):
    name = "elementary"

    def proposal(self, ratio, order):
        return self.safety * ratio ** (-1.0 / (order + 1))
