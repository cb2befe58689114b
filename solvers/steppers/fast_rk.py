r"""A fast forward path through torchdiffeq's explicit Runge-Kutta methods: the same steps, fewer tensor operations.

torchdiffeq (the integrator of record) stores the stages of a step strided along the last axis and combines
them with a broadcast product and a reduction per stage, fits the dense-output quartic after every accepted step
whether or not an output time lies in it, and controls the step size with a dozen small tensor operations and
host synchronisations. A profile of its ``dopri5`` (Hamiltonian field, dim 64, batch 1024, one thread) spends
about half its time in those products and reductions (``aten::mul``/``aten::sum``) and a third in the field.

This module takes the same steps with the same arithmetic (:mod:`solvers.steppers.rk_stages`: torchdiffeq's kernels in
its order, so for ``dopri5`` the values and backprop gradients are its own bit for bit), and drops the rest:

- the weights ``h a_ij`` of a step are one host product; without a graph every result goes to a reused buffer,
  and from a few hundred elements on the CPU the stages are stage-major rows reduced in torch's own order;
- the dense output is fitted only for the step that holds an output time;
- the error norm ``‖err / (atol + rtol max(|y_0|, |y_1|))‖_RMS`` (for a tuple state, given as
  ``options["norm"]``, a :class:`~solvers.norms.StateNorm`, the largest of its parts'; a norm of the user's is
  called as torchdiffeq calls it) is computed without a graph and read back once per step with a finiteness
  probe of ``y_1``; step-size control runs on Python floats
  (IEEE doubles, as torchdiffeq's float64 scalars), the times on the host beside the tensors that carry their
  graph.

Methods: ``dopri5`` (Dormand & Prince 1980, "A family of embedded Runge-Kutta formulae", J. Comput. Appl. Math. 6,
with Shampine's 1986 dense output), ``tsit5`` (Tsitouras 2011, with his continuous extension), ``dopri8`` (Prince &
Dormand 1981, with a seventh-order continuous extension whose five stages are evaluated only for a step that
holds an output time: :mod:`solvers.steppers.dopri8`), ``bosh3`` (Bogacki & Shampine 1989), ``fehlberg2`` and
``adaptive_heun`` (the last two not FSAL: a step's end is ``y_0 + h Σ b_i k_i``, and its last stage is the next
step's first all the same), these three with the cubic Hermite dense output rather than torchdiffeq's lower-order
ones (:func:`solvers.steppers.tableaux.hermite_mid`), and the fixed-step ``euler``, ``midpoint``, ``heun2``, ``heun3``
and ``rk4`` (the 3/8 rule), with their tableaux from :mod:`solvers.steppers.tableaux`.
Step-size control is the standard one of Hairer, Nørsett & Wanner ("Solving Ordinary Differential Equations I",
§II.4): the initial step of their algorithm, the step accepted when the error ratio is at most 1, and the next
step ``h · min(ifactor, max(safety · ratio^(−1/p), dfactor))`` (``dfactor`` only after a rejection), as torchdiffeq
implements it, including its ``jump_t`` handling (a step is clipped at a jump and the field re-read on its far
side), its evaluation times (a stage with ``c = 1`` just before ``t_1``; the first stage of a fixed step just
after ``t_0``), its ``step_t`` (a step clipped there, the field not re-read) and ``norm`` options, and per-element
tolerances. Under ``backprop`` every step size carries its dependence on the state, through the error ratio and
the controller (:mod:`solvers.gradients.step_sizes`; ``steps="torchdiffeq"``: the first step size's only, as
torchdiffeq).

So the accepted and rejected steps and the number of field evaluations are torchdiffeq's (dopri8's, plus five
for each step that holds an output time); ``dopri5``'s numbers are its bits, the fixed-step methods other than
``euler`` and ``midpoint`` (which torchdiffeq writes as formulas, not tableaux) agree to rounding.
:func:`fast_applies` says when a forward solve takes this path directly; :func:`solvers.steppers.rk_odeint.odeint_rk`
brings the rest to it (tuple states and decreasing times: the adjoint's backward solve), and
:mod:`solvers.steppers.rk_events` runs torchdiffeq's event search on it. A complex state is stepped as its real and
imaginary parts (its error measured on each). Only the multistep methods and ``scipy_solver`` stay torchdiffeq's.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import numpy as np
import torch

from ..controllers import Controller, Integral
from ..gradients.step_sizes import attach, carries, check_steps
from ..norms import StateNorm
from ..times import HOST_TIME
from .complex_state import RealParts
from .methods import RK_METHODS
from .rk_stages import Buffered, Graph, StageMajor, sum_order
from .tableaux import TABLEAUX, MethodTableau, dense_at

__all__ = ["FAST_METHODS", "HOST_TIME", "STEPPER_OPTIONS", "fast_applies", "odeint_fast", "stage_times"]

# The time tensors of a fixed grid carry their value on the host under this attribute, so that a piecewise field
# finds the piece in force without reading the device (cde_nets.fields.pieces.TimeGrid.index).

# every registered tableau the stepper runs, read live (solvers.steppers.methods)
FAST_METHODS = RK_METHODS
_OPTIONS = {
    "first_step",
    "max_step",
    "min_step",
    "safety",
    "ifactor",
    "dfactor",
    "controller",  # a shared-step Controller object (solvers.controllers), set by the doors, not by torchdiffeq
    "jump_t",
    "perturb",
    "grid_constructor",
    "norm",  # torchdiffeq's: a callable of the scaled error (a tuple state's StateNorm by default)
    "step_t",
    "interp",  # a fixed grid's output between its points: "linear" or "cubic", as torchdiffeq's
}
STEPPER_OPTIONS = frozenset(_OPTIONS)  # the torchdiffeq options the stepper takes
_NONE, _NEXT, _PREV = 0, 1, -1

Scalar = float | torch.Tensor  # a time quantity: a float, or a 0-d float64 tensor while it carries a graph


# False sends every solve to torchdiffeq (the equality tests compare both paths)
ENABLED = True
# a complex state is stepped as its real and imaginary parts (torch.view_as_real)
_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def fast_applies(
    method: str, graph: bool, y0: Any, t: torch.Tensor, params: Sequence[torch.Tensor] | None, options: Mapping
) -> bool:
    """Whether :func:`odeint_fast` can stand in for torchdiffeq's ``odeint`` in this call: a method and options it
    implements, increasing output times that need no gradient, a float32/float64 state, and either ``graph`` (the
    gradient method differentiates through the forward solve's operations: backprop) or no graph to build (a
    forward-only call in any gradient method)."""
    if not ENABLED or method not in FAST_METHODS or not set(options) <= _OPTIONS:
        return False
    if not isinstance(y0, torch.Tensor) or y0.dtype not in _DTYPES or y0.numel() == 0:
        return False
    if t.dim() != 1 or len(t) < 2 or t.requires_grad:
        return False
    tl = t.tolist()
    if not all(a < b for a, b in zip(tl, tl[1:])):
        return False
    if graph:
        return True
    return not (torch.is_grad_enabled() and (y0.requires_grad or any(p.requires_grad for p in params or ())))


class _Clock:
    """Time arithmetic as torchdiffeq rounds it: adaptive stage times in the state's dtype, fixed-step times in
    float64, evaluation times cast to the state's dtype and nudged by one ulp there."""

    def __init__(self, y: torch.Tensor):
        self.dtype, self.device = y.dtype, y.device
        self.single = y.dtype == torch.float32
        self._c32: dict[tuple, tuple[np.ndarray, list[int]]] = {}  # nodes c_1.. in float32, where c_i = 1

    def y(self, x: Scalar) -> Scalar:
        """``x`` rounded to the state's dtype (a tensor is cast)."""
        if isinstance(x, torch.Tensor):
            return x.to(self.dtype)
        return float(np.float32(x)) if self.single else x

    def nudge(self, v: Any, perturb: int) -> Any:
        """``v`` (in the state's dtype) moved to its neighbour above (``_NEXT``) or below (``_PREV``)."""
        if not perturb:
            return v
        if not self.single:
            return math.nextafter(v, math.inf if perturb > 0 else -math.inf)
        if v == 0.0:
            return math.copysign(2.0**-149, perturb)
        bits = struct.unpack("<i", struct.pack("<f", v))[0]
        bits += 1 if (v > 0) == (perturb > 0) else -1  # float32 bit patterns are ordered by magnitude
        return struct.unpack("<f", struct.pack("<i", bits))[0]

    def at(self, x: Scalar, perturb: int = _NONE) -> torch.Tensor:
        """The time tensor a field sees: ``x`` in the state's dtype, nudged by ``perturb``."""
        if isinstance(x, torch.Tensor):
            v = x.to(self.dtype)
            if perturb:
                with torch.no_grad():
                    step = torch.nextafter(v, v.new_tensor(math.inf if perturb > 0 else -math.inf)) - v
                v = v + step  # the neighbour exactly, with the gradient of ``x``
            return v
        return torch.tensor(self.nudge(self.y(x), perturb), dtype=self.dtype, device=self.device)

    def _after(self, t0: Scalar, ci: Scalar, h: Scalar) -> torch.Tensor:
        """The stage time ``t_0 + c_i h`` (all in the state's dtype), made when called."""
        return self.at(t0 + ci * h)

    def _below(self, x: Scalar) -> Callable[[], torch.Tensor]:
        """A maker of ``x``'s neighbour below (``x`` in the state's dtype) that, while ``x`` carries a graph, gives
        each call a node of its own: the distance to the neighbour is found once, each call adds it to ``x``."""
        if not isinstance(x, torch.Tensor):
            end = self.at(x, _PREV)
            return lambda: end
        steps: list[torch.Tensor] = []

        def below() -> torch.Tensor:
            if not steps:
                with torch.no_grad():
                    steps.append(torch.nextafter(x, x.new_tensor(-math.inf)) - x)
            return x + steps[0]  # as at(x, _PREV)

        return below

    def many(self, values: Sequence[Any], host: bool = False) -> Sequence[torch.Tensor]:
        """Several evaluation times (already in the state's dtype) as 0-d tensors, made in one transfer; with
        ``host``, each carries its value on the host (:data:`HOST_TIME`; about 1 µs a tensor, so only where the
        loop is to read nothing back)."""
        ts = torch.tensor(values, dtype=self.dtype, device=self.device).unbind()
        if host:
            for tensor, value in zip(ts, values):
                setattr(tensor, HOST_TIME, value)
        return ts

    def adaptive_times(self, t0: Scalar, hy: Scalar, t1: Scalar, c: Sequence[float]) -> Sequence[torch.Tensor]:
        """Stages ``1..s−1`` of an adaptive step of size ``hy`` (already in the state's dtype): ``t_0 + c_i h`` in
        the state's dtype, ``c_i = 1`` just before ``t_1``. While the times carry a graph, ``t_0`` and ``t_1`` are
        cast once each, as torchdiffeq casts them, and every stage at ``c_i = 1`` (dopri5 and tsit5 have two) is
        nudged through a node of its own, as torchdiffeq nudges the time on each call: so the parts of ``t_1``'s
        gradient add one at a time, as its do. (One node shared by both stages adds their two parts first; where
        the cast is no cast, in float64, that rounds ``t_1``'s sum, and through the first step size every
        parameter's gradient, otherwise in the last bit.) Each time, ``t_0 + c_i h`` included, is made as its stage
        reads it: made at the step's start, the times' parts of ``h``'s gradient came after all the weights' rather
        than between them."""
        if isinstance(t0, torch.Tensor) or isinstance(hy, torch.Tensor) or isinstance(t1, torch.Tensor):
            t0y, t1y = self.y(t0), self.y(t1)
            end = self._below(t1y)
            return _Lazy([end if ci == 1.0 else partial(self._after, t0y, self.y(ci), hy) for ci in c[1:]])
        t1v = self.nudge(self.y(t1), _PREV)
        if self.single:
            key = tuple(c)
            cs = self._c32.get(key)
            if cs is None:
                cs = self._c32[key] = (
                    np.asarray(c[1:], dtype=np.float32),
                    [i for i, ci in enumerate(c[1:]) if ci == 1.0],
                )
            ts = np.float32(t0) + cs[0] * np.float32(hy)
            ts[cs[1]] = t1v
            return torch.from_numpy(ts).to(self.device).unbind()  # no list round trip
        return self.many([t1v if ci == 1.0 else t0 + ci * hy for ci in c[1:]])


class _Lazy(Sequence[torch.Tensor]):
    """Times made when a stage first reads them: while they carry a graph, each stage's time and weights are made
    in torchdiffeq's order, so that the gradient of the step size sums its parts as its does."""

    def __init__(self, makers: list[Callable[[], torch.Tensor]]):
        self.makers = makers

    def __len__(self) -> int:
        return len(self.makers)

    def __getitem__(self, i):
        return self.makers[i]()


def _dense_weights(tab: MethodTableau) -> list[list[float]]:
    """``P[p][i]``: the dense output ``y(t_0 + x h) = y_0 + h Σ_i β_i(x) k_i`` with ``β_i(x) = Σ_p P[p][i] x^(p+1)``.

    torchdiffeq's quartic ``p(x)`` has ``p(0) = y_0``, ``p'(0) = h k_1``, ``p(1/2) = y_0 + h Σ m_i k_i``,
    ``p(1) = y_0 + h Σ b_i k_i``, ``p'(1) = h k_s``; solving for its coefficients and collecting the stages gives
    these weights (the ``y_0`` terms cancel). A method with its own continuous extension (tsit5) uses that."""
    if tab.dense is not None:
        return [list(row) for row in tab.dense]
    assert tab.mid is not None
    s, b, m = tab.stages, tab.tableau.b, tab.mid
    first = [1.0 if i == 0 else 0.0 for i in range(s)]
    last = [1.0 if i == s - 1 else 0.0 for i in range(s)]
    return [
        first,
        [last[i] - 4 * first[i] + 16 * m[i] - 5 * b[i] for i in range(s)],
        [5 * first[i] - 3 * last[i] + 14 * b[i] - 32 * m[i] for i in range(s)],
        [2 * last[i] - 2 * first[i] + 16 * m[i] - 8 * b[i] for i in range(s)],
    ]


def _times_from(values: Any, t0: float) -> list[float]:
    """torchdiffeq's ``_sort_tvals``: the times of an option from ``t0`` on, increasing."""
    return sorted(v for v in ([] if values is None else torch.as_tensor(values).reshape(-1).tolist()) if v >= t0)


def _f(x: Scalar) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else x


def _callback(func: Any, name: str) -> Callable[..., Any]:
    return getattr(func, name, None) or (lambda *args: None)


def odeint_fast(
    func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str,
    rtol: float,
    atol: float,
    options: Mapping,
    graph: bool = True,
    steps: str = "differentiated",
    land_on_jumps: bool = False,
) -> torch.Tensor:
    """``torchdiffeq.odeint(func, y0, t, rtol=, atol=, method=, options=)`` for the calls :func:`fast_applies`
    accepts: the same steps, evaluations and callbacks (``callback_step``, ``callback_accept_step``,
    ``callback_reject_step`` of ``func``), results equal to rounding. Without ``graph``, runs under no-grad.
    ``steps`` (:mod:`solvers.gradients.step_sizes`): what the graph of an adaptive solve differentiates, the step sizes
    as functions of the state (``"differentiated"``), as constants (``"fixed"``), or the first only, as torchdiffeq
    (``"torchdiffeq"``). ``land_on_jumps``: a step that ends exactly on a ``jump_t`` is treated as one clipped there
    (the field re-read on its far side, the next jump taken up); torchdiffeq, and so the default, clips only a
    step that strictly contains it, and crosses every later jump after such a step. A complex state is stepped as
    its real and imaginary parts. Returns ``(len(t), *y0.shape)``."""
    tab = TABLEAUX[method]
    if y0.is_complex():
        func, y0, rtol, atol, options = RealParts.wrap(func, y0, rtol, atol, options)
        ys = odeint_fast(
            func,
            y0,
            t,
            method=method,
            rtol=rtol,
            atol=atol,
            options=options,
            graph=graph,
            steps=steps,
            land_on_jumps=land_on_jumps,
        )
        return torch.view_as_complex(ys)
    with nullcontext() if graph else torch.no_grad():
        if tab.adaptive:
            return _Adaptive(func, y0, t, tab, rtol, atol, dict(options), check_steps(steps), land_on_jumps).run()
        return _fixed(func, y0, t, tab, method, dict(options))


def _engine(
    func,
    y0: torch.Tensor,
    tab: MethodTableau,
    last: Sequence[Sequence[float]],
    rtol: Any,
    atol: Any,
    norm: Any = None,
) -> Buffered | Graph:
    # a recorder (solvers.gradients.replay) keeps the accepted states: they must not live in reused buffers; a norm of
    # the user's or per-element tolerances take the general engine
    fresh = torch.is_grad_enabled() or getattr(func, "recorder", None) is not None
    # the parts' largest RMS of a tuple state (StateNorm) runs in every engine; another norm of the user's, or
    # per-element tolerances, take the general one
    parts = norm.sizes if isinstance(norm, StateNorm) else None
    custom = norm is not None and not isinstance(norm, StateNorm)
    if fresh or custom or isinstance(rtol, torch.Tensor) or isinstance(atol, torch.Tensor):
        eng = Graph(y0, tab, last, rtol, atol, parts)
        eng.norm = norm if custom else None
        return eng
    # stage rows pay from a few hundred elements on (below, the fewer kernels of torchdiffeq's layout win)
    big = y0.device.type == "cpu" and tab.stages <= 7 and y0.numel() >= 256
    order = sum_order(y0.dtype, y0.numel()) if big else None
    if order is None:
        return Buffered(y0, tab, last, rtol, atol, parts)
    return StageMajor(y0, tab, last, rtol, atol, order, parts)


def _fixed(func, y0: torch.Tensor, t: torch.Tensor, tab: MethodTableau, method: str, options: dict) -> torch.Tensor:
    """torchdiffeq's fixed-grid loop: every step of the grid, the output times read off it (they lie on it)."""
    clock = _Clock(y0)
    construct = options.get("grid_constructor")
    grid = (t if construct is None else construct(func, y0, t)).tolist()
    tl = t.tolist()
    if grid[0] != tl[0] or grid[-1] != tl[-1]:
        raise AssertionError("the step grid must start and end on the output times")
    perturb = bool(options.get("perturb", False))
    interp = options.get("interp", "linear")
    if interp not in ("linear", "cubic"):
        raise ValueError(f"options['interp'] must be 'linear' or 'cubic', got {interp!r}.")
    cubic = interp == "cubic"
    first, last = (_NEXT, _PREV) if perturb else (_NONE, _NONE)
    c = tab.tableau.c
    s = len(c)
    # every evaluation time of the grid in one transfer: the loop itself reads nothing back from the device and
    # makes no tensor from host values (torchdiffeq's rk4 evaluates its last stage at t1, heun2 at t0 + dt: they
    # may differ by an ulp)
    values: list[Any] = []
    for t0, t1 in zip(grid[:-1], grid[1:]):
        values += _fixed_times(clock, method, c, t0, t1, first, last)
    times = clock.many(values, host=True)
    eng = _engine(func, y0, tab, (tab.tableau.b,), 0.0, 0.0)
    step_cb = _callback(func, "callback_step")
    out: list[torch.Tensor] = [y0]
    j, y = 1, y0
    for k, (t0, t1) in enumerate(zip(grid[:-1], grid[1:])):
        dt = t1 - t0
        step_cb(t0, y, dt)
        eng.set(0, func(times[k * s], y))
        eng.weights(dt)
        y1 = eng.run_stages(func, times[k * s + 1 : (k + 1) * s], fsal=False)
        while j < len(tl) and t1 >= tl[j]:
            if cubic:
                out.append(_hermite(func, clock, t0, t1, tl[j], y, y1, eng.get(0)))
            elif tl[j] == t1:
                out.append(eng.output(y1))
            else:  # torchdiffeq's linear interpolation off the grid
                out.append(y + (tl[j] - t0) / (t1 - t0) * (y1 - y))
            j += 1
        y = eng.accept(y1)
    return torch.stack(out)


def _fixed_times(clock: _Clock, method: str, c: Sequence[float], t0: float, t1: float, first: int, last: int):
    """The evaluation times of a fixed step's stages (in the state's dtype, on the host): ``t_0`` nudged by
    ``first``, ``t_0 + c_i h`` rounded from float64, a stage with ``c_i = 1`` at ``t_1`` nudged by ``last``
    (torchdiffeq's rk4 evaluates it at ``t_1``, the others at ``t_0 + h``: they may differ by an ulp)."""
    dt = t1 - t0
    return [clock.nudge(clock.y(t0), first)] + [
        clock.nudge(clock.y(t1 if method == "rk4" else t0 + dt * ci), last) if ci == 1.0 else clock.y(t0 + dt * ci)
        for ci in c[1:]
    ]


def stage_times(
    y0: torch.Tensor, tab: MethodTableau, t0: float, t1: float, h: float, adaptive: bool, perturb: bool
) -> Sequence[torch.Tensor]:
    """The times at which a step ``t0 → t1`` of size ``h`` evaluates its stages ``1 … s−1``, made as the solve
    made them (an adaptive step's in the state's dtype, a fixed step's from float64, ``perturb`` its option):
    a replay of the step evaluates the field where the solve did."""
    clock = _Clock(y0)
    if adaptive:
        return clock.adaptive_times(t0, clock.y(h), t1, tab.tableau.c)
    nudge = (_NEXT, _PREV) if perturb else (_NONE, _NONE)
    return clock.many(_fixed_times(clock, tab.name, tab.tableau.c, t0, t1, *nudge)[1:], host=True)


def _hermite(func, clock: _Clock, t0: float, t1: float, tj: float, y0, y1, f0) -> torch.Tensor:
    """torchdiffeq's ``interp="cubic"`` between grid points: the cubic Hermite interpolant of ``y_0, y_1`` with the
    slopes ``f_0`` (the step's first stage) and ``f_1 = F(t_1, y_1)`` (one more evaluation per output), with
    ``x = (t_j − t_0)/(t_1 − t_0)``: ``(1 + 2x)(1 − x)² y_0 + x(1 − x)² h f_0 + x²(3 − 2x) y_1 + x²(x − 1) h f_1``
    (Hairer, Nørsett & Wanner, "Solving ODEs I", §II.6)."""
    f1 = func(clock.at(t1), y1)
    x = (tj - t0) / (t1 - t0)
    h = t1 - t0

    def c(v: float) -> torch.Tensor:  # a float64 scalar, as torchdiffeq's time tensors multiply the state
        return torch.tensor(v, dtype=torch.float64, device=y0.device)

    return (
        c((1 + 2 * x) * (1 - x) * (1 - x)) * y0
        + c(x * (1 - x) * (1 - x) * h) * f0
        + c(x * x * (3 - 2 * x)) * y1
        + c(x * x * (x - 1) * h) * f1
    )


class _Adaptive:
    """torchdiffeq's adaptive Runge-Kutta loop (``RKAdaptiveStepsizeODESolver``), step for step.

    Between steps the position is ``t0`` with state ``y``; ``last`` is the accepted step an output time is read
    from (its stages stay in the engine until the next step starts)."""

    def __init__(
        self,
        func,
        y0: torch.Tensor,
        t: torch.Tensor,
        tab: MethodTableau,
        rtol: float,
        atol: float,
        options: dict,
        steps: str = "differentiated",
        land_on_jumps: bool = False,
    ):
        self.func, self.y0, self.t, self.tab = func, y0, t, tab
        self.land_on_jumps = land_on_jumps
        # per-element tolerances stay tensors (torchdiffeq's `rtol`/`atol` may be either)
        self.rtol = rtol if isinstance(rtol, torch.Tensor) else float(rtol)
        self.atol = atol if isinstance(atol, torch.Tensor) else float(atol)
        self.clock = _Clock(y0)
        self.min_step = float(options.get("min_step", 0.0))
        self.max_step = float(options.get("max_step", math.inf))
        self.rule: Controller = options.get("controller") or Integral.from_options(options)
        self.first_step = options.get("first_step")
        # under a graph: every next step size as a function of the state (solvers.gradients.step_sizes)
        self.steps = steps
        self.differentiated = steps == "differentiated" and torch.is_grad_enabled()
        # torchdiffeq's `norm`: a user's callable, or a tuple state's largest part RMS (StateNorm: also the RMS
        # of a tensor state, by default)
        self.norm = options.get("norm") or StateNorm()
        t0 = float(t[0])
        self.jumps = _times_from(options.get("jump_t"), t0)
        self.jump_index = min(bisect.bisect(self.jumps, t0), len(self.jumps) - 1)
        self.step_t = _times_from(options.get("step_t"), t0)  # times a step lands on (no re-read of the field)
        self.step_index = min(bisect.bisect(self.step_t, t0), len(self.step_t) - 1)
        self._fitted: tuple | None = None
        self._coeffs: list[torch.Tensor] = []
        self._extra_for: tuple | None = None  # the step whose dense stages are in self._extra
        self._extra: list[torch.Tensor] = []
        self.on_step = _callback(func, "callback_step")
        self.on_accept = _callback(func, "callback_accept_step")
        self.on_reject = _callback(func, "callback_reject_step")

    def _clamp(self, dt: Scalar) -> Scalar:
        if isinstance(dt, torch.Tensor):
            return dt.clamp(self.min_step, self.max_step)
        return dt if math.isnan(dt) else min(max(dt, self.min_step), self.max_step)

    def _next_step(self, dt: float, ratio: float) -> float:
        """The controller's next step (a NaN ratio gives a NaN step)."""
        return dt * self.rule.factor(ratio, self.tab.order)

    def _next_graph(
        self, eng: Buffered | Graph, y: torch.Tensor, Y: torch.Tensor, dt: Scalar, dtf: float, ratio: float
    ) -> Scalar:
        """The next step size (:meth:`_next_step`, clamped), carrying its derivative in the state through the step
        just attempted and its error ratio: the value is the float's, bit for bit."""
        pre = self._next_step(dtf, ratio)
        value = self._clamp(pre)
        if value != pre or not math.isfinite(value) or not isinstance(eng, Graph):
            return value
        factor = self.rule.factor_graph(ratio, lambda: eng.ratio_graph(y, Y), self.tab.order, ratio < 1)
        return attach(value, dt * factor)

    def _initial_step(self, t0: torch.Tensor, f0: torch.Tensor) -> Scalar:
        """Hairer, Nørsett & Wanner's initial step (§II.4) in the state's dtype; a tensor while it carries a graph
        (under ``backprop`` torchdiffeq differentiates through it)."""
        y0, dtype = self.y0, self.y0.dtype
        scale = self.atol + torch.abs(y0) * self.rtol
        d0, d1 = self.norm(y0 / scale).abs(), self.norm(f0 / scale).abs()
        h0 = torch.tensor(1e-6, dtype=dtype, device=y0.device) if d0 < 1e-5 or d1 < 1e-5 else 0.01 * d0 / d1
        h0 = h0.abs()
        y1 = y0 + h0 * f0  # before the time, as torchdiffeq: h0's gradient sums its parts in its order
        f1 = self.func(self.clock.at(t0 + h0), y1)
        d2 = torch.abs(self.norm((f1 - f0) / scale) / h0)
        if d1 <= 1e-15 and d2 <= 1e-15:
            h1 = torch.max(torch.tensor(1e-6, dtype=dtype, device=y0.device), h0 * 1e-3)
        else:
            h1 = (0.01 / (d2 if d2 > d1 else d1)) ** (1.0 / float(self.tab.order))
        h = torch.min(100 * h0, h1.abs()).to(torch.float64)
        return h if carries(h) and self.steps != "fixed" else float(h.detach())

    def _interpolate(self, eng: Buffered | Graph, last: tuple, tj: float) -> torch.Tensor:
        """The dense output of step ``last`` at ``tj``, ``x = (tj − t_0)/(t_1 − t_0)`` in float64 then the state's
        dtype, the quartic fitted once per step (torchdiffeq fits every accepted step; only these are read)."""
        t0, t1, h, y0, y1 = last
        if self.tab.dense is not None:
            return self._extension(eng, last, tj)
        if self._fitted is not last:
            self._coeffs, self._fitted = eng.dense(y0, y1, h), last
        if isinstance(t0, torch.Tensor) or isinstance(t1, torch.Tensor):
            num = tj - t0 if isinstance(t0, torch.Tensor) else torch.tensor(tj - t0, dtype=torch.float64)
            x: Scalar = (num / (t1 - t0)).to(self.y0.dtype)  # a tensor quotient, as torchdiffeq's
        else:
            x = self.clock.y((tj - t0) / (t1 - t0))
        return eng.evaluate(self._coeffs, x)

    def _extension(self, eng: Buffered | Graph, last: tuple, tj: float) -> torch.Tensor:
        """A method's own continuous extension (tsit5, dopri8): ``y_0 + Σ_i (h b_i(x)) k_i``, summed as the replays
        sum it (:mod:`solvers.gradients.replay`), so that their gradients are of the same function."""
        t0, t1, h, y0, _ = last
        weights: Sequence[Scalar]
        if isinstance(t0, torch.Tensor) or isinstance(t1, torch.Tensor):
            num = tj - t0 if isinstance(t0, torch.Tensor) else torch.tensor(tj - t0, dtype=torch.float64)
            x = num / (t1 - t0)
            powers = torch.stack([x ** (p + 1) for p in range(len(self.tab.dense))])  # type: ignore[arg-type]
            table = torch.tensor(self.tab.dense, dtype=torch.float64, device=x.device)
            # the weights of the solve without a graph, with the derivative of the polynomial in x
            values = dense_at(self.tab, float(x.detach()))
            weights = [attach(v, w) for v, w in zip(values, (powers @ table).unbind(0))]
        else:
            weights = dense_at(self.tab, (tj - t0) / (t1 - t0))
        ks = self._dense_stages(eng, last)
        out = y0
        for w, k in zip(weights, ks):
            if isinstance(w, torch.Tensor) or w != 0.0:
                out = out + (w * h) * k
        return out

    def _dense_stages(self, eng: Buffered | Graph, last: tuple) -> list[torch.Tensor]:
        """The slopes the extension weighs: the step's stages, then the extension's own (dopri8's), evaluated
        once for the step ``last`` at ``t_0 + c h``, ``y_0 + Σ_j (h a_j) k_j``, as the replays evaluate them."""
        ks = [eng.get(i) for i in range(self.tab.stages)]
        if not self.tab.dense_stages:
            return ks
        if self._extra_for is not last:
            t0, _, h, y0, _ = last
            recorder = getattr(self.func, "recorder", None)
            if recorder is not None:  # these evaluations are no step's (solvers.gradients.replay.Recorder)
                recorder.reading = True
            try:
                extra: list[torch.Tensor] = []
                for c, row in self.tab.dense_stages:
                    Y = y0
                    for a, k in zip(row, ks + extra):
                        if a != 0.0:
                            Y = Y + (a * h) * k
                    extra.append(self.func(self.clock.at(t0 + c * h), Y))
            finally:
                if recorder is not None:
                    recorder.reading = False
            self._extra, self._extra_for = extra, last
        return ks + self._extra

    def run(self) -> torch.Tensor:
        y0 = self.y0
        # the first output through its own node made first, as torchdiffeq's copy into its solution: y0's gradient
        # then sums its parts in torchdiffeq's order
        out: list[torch.Tensor] = [y0.view(y0.shape) if torch.is_grad_enabled() else y0]
        for tj, eng, last in self._march(self.t.tolist()[1:]):
            out.append(self._interpolate(eng, last, tj))
        return torch.stack(out)

    def until(self, stop: Callable[[float, torch.Tensor], bool]) -> tuple[Buffered | Graph, tuple]:
        """Step from ``t[0]`` until ``stop(t, y)`` holds at the end of an attempted step (accepted or not, as
        torchdiffeq's event search asks); returns the engine and the last accepted step ``(t_0, t_1, h, y_0,
        y_1)``, whose dense output :meth:`_interpolate` reads."""
        for _, eng, last in self._march([math.inf], stop):
            return eng, last
        raise AssertionError("unreachable: the march yields once")

    def _march(self, targets: Sequence[float], stop: Callable[[float, torch.Tensor], bool] | None = None):
        """The steps, yielding ``(t_j, engine, last accepted step)`` once the solve has passed each target
        ``t_j`` (with ``stop``: once ``stop`` holds)."""
        tab, clock, func = self.tab, self.clock, self.func
        s, c = tab.stages, tab.tableau.c
        y0 = self.y0
        t_first = self.t[0].to(torch.float64)
        f0 = func(clock.at(t_first), y0)
        dt: Scalar = self._initial_step(t_first, f0) if self.first_step is None else float(self.first_step)
        assert tab.error is not None
        # a non-FSAL step computes its end from b; either way the next step's first stage is this one's last
        rows = (tab.error,) if tab.fsal else (tab.tableau.b, tab.error)
        eng = _engine(func, y0, tab, rows, self.rtol, self.atol, self.norm)
        eng.set(0, f0)
        t0f = float(t_first)  # t0 on the host (t0 itself is a tensor while it carries a graph)
        t0: Scalar = t0f
        y = y0
        last: tuple | None = None
        pending: torch.Tensor | None = None  # stage 0 of the next step, stored once the last step's stages are read
        check_state = True
        for tj in targets:
            while tj > t0f if stop is None else not stop(t0f, y):
                if pending is not None:
                    eng.set(0, pending)
                    pending = None
                dt = self._clamp(dt if math.isfinite(_f(dt)) else self.min_step)
                self.on_step(t0, y, dt)
                if check_state:
                    if not bool(torch.isfinite(y).all()):
                        raise AssertionError("non-finite values in state `y`")
                    check_state = False
                dtf = _f(dt)
                if not t0f + dtf > t0f:
                    raise AssertionError(f"underflow in dt {dtf}")
                t1: Scalar = t0 + dt
                t1f = t0f + dtf
                on_step = on_jump = False
                if self.step_t:
                    st = self.step_t[self.step_index]
                    if t0f < st < t1f:
                        on_step, t1, dt, t1f, dtf = True, st, st - t0, st, st - t0f
                if self.jumps:
                    jt = self.jumps[self.jump_index]
                    if t0f < jt < t1f or (self.land_on_jumps and jt == t1f):
                        on_step, on_jump, t1, dt, t1f, dtf = False, True, jt, jt - t0, jt, jt - t0f
                hy = eng.weights(dt)
                Y = eng.run_stages(func, clock.adaptive_times(t0, hy, t1, c), fsal=tab.fsal)
                ratio, finite = eng.ratio(Y)
                # the next step from this one's stages, before an accepted step moves the engine on
                nxt = self._next_graph(eng, y, Y, dt, dtf, ratio) if self.differentiated else None
                if (ratio <= 1 and not dtf > self.max_step) or dtf <= self.min_step:
                    self.on_accept(t0, y, dt)
                    check_state = not finite
                    last = (t0, t1, dt, y, Y)
                    if on_step and self.step_index != len(self.step_t) - 1:
                        self.step_index += 1
                    if on_jump:
                        if self.jump_index != len(self.jumps) - 1:
                            self.jump_index += 1
                        pending = func(clock.at(t1, _NEXT), Y)  # the field on the jump's far side
                    else:
                        pending = eng.get(s - 1)
                    t0, t0f, y = t1, t1f, eng.accept(Y)
                else:
                    self.on_reject(t0, y, dt)
                dt = self._clamp(self._next_step(dtf, ratio)) if nxt is None else nxt
            assert last is not None
            yield tj, eng, last
