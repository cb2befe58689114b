"""The method tables as live views of the registered tableaux (:data:`~solvers.steppers.tableaux.TABLEAUX`).

A method name is registered once, as its checked tableau; whether it is adaptive (an embedded error estimate),
fixed-step, and run by the library's stepper is read off that tableau whenever it is asked, so a new explicit
Runge-Kutta method is one tableau and one line of ``TABLEAUX``, and every table below (and each door's method
check) knows it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from .butcher import MethodTableau
from .tableaux import TABLEAUX

__all__ = ["ADAPTIVE_METHODS", "FIXED_METHODS", "RK_METHODS", "MethodView"]


class MethodView(Mapping[str, int]):
    """``name -> order`` of the registered tableaux for which ``keep(tableau)`` holds, then ``extra``'s."""

    def __init__(self, keep: Callable[[MethodTableau], bool], extra: Mapping[str, int] | None = None):
        self._keep = keep
        self._extra = dict(extra or {})

    def __getitem__(self, name: str) -> int:
        tab = TABLEAUX.get(name)
        if tab is not None and self._keep(tab):
            return tab.order
        return self._extra[name]

    def __iter__(self) -> Iterator[str]:
        yield from (name for name, tab in TABLEAUX.items() if self._keep(tab))
        yield from (name for name in self._extra if name not in TABLEAUX)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        tab = TABLEAUX.get(name)
        return (tab is not None and self._keep(tab)) or (tab is None and name in self._extra)

    def __repr__(self) -> str:
        return repr(dict(self))

    def with_extra(self, extra: Mapping[str, int]) -> MethodView:
        """This view plus the methods ``extra`` (stepped elsewhere)."""
        return MethodView(self._keep, {**self._extra, **extra})


# adaptive where an error estimate is embedded, fixed-step otherwise; a tableau marked not `continuous` serves the
# discrete schemes only
ADAPTIVE_METHODS = MethodView(lambda tab: tab.error is not None)
FIXED_METHODS = MethodView(lambda tab: tab.error is None and tab.continuous)
# every method the library's Runge-Kutta stepper runs (solvers.steppers.fast_rk)
RK_METHODS = MethodView(lambda tab: tab.continuous)
