r"""The interface every step-size controller implements.

An adaptive step of size ``h`` with error ratio ``r = ‖err / (atol + rtol max(|y_0|, |y_1|))‖`` is accepted when
``r ≤ 1``, and the next step is ``h · min(ifactor, max(φ(r), low))``, with ``φ`` the controller's proposal and
``low = 1`` after an accepted step (an accepted step never shrinks the next), ``dfactor`` after a rejected one
(Hairer, Nørsett & Wanner, "Solving Ordinary Differential Equations I", §II.4, eq. 4.13; Söderlind 2002,
"Automatic control and adaptive time-stepping", for controllers as filters of the error sequence). A controller
says its proposal (:meth:`Controller.proposal`, on a float and, for gradients through the step sizes, on a tensor
with its graph) and which solve loop runs it (:attr:`Controller.per_sample`: one step for the whole batch, or one
per sample). diffrax's ``stepsize_controller`` objects are the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from ..errors import check_positive

__all__ = ["Controller"]

Scalar = float | torch.Tensor
_DEFAULTS: dict[type, Controller] = {}


@dataclass(frozen=True)
class Controller:
    """Base class of the step-size controllers (``ODEBlock(..., controller=...)``, ``odeint(..., controller=...)``).

    ``safety``, ``ifactor``, ``dfactor``: the proposal's safety factor, the largest growth of a step, the largest
    shrinking after a rejection (torchdiffeq's options of the same names set them for the registered names). A
    subclass sets :attr:`name` and implements :meth:`proposal`; :attr:`per_sample` says whether it runs in the
    per-sample loop (:mod:`solvers.per_sample`) instead of the shared step."""

    safety: float = 0.9
    ifactor: float = 10.0
    dfactor: float = 0.2

    name: ClassVar[str] = ""
    per_sample: ClassVar[bool] = False
    OPTIONS: ClassVar[tuple[str, ...]] = ("safety", "ifactor", "dfactor")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_positive(f"{type(self).__name__}.{f.name}", getattr(self, f.name))

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Controller:
        """The controller with the constants set in ``options`` (torchdiffeq's ``safety``/``ifactor``/``dfactor``);
        the defaults' instance is made once (every solve asks for it)."""
        given = {k: float(options[k]) for k in cls.OPTIONS if k in options}
        if given:
            return cls(**given)
        default = _DEFAULTS.get(cls)
        if default is None:
            default = _DEFAULTS[cls] = cls()
        return default

    def proposal(self, ratio: Scalar, order: int) -> Scalar:
        """``φ(r)``, the factor proposed for an error ratio ``r > 0`` of a method of order ``order`` (a float, or a
        tensor carrying a graph: the same formula)."""
        raise NotImplementedError

    def proposal_graph(self, ratio: torch.Tensor, order: int) -> torch.Tensor:
        """:meth:`proposal` on a tensor that carries a graph (its value is that of the float)."""
        return torch.as_tensor(self.proposal(ratio, order))

    def factor(self, ratio: float, order: int) -> float:
        """The next step over the last: ``min(ifactor, max(φ(r), low))``; ``ifactor`` for a zero error, NaN for
        a NaN ratio."""
        if ratio == 0:
            return self.ifactor
        if math.isnan(ratio):
            return math.nan
        low = 1.0 if ratio < 1 else self.dfactor
        return min(self.ifactor, max(float(self.proposal(ratio, order)), low))

    def factor_graph(self, ratio: float, ratio_graph: Callable[[], torch.Tensor], order: int, accepted: bool) -> Scalar:
        """:meth:`factor` as a function of the state: the constant where it is clamped, else the proposal of the
        ratio that ``ratio_graph()`` makes with its graph (its value is ``ratio``). ``accepted``: whether the
        step was (a replay passes the forward's decision, which a recomputed ratio a rounding away from 1 must
        not change)."""
        if ratio == 0 or not math.isfinite(ratio):
            return self.ifactor if ratio == 0 else math.nan
        low = 1.0 if accepted else self.dfactor
        raw = float(self.proposal(ratio, order))
        if not low < raw < self.ifactor:
            return min(self.ifactor, max(raw, low))
        return self.proposal_graph(ratio_graph().to(torch.float64), order)

    def check_options(self, options: Mapping[str, Any]) -> None:
        """Refuse torchdiffeq's constants in ``options`` beside a controller object that holds its own."""
        both = sorted(k for k in self.OPTIONS if k in options)
        if both:
            raise ValueError(
                f"options {both} and controller={self!r} both set the controller's constants; set them on the "
                f"object ({type(self).__name__}({both[0]}=...)) and drop them from `options`."
            )
