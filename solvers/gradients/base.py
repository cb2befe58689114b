"""The interface every gradient method implements, and the solve it is handed (:class:`Run`).

A gradient method decides how the solve's backward pass is computed — by its own forward solve (an autograd
function, a replay, torchdiffeq's adjoint) — and declares which methods it can serve. diffrax's ``adjoint=``
objects (Kidger 2021, "On neural differential equations", §5) are the model: the choice a user makes is an
object that owns its solve; the short strings (``gradient="adjoint"``) name the default instance of each.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..options import IMPLICIT_METHODS, OWN_FIXED_METHODS, REVERSIBLE_METHODS, SPLIT_METHODS
from ..run import Run

__all__ = ["GradientMethod", "Run"]


class GradientMethod:
    """Base class of the gradient methods (``ODEBlock(..., gradient=...)``).

    A subclass sets :attr:`name` (its short string), declares what it serves (:meth:`supports`, and
    :attr:`sde` for the SDE block), and implements :meth:`solve`. The engine (:func:`solvers.engine.solve`) calls
    :meth:`solve` only where its own steppers do not serve the call: forward-only calls, and every call of a method
    whose gradient is backpropagation through the forward's operations (:attr:`forward_graph`), run on the
    library's stepper where it applies (:func:`~solvers.steppers.fast_rk.fast_applies`), the same steps as torchdiffeq.
    """

    name: ClassVar[str] = ""
    # how the fixed-step sweeps of cde_nets' own methods (implicit Runge-Kutta, symplectic compositions) give this
    # gradient: "backprop", "checkpoint" (states stored), "symplectic", "reversible" (states rebuilt by the exact
    # inverse step), or None where they cannot (solvers.steppers.implicit_ode.sweep)
    sweep: ClassVar[str | None] = None
    forward_graph: ClassVar[bool] = False  # the backward pass differentiates the forward solve's own operations
    counts_vjp: ClassVar[bool] = False  # nfe_backward counts vector-Jacobian products through recorded evaluations
    sde: ClassVar[bool] = False  # also served by the SDE block
    # costs one solve per differentiated input element (forward mode): studies over many parameters leave it out
    per_input: ClassVar[bool] = False

    def supports(self, method: str) -> bool:
        """Whether this gradient method can serve ``method`` (default: every method but the reversible ones, and
        the implicit and composition methods where it declares no :attr:`sweep`)."""
        if method in OWN_FIXED_METHODS:
            return self.sweep is not None
        return method not in REVERSIBLE_METHODS

    def refusal(self, method: str) -> str:
        """Why ``method`` is refused, and what to use instead (the message of :meth:`check`)."""
        if method in REVERSIBLE_METHODS:
            kind = "asynchronous leapfrog" if method == "alf" else "a reversible Runge-Kutta method"
            return (
                f"method={method!r} ({kind}) takes gradient='reversible' (its exact "
                f"inverse, constant memory) or 'backprop'; got {self.name!r}."
            )
        if method in IMPLICIT_METHODS:
            return (
                f"method={method!r} (implicit Runge-Kutta) takes gradient='backprop', 'checkpoint', 'symplectic' "
                f"or, for the symmetric methods, 'reversible' (each step's gradient by the implicit function "
                f"theorem); got {self.name!r}."
            )
        if method in SPLIT_METHODS:
            return (
                f"method={method!r} (a symplectic composition) takes gradient='backprop', 'checkpoint', or "
                f"'reversible' (states rebuilt by its exact inverse, constant memory); got {self.name!r}."
            )
        return f"gradient={self.name!r} cannot serve method={method!r}; use gradient='backprop'."

    def check(self, method: str) -> None:
        """Raise ``ValueError`` naming the fix unless :meth:`supports` ``method``."""
        if not self.supports(method):
            raise ValueError(self.refusal(method))

    def solve(self, run: Run) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        """The short name, for tables and logs."""
        return self.name

    def __repr__(self) -> str:
        fields = getattr(self, "__dataclass_fields__", {})
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in fields if getattr(self, k) != fields[k].default)
        return f"{type(self).__name__}({args})"
