"""Implicit Runge-Kutta layers: one step of a Gauss-Legendre method per parameter piece
(:mod:`solvers.steppers.implicit`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..steppers.implicit import Newton, get_tableau, implicit_step
from ..steppers.implicit_predictor import StagePredictor
from ..steppers.implicit_tableaux import ImplicitTableau
from .base import Scheme

__all__ = ["ImplicitRungeKutta", "ImplicitMidpoint", "GL4", "GL6"]


class _Counting:
    def __init__(self, f: Any, l: int):
        self.f, self.l, self.n = f, l, 0

    def __call__(self, t: float, y):
        self.n += 1
        return self.f.evaluate(self.l, y, t=t)

    def count(self, k: int) -> None:
        self.n += k

    @property
    def batched(self) -> bool:
        """The stages can share one call: the field ignores the stage time within a layer and has no input."""
        return not getattr(self.f, "stage_times", True) and getattr(self.f, "u", None) is None


class ImplicitRungeKutta(Scheme):
    """Layer ``l``: ``y_{l+1} = y_l + h Σ b_i F_l(Y_i)`` with the stages ``Y_i = y_l + h Σ_j a_ij F_l(Y_j)`` solved
    by Newton to rounding (:class:`~solvers.steppers.implicit.Newton`), differentiated by the implicit function theorem.

    On a Hamiltonian field (``y' = J ∇H`` with a constant ``J`` per piece, e.g. the non-separable H1-DNN field of
    Galimberti et al. 2023, eq. 8) a symplectic tableau makes every layer a Poisson map, ``Φ J Φᵀ = J``, with no
    secular drift of ``H`` (Hairer, Lubich & Wanner 2006, Thm. VI.4.3, §X.3): ``properties = {"symplectic"}``
    there. Symmetric tableaux are invertible: a layer is undone by the step with ``−h`` (memory-free backward).
    :meth:`evaluations` reports the field evaluations of layer ``l`` in the current pass (Newton iterations
    included); :meth:`end_pass` drops them with the pass's stage chain.
    """

    tableau_name: str = ""
    state = "plain"

    def __init__(self, newton: Newton | None = None):
        self.newton = Newton() if newton is None else newton
        self._nfe: dict[int, int] = {}
        self._chain = StagePredictor()

    @property
    def tableau(self) -> ImplicitTableau:
        return get_tableau(self.tableau_name)

    @property
    def invertible(self) -> bool:  # type: ignore[override]
        return self.tableau.symmetric

    def options(self) -> dict[str, Any]:
        return {} if self.newton == Newton() else {"newton": self.newton}

    def for_field(self, field: Any, split: tuple[int, int] | None = None) -> Scheme:
        s = super().for_field(field, split)
        assert isinstance(s, ImplicitRungeKutta)
        s._nfe, s._chain = {}, StagePredictor()
        hamiltonian = bool(getattr(field, "hamiltonian", False))
        s.properties = frozenset({"symplectic"}) if hamiltonian and self.tableau.symplectic else frozenset()
        return s

    def evaluations(self, l: int) -> int:
        return self._nfe.get(l, self.tableau.stages)

    def end_pass(self) -> None:
        self._chain = StagePredictor()  # a new one, as for_field makes: the buffers go with the old
        self._nfe.clear()

    def init(self, y0):
        # a pass through the layers starts its own chain: a net fed its own output must not continue the last
        # pass's chain, or its result would depend on the call history
        self._chain.clear()
        return super().init(y0)

    def step(self, f, l, state, h, coef=None, t=None):
        return (self._layer(f, l, state[0], l * h if t is None else t, h),)

    def _layer(self, f: Any, l: int, y: Any, t0: float, h: float) -> Any:
        """One step; a layer that takes the previous layer's output continues its chain, as the steps of a
        continuous solve do: it starts from the previous stages' extrapolation and, under ``Newton("auto")``,
        with simplified Newton if the previous layer needed it."""
        fun, chain, newton = _Counting(f, l), self._chain, self.newton
        if newton.kind == "auto" and chain.kind == "simplified" and chain.carries_from(y):
            newton = replace(newton, kind="simplified")
        info: dict = {}
        guess, carry = chain.guess(self.tableau, y, h, piece=l), chain.carry(y)
        y1, _ = implicit_step(
            fun, t0, y, h, self.tableau, newton, batched=fun.batched, info=info, guess=guess, carry=carry
        )
        chain.record(y1, h, info["stages"], info["kind"])
        self._nfe[l] = fun.n
        return y1

    def check_invertible(self, field):
        if not self.invertible:
            raise ValueError(
                f"`memory_free=True` undoes each layer by the step with −h, which is its exact inverse only for a "
                f"symmetric method (implicit_midpoint, gl4, gl6); {self.name!r} is not. Pick one of those, or drop "
                "`memory_free`."
            )

    def inverse(self, f, l, state, h, coef=None, t=None):
        t = l * h if t is None else t
        return (self._layer(f, l, state[0], t + h, -h),)


class ImplicitMidpoint(ImplicitRungeKutta):
    """Implicit midpoint ``y_{l+1} = y_l + h F_l((y_l + y_{l+1}) / 2)``: Gauss-Legendre with one stage, order 2."""

    name, order, tableau_name, equation = "implicit_midpoint", 2, "implicit_midpoint", "GL1"
    description = "implicit midpoint: y' = y + h F((y + y')/2), Newton-solved"


class GL4(ImplicitRungeKutta):
    """Two-stage Gauss-Legendre (Butcher 1964), order 4."""

    name, order, tableau_name, equation = "gl4", 4, "gl4", "GL2"
    description = "Gauss-Legendre, 2 stages, order 4, Newton-solved"


class GL6(ImplicitRungeKutta):
    """Three-stage Gauss-Legendre (Butcher 1964), order 6."""

    name, order, tableau_name, equation = "gl6", 6, "gl6", "GL3"
    description = "Gauss-Legendre, 3 stages, order 6, Newton-solved"
