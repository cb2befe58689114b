r"""One explicit Runge-Kutta step as one compiled graph, the user's field inside (opt-in: ``compile=True``).

On small problems an eager solver spends its time in Python and per-operation overhead, not arithmetic: every
step is ``s`` field calls of a few small kernels each, ``s`` stage combinations, the error norm and the
controller, each a separate eager operation. Here one step

    ``Y_i = y_0 + h Σ_{j<i} a_ij k_j``,  ``k_i = F(t_0 + c_i h, Y_i)``,  ``y_1 = y_0 + h Σ_i b_i k_i``,
    ``r = ‖h Σ_i e_i k_i / (atol + rtol max(|y_0|, |y_1|))‖_RMS``,
    ``h' = clamp(h · min(ifactor, max(safety · r^(−1/p), low)), min_step, max_step)``

(Butcher 2016, "Numerical methods for ordinary differential equations", §23; the controller of Hairer, Nørsett &
Wanner, "Solving Ordinary Differential Equations I", §II.4, eq. 4.13, ``low = 1`` after an accepted step and
``dfactor`` after a rejected one) is traced by ``torch.compile`` into one graph, so that inductor fuses the field's
elementwise work with the stage combinations and the norm. ``t_0`` and ``h`` enter as 0-d float64 tensors (a Python
float would be specialised on: a recompile per step) and the controller runs in float64, so the step sequence is
the eager stepper's (:mod:`solvers.steppers.fast_rk`) to rounding. The host reads one small vector per step (the
error ratio, the finiteness of ``y_1`` and ``h'``) to decide acceptance and the end; a fixed-step grid reads
nothing. Outputs come from the method's dense output (tsit5's own extension; the quartic through the midpoint of
dopri5 and bosh3, the cubic Hermite one of the others), evaluated only for steps that hold an output time: for a
small state eagerly, as one product over all the output times a step holds; for a larger one compiled.

Gradients: backpropagation through the compiled steps (AOTAutograd traces each step's backward), or the
checkpointed replay (each step's inputs kept by a forward solve without a graph, each step replayed backwards
through the same compiled graph), the step sizes differentiated as the eager stepper differentiates them
(:mod:`solvers.gradients.step_sizes`: through the error ratio and the controller, or held fixed, or torchdiffeq's
first only). The compiled functions are cached per
(field, method, dtype, device, shapes, tolerances, controller constants), each with a code object of its own, so
that a second solve with the same shapes reuses the graphs and distinct fields do not share dynamo's recompile
limit. Shapes are static (``dynamic=False``): a training loop has one shape, and a static graph is the faster
one; a new batch size compiles once more (up to dynamo's recompile limit per field).
"""

from __future__ import annotations

import math
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..controllers import Controller, Integral
from ..gradients.second_order import first_order, remember_inputs
from ..norms import StateNorm
from .fast_rk import _Adaptive, _dense_weights
from .tableaux import TABLEAUX, MethodTableau

__all__ = ["BACKEND", "COMPILED_METHODS", "check_compiled", "odeint_compiled"]

#: the methods the compiled step serves: every registered explicit Runge-Kutta tableau of continuous mode whose
#: dense output needs no extra stages (dopri8's does)
COMPILED_METHODS = tuple(name for name, tab in TABLEAUX.items() if tab.continuous and not tab.dense_stages)
#: torch.compile's backend: inductor; the tests run the same graphs on "aot_eager" (AOTAutograd without code
#: generation), whose compiles take a fraction of the time
BACKEND = "inductor"
_OPTIONS = {"first_step", "max_step", "min_step", "safety", "ifactor", "dfactor", "controller", "norm"}
_FIXED_OPTIONS = {"grid_constructor", "perturb"}
_DTYPES = (torch.float32, torch.float64)
#: states of at most this many elements take their outputs eagerly, as one product ``y_0 + W K`` per step (a
#: compiled call costs dynamo ~50-80 µs on the CPU, more than the product of a small state); larger ones through
#: the compiled dense output, which reads the stages once without stacking them (measured: equal at ~2 000
#: elements for one output, the product 2.7x slower at 262 144)
_DENSE_PRODUCT_MAX = 8192


def check_compiled(method: str, gradient: Any = None, controller: Any = "batch") -> None:
    """Refuse, naming the fix, what the compiled step does not serve: ``method`` outside
    :data:`COMPILED_METHODS`, a gradient method other than backprop and checkpoint (without a budget), a per-sample
    controller or one other than the integral rule."""
    if method not in COMPILED_METHODS:
        raise ValueError(
            f"compile=True compiles the steps of the explicit Runge-Kutta methods {list(COMPILED_METHODS)}, not "
            f"method={method!r} (implicit, composition, reversible and dopri8's extra-stage dense output are not "
            "served): drop compile, or use one of those methods."
        )
    name = getattr(gradient, "name", gradient)
    if gradient is not None and (name not in ("backprop", "checkpoint") or getattr(gradient, "budget", None)):
        what = f"gradient={name!r}" if name not in ("backprop", "checkpoint") else f"gradient={gradient!r}"
        raise ValueError(
            f"compile=True differentiates the compiled steps by backprop (AOTAutograd) or by replaying them from "
            f"every step's state (checkpoint, no budget); {what} is not served: use gradient='backprop' or "
            "'checkpoint', or drop compile."
        )
    _check_controller(controller)


def _check_controller(controller: Any) -> None:
    integral = type(controller) is Integral if isinstance(controller, Controller) else controller == "batch"
    if not integral:
        raise ValueError(
            f"compile=True runs the shared-step integral controller; controller={controller!r} is not served: use "
            "controller='batch' (or Integral(...)), or drop compile."
        )


def _check_problem(y0: torch.Tensor, options: dict, rtol: Any, atol: Any, adaptive: bool) -> None:
    if y0.dtype not in _DTYPES:
        raise ValueError(f"compile=True steps float32/float64 states; `y0` is {y0.dtype}: cast it, or drop compile.")
    allowed = _OPTIONS if adaptive else _FIXED_OPTIONS
    extra = sorted(set(options) - allowed)
    if extra:
        raise ValueError(
            f"compile=True does not serve the option(s) {extra} (jump and step times, cubic "
            "interpolation and a user's norm stay on the eager stepper): drop them, or drop compile."
        )
    norm = options.get("norm")
    if norm is not None and not isinstance(norm, StateNorm):
        raise ValueError("compile=True measures the error by the RMS norm; drop options['norm'], or drop compile.")
    if isinstance(rtol, torch.Tensor) and rtol.numel() != 1 or isinstance(atol, torch.Tensor) and atol.numel() != 1:
        raise ValueError("compile=True takes scalar `rtol`/`atol`: pass floats, or drop compile.")
    controller = options.get("controller")
    if controller is not None:
        _check_controller(controller)


@dataclass
class _Graphs:
    """The compiled step and dense output of one (field, method, dtype, ...)."""

    step: Callable[..., Any]
    dense: Callable[..., Any] | None
    #: the dense output's weights ``P`` (float64, ``(degree, s)``) where the outputs are evaluated eagerly as one
    #: product (a small state); None: one compiled ``dense`` call per output
    weights: torch.Tensor | None = None


# field -> key -> graphs; weak in the field, so that a discarded model frees its graphs
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, _Graphs]] = weakref.WeakKeyDictionary()


def _fresh(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own: dynamo keeps its graphs (and counts its recompile limit) per code
    object, so each cached entry must have one."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


#: inductor settings for our graphs only (``torch.compile``'s ``options`` patch inductor's config while it compiles
#: them, not the user's). On the CPU inductor writes ``tanh`` as Sleef's vectorised ``tanhf16_u10`` (AVX-512 here),
#: an algorithm of two divisions in double-float arithmetic measured at ~3 ns an element, 6x the MKL ``tanh`` that
#: eager layers call; ``2 / (1 + exp(-2x)) - 1`` over Sleef's ``exp`` takes under half of that. Its largest
#: difference from ATen's ``tanh`` over [-20, 20] is 1.8e-7 in float32 (Sleef's is the same) and 3.3e-16 in float64
#: (Sleef's 1.1e-16): absolute, a few units in the last place of 1, not relative near 0.
INDUCTOR_OPTIONS: dict[str, Any] = {"cpp.use_decompose_tanh": True}


def _compile(fn: Any) -> Callable[..., Any]:
    options = INDUCTOR_OPTIONS if BACKEND == "inductor" else None
    return torch.compile(_fresh(fn), backend=BACKEND, dynamic=False, options=options)


def _rms(q: torch.Tensor, parts: Sequence[int] | None) -> torch.Tensor:
    if parts is None:
        return q.mean().sqrt()
    return torch.stack([p.mean().sqrt() for p in q.reshape(-1).split(list(parts))]).amax()


def _make_step(
    tab: MethodTableau,
    rtol: float,
    atol: float,
    rule: Controller,
    min_step: float,
    max_step: float,
    parts: Sequence[int] | None,
) -> Callable[..., Any]:
    """The traced step ``(F, t_0, h, y_0, k_1) -> (y_1, t_1, h', control, k_1 … k_s)``; ``control`` holds the
    error ratio, whether ``y_1`` is finite and ``h'`` (float64), read by the host in one transfer."""
    a, b, c, e = tab.tableau.a, tab.tableau.b, tab.tableau.c, tab.error
    s, order, fsal = tab.stages, float(tab.order), tab.fsal
    safety, ifactor, dfactor = rule.safety, rule.ifactor, rule.dfactor

    def step(field: Any, t0: torch.Tensor, h: torch.Tensor, y: torch.Tensor, k0: torch.Tensor):
        dtype = y.dtype
        hy, t0y = h.to(dtype), t0.to(dtype)
        t1 = t0 + h
        t1y = t1.to(dtype)
        # torchdiffeq evaluates a stage with c = 1 just before t_1, so that a step ending on a jump never sees the
        # next piece; the nudge is a constant (its derivative is t_1's)
        t1_below = t1y + (torch.nextafter(t1y, torch.full_like(t1y, -math.inf)) - t1y).detach()
        ks = [k0]
        Y = y
        for i in range(1, s):
            Y = y
            for aij, kj in zip(a[i], ks):
                if aij != 0.0:
                    Y = Y + (aij * hy) * kj
            ti = t1_below if c[i] == 1.0 else t0y + c[i] * hy
            ks.append(field(ti, Y))
        if fsal:
            y1 = Y
        else:
            y1 = y
            for bi, ki in zip(b, ks):
                if bi != 0.0:
                    y1 = y1 + (bi * hy) * ki
        assert e is not None
        err = None
        for ei, ki in zip(e, ks):
            if ei != 0.0:
                term = (ei * hy) * ki
                err = term if err is None else err + term
        assert err is not None
        tol = torch.maximum(y.abs(), y1.abs()) * rtol + atol
        ratio = _rms((err / tol).pow(2), parts).to(torch.float64)
        positive = ratio > 0
        raw = safety * torch.where(positive, ratio, torch.ones_like(ratio)) ** (-1.0 / order)
        low = torch.where(ratio < 1, torch.ones_like(ratio), torch.full_like(ratio, dfactor))
        factor = torch.minimum(torch.maximum(raw, low), torch.full_like(ratio, ifactor))
        factor = torch.where(positive | ratio.isnan(), factor, torch.full_like(ratio, ifactor))
        h_next = (h * factor).clamp(min_step, max_step)
        finite = torch.isfinite(y1).all().to(torch.float64)
        control = torch.stack([ratio.detach(), finite, h_next.detach()])
        return (y1, t1, h_next, control, *ks)

    return step


def _make_fixed_step(tab: MethodTableau, method: str, perturb: bool) -> Callable[..., Any]:
    """The traced fixed step ``(F, t_0, h, y_0) -> y_1`` at torchdiffeq's evaluation times (rk4's last stage at
    ``t_1``; with ``perturb``, the first stage just after ``t_0`` and every stage with ``c = 1`` just before
    ``t_1``, so that a step on a parameter jump's grid reads the piece it lies in)."""
    a, b, c = tab.tableau.a, tab.tableau.b, tab.tableau.c
    s = tab.stages

    def nudge(x: torch.Tensor, towards: float) -> torch.Tensor:
        return torch.nextafter(x, torch.full_like(x, towards)) if perturb else x

    def step(field: Any, t0: torch.Tensor, h: torch.Tensor, y: torch.Tensor):
        dtype = y.dtype
        hy = h.to(dtype)
        ks = [field(nudge(t0.to(dtype), math.inf), y)]
        for i in range(1, s):
            Y = y
            for aij, kj in zip(a[i], ks):
                if aij != 0.0:
                    Y = Y + (aij * hy) * kj
            if c[i] == 1.0:
                ti = nudge(((t0 + h) if method == "rk4" else t0 + c[i] * h).to(dtype), -math.inf)
            else:
                ti = (t0 + c[i] * h).to(dtype)
            ks.append(field(ti, Y))
        y1 = y
        for bi, ki in zip(b, ks):
            if bi != 0.0:
                y1 = y1 + (bi * hy) * ki
        return y1

    return step


def _make_dense(tab: MethodTableau) -> Callable[..., Any]:
    """The traced dense output ``(t_j, t_0, t_1, h, y_0, *k) -> y(t_j) = y_0 + h Σ_i β_i(x) k_i``,
    ``x = (t_j − t_0)/(t_1 − t_0)``, ``β_i(x) = Σ_p P_pi x^(p+1)``: tsit5's continuous extension, the others' quartic
    through the midpoint written over the stages (:func:`solvers.steppers.fast_rk._dense_weights`)."""
    P = _dense_weights(tab)

    def dense(tj: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor, h: torch.Tensor, y0: torch.Tensor, *ks):
        x = (tj - t0) / (t1 - t0)
        powers = [x]
        for _ in range(1, len(P)):
            powers.append(powers[-1] * x)
        out = y0
        for i, k in enumerate(ks):
            beta = None
            for p, row in enumerate(P):
                if row[i] != 0.0:
                    term = row[i] * powers[p]
                    beta = term if beta is None else beta + term
            if beta is not None:
                out = out + (beta * h).to(y0.dtype) * k
        return out

    return dense


def _graphs(key_object: Any, key: tuple, make: Callable[[], _Graphs]) -> _Graphs:
    try:
        entries = _CACHE.setdefault(key_object, {})
    except TypeError:  # an object without weak references: compiled per call
        return make()
    graphs = entries.get(key)
    if graphs is None:
        graphs = entries[key] = make()
    return graphs


def _ratio_parts(options: dict) -> tuple[int, ...] | None:
    norm = options.get("norm")
    return None if norm is None or norm.sizes is None else tuple(norm.sizes)


def _traced(func: Any) -> tuple[Any, Any]:
    """What the step traces, and what its graphs are cached under: ``ODEBlock``'s counting wrapper is left out
    (its counts and hooks are the eager stepper's; the step counts here) and the block's bound field traced, cached
    under the block's field; ``cde_nets.odeint``'s flat problem is traced as it is, cached under the user's
    ``func``. The per-call object is an argument of the compiled function: dynamo guards on its attributes (the
    same module, shapes and sign: no recompile), not on its identity."""
    from ..counting import Counted

    fn = func.field if isinstance(func, Counted) else func
    key = getattr(fn, "field", None) if isinstance(func, Counted) else getattr(fn, "func", None)
    return fn, fn if key is None else key


def odeint_compiled(
    func: Any,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str,
    rtol: Any,
    atol: Any,
    options: dict,
    steps: str = "differentiated",
    checkpoint: bool = False,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """The states at ``t`` (increasing, float64, no graph), ``(len(t), *y0.shape)``, each step one compiled call.

    ``func``: the wrapper the eager stepper calls (its callbacks count the steps and enforce the step budget; the
    first evaluation and the initial step's second run through it eagerly). ``steps``: how the gradient
    differentiates the step sizes (:mod:`solvers.gradients.step_sizes`). ``checkpoint``: solve without a graph,
    keeping each attempted step's inputs, and differentiate by replaying each step's compiled graph backwards
    (Zhuang et al. 2020, "Adaptive checkpoint adjoint method"): the gradients of backprop, with respect to ``y0``
    and ``params``, at the memory of one state per step."""
    tab = TABLEAUX[method]
    options = {k: v for k, v in options.items() if k != "compile"}
    _check_problem(y0, options, rtol, atol, tab.adaptive)
    fn, key_object = _traced(func)
    stats = getattr(func, "stats", None)
    on_step = getattr(func, "callback_step", None) or (lambda *a: None)
    rtol_f, atol_f = float(rtol), float(atol)
    base = (method, y0.dtype, y0.device, tuple(y0.shape))
    if not tab.adaptive:
        perturb = bool(options.get("perturb", False))
        graphs = _graphs(
            key_object, (*base, perturb), lambda: _Graphs(_compile(_make_fixed_step(tab, method, perturb)), None)
        )
        construct = options.get("grid_constructor")
        grid = (t if construct is None else construct(func, y0, t)).to(torch.float64)
        if checkpoint:
            args = (graphs, fn, stats, on_step, grid, y0, t, tab)
            replay = _Replay(graphs, fn, stats, tab, params, lambda tape: _fixed(*args, tape=tape), None)
            return _Checkpointed.apply(replay, y0, *params)
        return _fixed(graphs, fn, stats, on_step, grid, y0, t, tab)
    rule = options.get("controller") or Integral.from_options(options)
    min_step, max_step = float(options.get("min_step", 0.0)), float(options.get("max_step", math.inf))
    parts = _ratio_parts(options)
    key = (*base, rtol_f, atol_f, rule.safety, rule.ifactor, rule.dfactor, min_step, max_step, parts)

    def make() -> _Graphs:
        step = _make_step(tab, rtol_f, atol_f, rule, min_step, max_step, parts)
        weights = None
        if y0.numel() <= _DENSE_PRODUCT_MAX:
            weights = torch.tensor(_dense_weights(tab), dtype=torch.float64, device=y0.device)
        return _Graphs(_compile(step), _compile(_make_dense(tab)), weights)

    graphs = _graphs(key_object, key, make)
    eager = _Adaptive(func, y0, t, tab, rtol_f, atol_f, {**options, "controller": rule}, steps)
    if checkpoint:
        run = (graphs, eager, fn, func, stats, y0, t, tab, steps, min_step, max_step)
        replay = _Replay(graphs, fn, stats, tab, params, lambda tape: _adaptive(*run, tape=tape), (eager, t, steps))
        return _Checkpointed.apply(replay, y0, *params)
    return _adaptive(graphs, eager, fn, func, stats, y0, t, tab, steps, min_step, max_step)


def _fixed(graphs: _Graphs, fn, stats, on_step, grid: torch.Tensor, y0, t, tab, tape=None) -> torch.Tensor:
    gl, tl = grid.tolist(), t.tolist()
    if gl[0] != tl[0] or gl[-1] != tl[-1]:
        raise AssertionError("the step grid must start and end on the output times")
    starts, sizes = grid[:-1].unbind(), grid.diff().unbind()
    out, j, y = [y0], 1, y0
    for k in range(len(gl) - 1):
        t0, t1 = gl[k], gl[k + 1]
        on_step(t0, y, t1 - t0)
        y1 = graphs.step(fn, starts[k], sizes[k], y)
        if stats is not None:
            stats.nfe_forward += tab.stages
        reads: list[tuple[int, float | None]] = []
        while j < len(tl) and t1 >= tl[j]:
            x = None if tl[j] == t1 else (tl[j] - t0) / (t1 - t0)
            out.append(y1 if x is None else y + x * (y1 - y))
            reads.append((j, x))
            j += 1
        if tape is not None:
            tape.append((starts[k], sizes[k], y, reads))
        y = y1
    return torch.stack(out)


def _adaptive(
    graphs: _Graphs, eager: _Adaptive, fn, func, stats, y0, t, tab, steps, min_step, max_step, tape=None
) -> torch.Tensor:
    on_step = getattr(func, "callback_step", None) or (lambda *a: None)
    on_accept = getattr(func, "callback_accept_step", None) or (lambda *a: None)
    on_reject = getattr(func, "callback_reject_step", None) or (lambda *a: None)
    differentiated = steps == "differentiated" and torch.is_grad_enabled()
    t_first = t[0].to(torch.float64)
    f0 = func(eager.clock.at(t_first), y0)
    first = eager.first_step
    h0 = eager._initial_step(t_first, f0) if first is None else float(first)
    h = h0 if isinstance(h0, torch.Tensor) else torch.tensor(h0, dtype=torch.float64, device=y0.device)
    h = h.clamp(min_step, max_step)
    hf = float(h.detach())
    if h.requires_grad:  # every step's t_0 then carries a graph: one compiled graph, not one for the first step
        t_first = t_first + 0 * h
    if not torch.is_grad_enabled():  # nor one for a first state that requires grad under no_grad
        y0, f0 = y0.detach(), f0.detach()
    t0, t0f, y, k0 = t_first, float(t_first.detach()), y0, f0
    if not bool(torch.isfinite(y0).all()):
        raise AssertionError("non-finite values in state `y`")
    last: tuple | None = None
    out = [y0.view(y0.shape) if torch.is_grad_enabled() else y0]
    targets = t.unbind()
    held: list[int] = []  # the output times the last accepted step holds, evaluated together once it is passed
    for j, tj in enumerate(t.tolist()[1:], start=1):
        if held and tj > t0f:
            assert last is not None
            out.extend(_dense_at(graphs, t, targets, held, last))
            held = []
        while tj > t0f:
            on_step(t0f, y, hf)
            if not t0f + hf > t0f:
                raise AssertionError(f"underflow in dt {hf}")
            if tape is not None:  # each attempt's inputs, whether it was accepted, the outputs read off it
                tape.append([t0, h, y, k0, False, []])
            y1, t1, h_next, control, *ks = graphs.step(fn, t0, h, y, k0)
            if stats is not None:
                stats.nfe_forward += tab.stages - 1
            ratio, finite, h_next_f = control.tolist()
            if (ratio <= 1 and not hf > max_step) or hf <= min_step:
                on_accept(t0f, y, hf)
                if not finite:
                    raise AssertionError("non-finite values in state `y`")
                last = (t0, t1, h, y, ks)
                if tape is not None:
                    tape[-1][4], last_record = True, tape[-1]
                t0, t0f, y, k0 = t1, t0f + hf, y1, ks[-1]
            else:
                on_reject(t0f, y, hf)
            if not math.isfinite(h_next_f):  # a NaN error: the eager stepper falls back to min_step, then fails
                h_next, h_next_f = torch.tensor(min_step, dtype=torch.float64, device=y0.device), min_step
            h, hf = (h_next if differentiated else h_next.detach()), h_next_f
        assert last is not None
        held.append(j)
        if tape is not None:
            last_record[5].append(j)
    assert last is not None
    out.extend(_dense_at(graphs, t, targets, held, last))
    return torch.stack(out)


def _dense_at(graphs: _Graphs, t: torch.Tensor, targets: Sequence[torch.Tensor], js: list[int], last: tuple) -> list:
    """The dense output of the step ``last = (t_0, t_1, h, y_0, (k_1 … k_s))`` at the times ``t[js]`` (consecutive):
    a small state's as one product ``y_0 + W K``, ``W_ji = h β_i(x_j)``, the stages ``K`` stacked (a few eager
    operations for all of them, where a compiled call per time pays dynamo's fixed cost each); a larger one's by a
    compiled call per time."""
    s0, s1, hs, ys, kss = last
    if graphs.weights is None:
        assert graphs.dense is not None
        return [graphs.dense(targets[j], s0, s1, hs, ys, *kss) for j in js]
    x = (t[js[0] : js[-1] + 1].to(torch.float64) - s0) / (s1 - s0)
    degree = graphs.weights.shape[0]
    powers = x.unsqueeze(-1).pow(torch.arange(1, degree + 1, dtype=torch.float64, device=x.device))
    w = ((powers @ graphs.weights) * hs).to(ys.dtype)
    k = torch.stack(kss).reshape(len(kss), -1)
    return list(torch.addmm(ys.reshape(1, -1), w, k).reshape(len(js), *ys.shape).unbind())


def _add(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
    return y if x is None else (x if y is None else x + y)


class _Replay:
    """A checkpointed compiled solve: the forward without a graph records each step's inputs (the tape); the
    backward replays the steps last to first, each through its compiled graph with autograd on, and pulls the
    cotangents of the loop's state ``(t, h, y, k_1)`` back through it, with those of the outputs read off it."""

    def __init__(self, graphs: _Graphs, fn, stats, tab: MethodTableau, params, solve, adaptive):
        self.graphs, self.fn, self.stats, self.tab = graphs, fn, stats, tab
        self.params = [p for p in params]
        self.solve, self.adaptive = solve, adaptive
        self.tape: list = []

    def forward(self) -> torch.Tensor:
        ys = self.solve(self.tape)
        if self.stats is not None:  # a rejected attempt keeps the state of the step it retries: no new state
            self.stats.stored_states = max(self.stats.stored_states, sum(1 for r in self.tape if self._accepted(r)))
        return ys

    def _accepted(self, record: Any) -> bool:
        return self.adaptive is None or bool(record[4])

    def _grad(self, outs: list, cots: list, inputs: list) -> list:
        if not outs:
            return [None] * len(inputs)
        return list(torch.autograd.grad(outs, inputs, cots, allow_unused=True))

    def backward(self, g: torch.Tensor) -> list:
        n = len(self.tape)
        if self.stats is not None:
            accepted = sum(1 for r in self.tape if self._accepted(r))
            self.stats.nfe_backward += n * (self.tab.stages - (1 if self.adaptive else 0))
            self.stats.steps_backward += accepted
            self.stats.rejected_backward += n - accepted
        if self.adaptive is None:
            a_y, pg = self._fixed_back(g)
        else:
            a_y, pg = self._adaptive_back(g)
        self.tape = []
        return [_add(g[0], a_y), *pg]

    def _fixed_back(self, g: torch.Tensor) -> tuple:
        a_y: torch.Tensor | None = None
        pg: list = [None] * len(self.params)
        for t0, h, y, reads in reversed(self.tape):
            yr = y.detach().requires_grad_()
            with torch.enable_grad():
                y1 = self.graphs.step(self.fn, t0, h, yr)
                outs, cots = ([y1], [a_y]) if a_y is not None else ([], [])
                for j, x in reads:
                    outs.append(y1 if x is None else yr + x * (y1 - yr))
                    cots.append(g[j])
                got = self._grad(outs, cots, [yr, *self.params])
            a_y, pg = got[0], [_add(p, q) for p, q in zip(pg, got[1:])]
        return a_y, pg

    def _adaptive_back(self, g: torch.Tensor) -> tuple:
        eager, t, steps = self.adaptive
        graphs, params = self.graphs, self.params
        differentiated = steps == "differentiated"
        targets = t.unbind()
        a: list[torch.Tensor | None] = [None] * 4  # cotangents of t, h, y, k_1 after the step
        pg: list = [None] * len(params)
        for t0, h, y, k0, accepted, reads in reversed(self.tape):
            ins = [x.detach().requires_grad_() for x in (t0, h, y, k0)]
            with torch.enable_grad():
                y1, t1, h_next, _, *ks = graphs.step(self.fn, *ins)
                outs, cots = [], []
                nexts = [(h_next, a[1] if differentiated else None)]
                if accepted:
                    nexts += [(t1, a[0]), (y1, a[2]), (ks[-1], a[3])]
                for o, c in nexts:
                    if c is not None:
                        outs.append(o)
                        cots.append(c)
                for j in reads:
                    outs.extend(_dense_at(graphs, t, targets, [j], (ins[0], t1, ins[1], ins[2], ks)))
                    cots.append(g[j])
                got = self._grad(outs, cots, [*ins, *params])
            carried = [None] * 4 if accepted else [a[0], None, a[2], a[3]]
            a = [_add(c, q) for c, q in zip(carried, got[:4])]
            pg = [_add(p, q) for p, q in zip(pg, got[4:])]
        # the first slope and the initial step (Hairer, Nørsett & Wanner's, §II.4), as the forward made them
        y0 = eager.y0.detach().requires_grad_()
        t_first = t[0].to(torch.float64)
        with torch.enable_grad():
            f0 = self.fn(eager.clock.at(t_first), y0)
            outs, cots = ([f0], [a[3]]) if a[3] is not None else ([], [])
            if a[1] is not None and steps != "fixed" and eager.first_step is None:
                eager.y0 = y0
                h0 = eager._initial_step(t_first, f0)
                if isinstance(h0, torch.Tensor):
                    outs.append(h0.clamp(eager.min_step, eager.max_step))
                    cots.append(a[1])
            got = self._grad(outs, cots, [y0, *params])
        return _add(a[2], got[0]), [_add(p, q) for p, q in zip(pg, got[1:])]


class _Checkpointed(torch.autograd.Function):
    """The checkpointed compiled solve as one autograd node of ``y0`` and the parameters."""

    @staticmethod
    def forward(ctx: Any, replay: _Replay, y0: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        remember_inputs(ctx, y0, *params)
        ctx.replay = replay
        return replay.forward()

    @staticmethod
    @first_order("checkpoint")
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return (None, *ctx.replay.backward(g))
