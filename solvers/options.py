"""The methods by name, and the settings of one solve (:class:`SolverOptions`), validated once.

Method names follow torchdiffeq 0.2.5 (``rk4`` is Kutta's 3/8 rule there and here; the classical tableau is
``rk4_classical``), plus ``alf`` (:mod:`solvers.steppers.alf`), this library's reversible integrator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .controllers import Controller, as_controller, is_per_sample
from .errors import check_positive, check_positive_int
from .precision import check_autocast
from .steppers.implicit_ode import IMPLICIT_METHODS, IMPLICIT_OPTIONS
from .steppers.methods import ADAPTIVE_METHODS, FIXED_METHODS
from .steppers.reversible_rk import BASES as REVERSIBLE_RK_BASES
from .steppers.reversible_rk import OPTIONS as REVERSIBLE_RK_OPTIONS
from .steppers.split_ode import SPLIT_METHODS
from .steppers.tableaux import TABLEAUX
from .validation import TOLERANCE_HINT

__all__ = [
    "ADAPTIVE_METHODS",
    "FIXED_METHODS",
    "IMPLICIT_METHODS",
    "PER_SAMPLE_METHODS",
    "REVERSIBLE_METHODS",
    "REVERSIBLE_RK_METHODS",
    "SPLIT_METHODS",
    "SolverOptions",
    "check_autocast_method",
    "check_method",
    "check_options",
    "is_adaptive",
    "validate_tolerances",
]

# name -> order
# the explicit Runge-Kutta methods are their checked tableaux (solvers.steppers.tableaux), read live
# (solvers.steppers.methods): adaptive where an error estimate is embedded, fixed-step otherwise
# the alf integrator is cde_nets' own (solvers.steppers.alf), adaptive or on a fixed grid; so are the reversible
# Runge-Kutta methods (solvers.steppers.reversible_rk), of their base's order, fixed-step only on a base without an
# error estimate
REVERSIBLE_RK_METHODS: dict[str, int] = {f"reversible_{b}": TABLEAUX[b].order for b in REVERSIBLE_RK_BASES}
REVERSIBLE_METHODS: dict[str, int] = {"alf": 2, **REVERSIBLE_RK_METHODS}
# also cde_nets' own, fixed-step: implicit Runge-Kutta (solvers.steppers.implicit_ode) and, for separable fields, the
# symplectic compositions of Verlet (solvers.steppers.split_ode)
OWN_FIXED_METHODS: dict[str, int] = {**IMPLICIT_METHODS, **SPLIT_METHODS}

# the adaptive methods whose steps per-sample control takes (solvers.per_sample.solve)
PER_SAMPLE_METHODS = ("dopri5", "bosh3", "tsit5")

_ALF_OPTIONS = {"eta", "first_step", "max_step", "safety", "ifactor", "dfactor"}
_ADAPTIVE_OPTIONS = {"first_step", "max_step", "min_step", "safety", "ifactor", "dfactor", "step_t"}
_FIXED_OPTIONS: set[str] = set()


def check_method(method: str, name: str = "method") -> str:
    """``method`` if it names a method (``name``: the argument, for the message), else a ``ValueError``."""
    own = (*REVERSIBLE_METHODS, *OWN_FIXED_METHODS) if name == "method" else ()
    known = (*ADAPTIVE_METHODS, *FIXED_METHODS, *own)
    if not isinstance(method, str) or method not in known:
        alf = (
            f", reversible (adaptive, or fixed with `step_size`): {sorted(REVERSIBLE_METHODS)}, implicit "
            f"(fixed-step): {sorted(IMPLICIT_METHODS)}, symplectic compositions (fixed-step, separable fields): "
            f"{sorted(SPLIT_METHODS)}"
            if name == "method"
            else ""
        )
        raise ValueError(
            f"`{name}` {method!r} is unknown; adaptive: {sorted(ADAPTIVE_METHODS)}, "
            f"fixed-step: {sorted(FIXED_METHODS)}{alf}."
        )
    return method


def is_adaptive(method: str, step_size: float | None = None) -> bool:
    """Whether ``method`` chooses its own steps (``alf`` and the reversible Runge-Kutta methods on an adaptive base
    do unless given a ``step_size``)."""
    if method in REVERSIBLE_RK_METHODS:
        return step_size is None and TABLEAUX[method.removeprefix("reversible_")].error is not None
    return method in ADAPTIVE_METHODS or (method in REVERSIBLE_METHODS and step_size is None)


def check_options(method: str, options: Mapping | None, controller: str = "batch") -> dict:
    """A copy of ``options`` if every key is an option of ``method`` (under ``controller``), else a ``ValueError``
    naming the valid ones. ``step_t`` is left to :func:`_check_controller` under ``"per_sample"``, which refuses
    it with its own fix."""
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"`options` must be a dict of torchdiffeq options, got {type(options).__name__}.")
    options = dict(options or {})
    if method in REVERSIBLE_RK_METHODS:
        valid = REVERSIBLE_RK_OPTIONS if is_adaptive(method) else {"coupling"}
    elif method in REVERSIBLE_METHODS:
        valid = _ALF_OPTIONS
    elif method in IMPLICIT_METHODS:
        valid = IMPLICIT_OPTIONS
    elif method in SPLIT_METHODS:
        valid = set()
    else:
        valid = _ADAPTIVE_OPTIONS if method in ADAPTIVE_METHODS else _FIXED_OPTIONS
    unknown = set(options) - valid
    if unknown:
        fixed = method in FIXED_METHODS or method in OWN_FIXED_METHODS
        hint = "use `step_size=` of the block for fixed-step methods; " if fixed else ""
        where = f"method {method!r}"
        if controller == "per_sample" and method in ADAPTIVE_METHODS:
            where, valid = f"{where} under controller='per_sample'", valid - {"step_t"}
        raise ValueError(f"unknown option(s) {sorted(unknown)} for {where}; {hint}valid: {sorted(valid) or 'none'}.")
    return options


def _max_num_steps(options: Mapping | None, max_steps: int | None) -> tuple[Mapping | None, int]:
    """torchdiffeq's ``options["max_num_steps"]`` is the block's ``max_steps``: ``(options without it, the step
    budget)``; both given and different is refused. Default 100 000."""
    if not isinstance(options, Mapping) or "max_num_steps" not in options:
        return options, 100_000 if max_steps is None else max_steps
    n = check_positive_int("options['max_num_steps']", options["max_num_steps"], "steps allowed per solve")
    if max_steps is not None and max_steps != n:
        raise ValueError(
            f"`max_steps`={max_steps!r} and options['max_num_steps']={n} disagree: they are one setting, the steps "
            "allowed per solve (torchdiffeq's name and the block's); give one of them."
        )
    return {k: v for k, v in options.items() if k != "max_num_steps"}, n


def _autocast_option(options: Mapping | None, autocast: Any) -> tuple[Mapping | None, Any]:
    """``options["autocast"]`` (the functional door's spelling) is the field ``autocast``: ``(options without it,
    the dtype)``; both given and different is refused."""
    if not isinstance(options, Mapping) or "autocast" not in options:
        return options, autocast
    if autocast is not None and autocast != options["autocast"]:
        raise ValueError(
            f"`autocast`={autocast!r} and options['autocast']={options['autocast']!r} disagree: they are one "
            "setting, the dtype the field is evaluated in; give one of them."
        )
    return {k: v for k, v in options.items() if k != "autocast"}, options["autocast"]


def check_autocast_method(autocast: Any, method: str) -> None:
    """Refuse, naming the fix, a method whose field evaluations autocast does not serve: the symplectic
    compositions, which call the field's halves, not the field the option wraps."""
    if autocast is not None and method in SPLIT_METHODS:
        raise ValueError(
            f"`autocast` evaluates the field through its forward(t, y); method={method!r} is a composition, which "
            "calls the field's halves instead. Use a Runge-Kutta method (e.g. 'rk4', 'gl4', 'dopri5') with "
            "`autocast`, or drop `autocast`."
        )


def validate_tolerances(rtol: float, atol: float) -> tuple[float, float]:
    """A block's tolerances: numbers > 0 (the functional API's :func:`~solvers.validation.check_tolerance`
    also takes tensors and, as torchdiffeq, 0; both say the same)."""
    return check_positive("rtol", rtol, TOLERANCE_HINT["rtol"]), check_positive("atol", atol, TOLERANCE_HINT["atol"])


class FrozenOptions(dict):
    """A solver's options after validation: a dict that refuses changes (copy it with ``dict(...)`` to edit)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("solver options are fixed once validated; build new SolverOptions (`.replace(options=...)`).")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self):
        return (FrozenOptions, (dict(self),))

    def __deepcopy__(self, memo: dict) -> FrozenOptions:
        return self

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))


@dataclass(frozen=True, init=False)
class SolverOptions:
    """How to integrate: the method, its tolerances or step, the step budget and the solver's options.

    Checked once, on construction, with errors that name the argument: tolerances belong to adaptive methods and
    ``step_size`` to fixed-step ones (``alf`` is either, by whether ``step_size`` is given); ``jumps`` tells an
    adaptive method where time-varying parameters jump (torchdiffeq's ``jump_t``, default on); ``options`` are
    the method's further torchdiffeq options (unknown keys raise; ``max_num_steps`` there is ``max_steps``, default
    100 000). ``rtol``/``atol`` default to 1e-6/1e-8.
    ``controller``: ``"batch"`` (one step size for the whole batch, torchdiffeq's steps), ``"per_sample"``
    (every sample on its own steps: ``dopri5``/``bosh3``/``tsit5``, :mod:`solvers.per_sample.solve`), another registered
    name, or a :class:`~solvers.controllers.Controller` object (its constants set on it, not in ``options``).
    ``compile``: each step one ``torch.compile``d graph with the field inside (:mod:`solvers.steppers.compiled`:
    explicit Runge-Kutta methods, the shared step, backprop; refused by name elsewhere). Off by default.
    """

    method: str
    rtol: float
    atol: float
    step_size: float | None
    max_steps: int
    jumps: bool
    options: Mapping[str, Any]
    controller: str | Controller
    compile: bool
    autocast: Any

    def __init__(
        self,
        method: str = "dopri5",
        rtol: float | None = None,
        atol: float | None = None,
        step_size: float | None = None,
        max_steps: int | None = None,
        jumps: bool | None = None,
        options: Mapping[str, Any] | None = None,
        controller: str | Controller = "batch",
        compile: bool = False,
        autocast: Any = None,
    ):
        set_ = object.__setattr__  # frozen: every field is set once, here
        set_(self, "method", check_method(method))
        adaptive = is_adaptive(method, step_size)
        options, max_steps = _max_num_steps(options, max_steps)
        options, autocast = _autocast_option(options, autocast)
        per_sample = is_per_sample(controller)
        options = check_options(method, options, "per_sample" if per_sample else "batch")
        if isinstance(controller, Controller) and per_sample:  # the per-sample loop reads its constants there
            controller.check_options(options)
            options = {**options, **{k: getattr(controller, k) for k in controller.OPTIONS}}
        set_(self, "options", FrozenOptions(options))
        if not adaptive and (rtol is not None or atol is not None):
            raise ValueError(
                f"`rtol`/`atol` control adaptive methods; the fixed-step {method!r} would ignore them. "
                "Drop them (set the step with `step_size`), or use an adaptive method such as 'dopri5'."
            )
        rtol, atol = validate_tolerances(1e-6 if rtol is None else rtol, 1e-8 if atol is None else atol)
        set_(self, "rtol", rtol)
        set_(self, "atol", atol)
        if step_size is not None:
            if adaptive:
                raise ValueError(
                    f"`step_size` applies to fixed-step methods {sorted(FIXED_METHODS)}, not {method!r}; "
                    "use `rtol`/`atol` (or options={'first_step': ...}) for adaptive methods."
                )
            step_size = check_positive("step_size", step_size, "It is the largest fixed step; it must be > 0.")
        set_(self, "step_size", step_size)
        if jumps is not None and not adaptive:
            raise ValueError(
                f"`jumps` tells adaptive solvers where the parameters jump; the fixed-step {method!r} "
                "always steps on every piece boundary. Drop `jumps`."
            )
        set_(self, "jumps", True if jumps is None else bool(jumps))
        set_(self, "max_steps", check_positive_int("max_steps", max_steps))
        set_(self, "controller", _check_controller(controller, method, self.options))
        if not isinstance(compile, bool):
            raise TypeError(f"`compile` must be True or False, got {compile!r}.")
        if compile:  # imported here: the compiled step is opt-in
            from .steppers.compiled import check_compiled

            check_compiled(method, None, controller)
        set_(self, "compile", compile)
        check_autocast_method(autocast, method)
        set_(self, "autocast", check_autocast(autocast, rtol if adaptive else None))

    @property
    def per_sample(self) -> bool:
        """Whether every sample takes its own steps (:mod:`solvers.per_sample`)."""
        return is_per_sample(self.controller)

    @property
    def stepper_controller(self) -> Controller | None:
        """The shared-step controller the library's stepper runs, where one other than torchdiffeq's (the name
        ``"batch"``, set by ``options``) is asked for."""
        if self.per_sample or self.controller == "batch":
            return None
        return as_controller(self.controller, {} if isinstance(self.controller, Controller) else self.options)

    @property
    def adaptive(self) -> bool:
        """Whether the method chooses its own steps."""
        return is_adaptive(self.method, self.step_size)

    def steps_over(self, pieces: list[tuple[float, float]]) -> int:
        """Fixed steps the grid takes over ``pieces`` (each piece in steps of at most ``step_size``)."""
        step = self.step_size
        return sum(1 if step is None else max(1, math.ceil((b - a) / step - 1e-9)) for a, b in pieces)

    def replace(self, **changes: Any) -> SolverOptions:
        """A copy with ``changes``, validated again."""
        kw = {k: getattr(self, k) for k in self.__dataclass_fields__}
        kw["options"] = dict(self.options)
        if not self.adaptive:  # the defaults filled in for fixed-step methods are not settings
            kw["rtol"] = kw["atol"] = kw["jumps"] = None
        return SolverOptions(**{**kw, **changes})


def _check_controller(controller: str | Controller, method: str, options: Mapping[str, Any]) -> str | Controller:
    """``controller`` if it names one (or is one) and serves ``method`` and ``options``, else a ``ValueError``
    naming the fix."""
    rule = as_controller(controller, {} if is_per_sample(controller) else options)
    if rule.per_sample:
        if method not in PER_SAMPLE_METHODS:
            raise ValueError(
                f"controller={controller!r} serves methods {list(PER_SAMPLE_METHODS)}, not {method!r}; use one of "
                "them, or controller='batch'."
            )
        if "step_t" in options:
            raise ValueError(
                f"controller={controller!r} has no per-sample `step_t`; drop options['step_t'], or use "
                "controller='batch'."
            )
    elif controller != "batch":
        check_shared_controller(controller, method)
    return controller


def check_shared_controller(controller: str | Controller, method: str) -> None:
    """A shared-step controller other than torchdiffeq's chooses the steps of the library's adaptive
    Runge-Kutta stepper: refuse, naming the fix, a method that takes fixed steps or controls its own."""
    if method not in ADAPTIVE_METHODS:
        raise ValueError(
            f"controller={controller!r} chooses the step sizes of the adaptive Runge-Kutta methods "
            f"{sorted(ADAPTIVE_METHODS)}; method={method!r} does not take them from it. Use one of those methods, "
            "or controller='batch'."
        )
