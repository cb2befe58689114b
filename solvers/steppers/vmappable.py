r"""The adaptive explicit Runge-Kutta loop as tensor operations only, so that ``torch.vmap`` (and the other
``torch.func`` transforms stacked on it) can run it: each vmapped instance is solved on its own step sequence, as
if it were solved alone.

:mod:`solvers.steppers.fast_rk` controls the step on the host (Python floats, one read per step), which ``vmap``
refuses as data-dependent control flow. Here every decision is a tensor: the clock ``t_0``, the step ``h`` and the
controller's choices are per instance (0-d tensors that ``vmap`` batches), a step is accepted by ``torch.where``
(Hairer, Nørsett & Wanner, "Solving Ordinary Differential Equations I", §II.4: accepted when the error ratio
``r = ‖h Σ e_i k_i / (atol + rtol max(|y_0|, |y_1|))‖_RMS ≤ 1``, the next step ``h · min(ifactor, max(φ(r), low))``
with the controller's proposal ``φ``, ``low = 1`` after an accepted step, ``dfactor`` after a rejection), and an
instance that has reached the output time rides along frozen. The one question asked of the host, whether any
instance still runs, is read on the tensor beneath every ``functorch`` wrapper (:func:`host_any`): the loop's
length is the longest instance's, every instance's values are its own. This is the per-sample controller's
semantics (:mod:`solvers.per_sample`), with torchdiffeq's rule and initial step (Hairer, Nørsett & Wanner's
algorithm, §II.4) as the shared step takes them, so an instance's steps are those of its own single solve.

With ``rows=1`` the same loop takes a batch whose rows each keep their own clock (the error norm per row, the field
called with ``t`` of shape ``(batch,)``): the hand-stacked ensemble the benchmarks compare ``vmap`` against.

The outputs are the step's dense output (:func:`solvers.steppers.fast_rk._dense_weights`: the method's own
continuous extension, or the quartic through its midpoint), read from each instance's last accepted step once it
has passed the output time. Under ``backprop`` autograd differentiates the whole loop, the step sizes included
(every branch a ``torch.where`` whose unused side is kept finite).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import transforms
from ..controllers import Controller, Integral
from ..counting import Counted
from ..errors import Reason, SolverError
from ..norms import StateNorm, safe_sqrt
from ..precision import check_autocast_region
from ..transforms import VmapLevel, host_any, innermost_vmap, physical, tracked
from .fast_rk import _dense_weights
from .methods import ADAPTIVE_METHODS, FIXED_METHODS
from .stacked_linear import stacked_linears
from .tableaux import TABLEAUX

__all__ = ["VMAP_OPTIONS", "odeint_vmappable", "solve_vmapped", "vmap_methods", "vmap_options"]

# the options the tensor loop implements (jump_t and step_t need per-instance clipping: not served)
VMAP_OPTIONS = frozenset(
    {"first_step", "min_step", "max_step", "safety", "ifactor", "dfactor", "controller", "norm", "compile"}
)


def vmap_methods() -> list[str]:
    """The adaptive explicit Runge-Kutta methods the loop serves: every registered tableau with an error
    estimate (read live, as the other method tables)."""
    return [name for name in ADAPTIVE_METHODS if name in TABLEAUX]


def _rms_rows(rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if rows == 0:
        return StateNorm()
    return lambda x: safe_sqrt(x.abs().pow(2).flatten(1).mean(1))


def _largest_part(sizes: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """:class:`~solvers.norms.StateNorm` of a tuple state (the largest part's RMS) without Python's ``max``."""

    def norm(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([safe_sqrt(part.abs().pow(2).mean()) for part in x.reshape(-1).split(sizes)]).amax()

    return norm


class _Loop:
    """One solve's constants and its per-instance state (a clock ``t0``, a step ``dt``, the state ``y``, the first
    stage ``k0`` and the last accepted step, all tensors)."""

    def __init__(self, func, y0: torch.Tensor, tab, rtol, atol, options: Mapping[str, Any], rows: int, steps: str):
        self.func, self.tab, self.rows, self.steps = func, tab, rows, steps
        self.dtype = y0.dtype
        self.rtol, self.atol = rtol, atol
        self.min_step = float(options.get("min_step", 0.0))
        self.max_step = float(options.get("max_step", math.inf))
        self.rule: Controller = options.get("controller") or Integral.from_options(options)
        norm = options.get("norm") or _rms_rows(rows)
        if isinstance(norm, StateNorm) and norm.sizes is not None:  # a tuple state's: compared as tensors
            norm = _largest_part(norm.sizes)
        self.norm = norm
        self.dense = _dense_weights(tab) if (tab.dense is not None or tab.mid is not None) else None
        self.pad = (1,) * (y0.dim() - rows)
        self.land = False  # clip each step at the output time it runs to (odeint_vmappable's `land`)

    def b(self, x: torch.Tensor) -> torch.Tensor:
        """A per-instance (per-row) quantity broadcast over the state's own axes."""
        return x.reshape(x.shape + self.pad) if self.rows else x

    def at(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype)

    def below(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in the state's dtype, moved to its neighbour below (torchdiffeq's time of a stage at ``c = 1``)."""
        v = t.to(self.dtype)
        with torch.no_grad():
            step = torch.nextafter(v, torch.full_like(v, -math.inf)) - v
        return v + step

    def initial_step(self, t0: torch.Tensor, y0: torch.Tensor, f0: torch.Tensor) -> torch.Tensor:
        """Hairer, Nørsett & Wanner's initial step (§II.4), its branches as ``torch.where``."""
        scale = self.atol + torch.abs(y0) * self.rtol
        d0, d1 = self.norm(y0 / scale).abs(), self.norm(f0 / scale).abs()
        small = (d0 < 1e-5) | (d1 < 1e-5)
        h0 = torch.where(small, torch.full_like(d0, 1e-6), 0.01 * d0 / torch.where(small, torch.ones_like(d1), d1))
        y1 = y0 + self.b(h0) * f0
        f1 = self.func(self.at(t0 + h0.to(torch.float64)), y1)
        d2 = torch.abs(self.norm((f1 - f0) / scale) / h0)
        tiny = (d1 <= 1e-15) & (d2 <= 1e-15)
        big = torch.maximum(d1, d2)
        h1 = torch.where(
            tiny,
            torch.maximum(torch.full_like(h0, 1e-6), h0 * 1e-3),
            (0.01 / torch.where(tiny, torch.ones_like(big), big)) ** (1.0 / float(self.tab.order)),
        )
        return torch.minimum(100 * h0, h1.abs()).to(torch.float64)

    def factor(self, ratio: torch.Tensor) -> torch.Tensor:
        """``min(ifactor, max(φ(r), low))``; ``ifactor`` for a zero ratio, NaN for a NaN one."""
        rule = self.rule
        zero = ratio == 0
        safe = torch.where(zero, torch.ones_like(ratio), ratio)  # φ(0) is infinite: keep the unused side finite
        proposal = torch.as_tensor(rule.proposal_graph(safe, self.tab.order))
        low = torch.where(ratio < 1, torch.ones_like(ratio), torch.full_like(ratio, rule.dfactor))
        factor = torch.clamp(torch.maximum(proposal, low), max=rule.ifactor)
        return torch.where(zero, torch.full_like(factor, rule.ifactor), factor)

    def start(self, t: torch.Tensor, y0: torch.Tensor, first: Any) -> tuple[torch.Tensor, ...]:
        """Each instance's clock, first stage and first step size."""
        t0 = t[..., 0]
        t0 = (t0.expand(y0.shape[: self.rows]) if self.rows else t0).clone()
        k0 = self.func(self.at(t0), y0)
        if first is None:
            dt = self.initial_step(t0, y0, k0)
            if self.steps == "fixed":
                dt = dt.detach()
        else:
            dt = torch.full_like(t0, float(first))
        return t0, k0, dt

    def advance(self, tj: torch.Tensor, t0, y, k0, dt) -> tuple[tuple[torch.Tensor, ...], dict, torch.Tensor, Any]:
        """One attempted step of every instance still short of ``tj``: the next ``(t0, y, k0, dt)``, the attempt
        (kept as the last step where accepted), the acceptance and the instances whose clock did not move."""
        run = tj > t0
        dt = torch.where(torch.isfinite(dt), dt, torch.full_like(dt, self.min_step))
        dt = dt.clamp(self.min_step, self.max_step)
        t1 = t0 + dt
        if self.land:
            over = t1 > tj
            t1, dt = torch.where(over, tj, t1), torch.where(over, tj - t0, dt)
        stuck = run & ~(t1 > t0)
        Y, ks = self.stages(t0, t1, dt, y, k0)
        err = _combine(torch.zeros_like(y), self.b(dt.to(y.dtype)), self.tab.error, ks)
        tol = self.atol + self.rtol * torch.maximum(y.abs(), Y.abs())
        ratio = self.norm(err / tol).to(torch.float64)
        ok = run & (((ratio <= 1) & ~(dt > self.max_step)) | (dt <= self.min_step))
        nxt = dt * self.factor(ratio)
        if self.steps != "differentiated":
            nxt = nxt.detach()
        okb = self.b(ok)
        step = {"t0": t0, "t1": t1, "h": dt, "y0": y, "y1": Y, "ks": ks}
        carry = (
            torch.where(ok, t1, t0),
            torch.where(okb, Y, y),
            torch.where(okb, ks[-1], k0),
            torch.where(run, nxt, dt),
        )
        return carry, step, ok, stuck

    def stages(self, t0, t1, dt, y, k0) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The attempted step's end and its stages (the last at ``t_1``'s neighbour below where ``c = 1``)."""
        tab, hy = self.tab, self.b(dt.to(self.dtype))
        a, b, c = tab.tableau.a, tab.tableau.b, tab.tableau.c
        ks = [k0]
        end = None
        for i in range(1, tab.stages):
            Y = _combine(y, hy, a[i], ks)
            if tab.fsal and i == tab.stages - 1:
                end = Y
            ti = self.below(t1) if c[i] == 1.0 else self.at(t0 + c[i] * dt)
            ks.append(self.func(ti, Y))
        if end is None:
            end = _combine(y, hy, b, ks)
        return end, ks

    def extension(self, last: dict, ks: list[torch.Tensor]) -> list[torch.Tensor]:
        """The extra stages a continuous extension weighs (dopri8's), for each instance's last accepted step."""
        extra: list[torch.Tensor] = []
        hy = self.b(last["h"].to(self.dtype))
        for c, row in self.tab.dense_stages:
            Y = _combine(last["y0"], hy, row, ks + extra)
            extra.append(self.func(self.at(last["t0"] + c * last["h"]), Y))
        return ks + extra

    def interpolate(self, last: dict, tj: torch.Tensor) -> torch.Tensor:
        """The dense output of each instance's last accepted step at ``tj``: ``y_0 + h Σ_i β_i(x) k_i``,
        ``x = (t_j − t_0)/(t_1 − t_0)``."""
        assert self.dense is not None
        x = ((tj - last["t0"]) / (last["t1"] - last["t0"])).to(self.dtype)
        ks = self.extension(last, list(last["ks"])) if self.tab.dense_stages else last["ks"]
        powers = [x ** (p + 1) for p in range(len(self.dense))]
        hy = last["h"].to(self.dtype)
        out = last["y0"]
        for i, k in enumerate(ks):
            coeffs = [(p, row[i]) for p, row in zip(powers, self.dense) if row[i] != 0.0]
            if not coeffs:
                continue
            beta = coeffs[0][0] * coeffs[0][1]
            for p, w in coeffs[1:]:
                beta = beta + p * w
            out = out + self.b(beta * hy) * k
        return out


def _combine(y: torch.Tensor, hy: torch.Tensor, weights, ks: list[torch.Tensor]) -> torch.Tensor:
    """``y + h Σ_j w_j k_j`` over the nonzero weights."""
    out = y
    for w, k in zip(weights, ks):
        if w != 0.0:
            out = out + (hy * w) * k
    return out


def _check_call(options: Mapping[str, Any], method: str, y0: torch.Tensor) -> None:
    unknown = set(options) - VMAP_OPTIONS
    if unknown:
        raise ValueError(
            f"option(s) {sorted(unknown)} are not served under torch.vmap (the adaptive loop there takes "
            f"{sorted(VMAP_OPTIONS)}); drop them, or solve each instance in a loop."
        )
    if method not in vmap_methods():
        raise ValueError(f"`method`={method!r}: under torch.vmap the adaptive methods are {vmap_methods()}.")
    if y0.is_complex():
        raise ValueError("a complex state under torch.vmap: solve torch.view_as_real(y0) with a real field instead.")


def odeint_vmappable(
    func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str,
    rtol: Any,
    atol: Any,
    options: Mapping[str, Any] | None = None,
    max_steps: int = 2**62,
    rows: int = 0,
    steps: str = "differentiated",
    record: list | None = None,
    land: bool = False,
) -> torch.Tensor:
    """The states at the times ``t`` of ``y' = func(t, y)``, ``y(t[0]) = y0``, ``(len(t), *y0.shape)``, by an
    adaptive explicit Runge-Kutta method (:func:`vmap_methods`), every step decision a tensor operation: callable
    under ``torch.vmap``, each instance on its own steps.

    ``t``: increasing times (float64), shared or, with ``rows=1``, ``(batch, n)`` per row; ``rows=1``: ``y0``'s
    first axis are independent rows, each on its own clock (``func`` then gets ``t`` of shape ``(batch,)``).
    ``steps``: ``"differentiated"`` (every step size a function of the state, for backprop), ``"torchdiffeq"``
    (the first step size's dependence only) or ``"fixed"`` (none). ``max_steps``: attempted steps per instance.
    ``record``: a list that receives, per attempt, ``(j, t0, y, k0, dt)`` before it and its acceptance after, and
    per output time the last accepted steps (the checkpoints of :mod:`solvers.gradients.vmap_checkpoint`).
    ``land``: a step that would pass the output time it runs to is clipped to end on it (the ``step_t`` of the
    library's stepper at that time), for a solve whose field is not defined past its last time.
    """
    options = dict(options or {})
    _check_call(options, method, y0)
    tab = TABLEAUX[method]
    loop = _Loop(func, y0, tab, rtol, atol, options, rows, steps)
    loop.land = land
    t = t.to(torch.float64)
    lead = y0.shape[:rows]

    t0, k0, dt = loop.start(t, y0, options.get("first_step"))
    y = y0
    n_steps = torch.zeros(lead, dtype=torch.int64, device=y0.device)
    stuck = torch.zeros(lead, dtype=torch.bool, device=y0.device)
    last: dict[str, Any] | None = None
    out = [y0]
    iterations = 0  # no instance has attempted more steps than the loop has made
    for j in range(1, t.shape[-1]):
        tj = t[..., j]
        while True:
            run = tj > t0
            # the loop's one host read: 0 all done, 1 some running, 2 a step that failed to move its clock
            code = torch.where(stuck, 2, run.to(torch.int8))
            top = int(physical(code).max())
            if top == 0:
                break
            if top == 2:
                raise SolverError(
                    "step size underflow under torch.vmap (an instance's error estimate is NaN/inf, or its solution "
                    "blows up): loosen `rtol`/`atol`, use float64, or check the field.",
                    reason=Reason.UNDERFLOW,
                )
            iterations += 1
            if iterations > max_steps and host_any(run & (n_steps >= max_steps)):
                # rows: vmap's instances stacked (_solve_stacked runs the loop with their level popped)
                vmapped = rows or transforms.under_vmap()
                where = "by an instance under torch.vmap" if vmapped else "in a solve under torch.func"
                raise SolverError(
                    f"max_num_steps={max_steps} reached {where}; raise `options['max_num_steps']` or loosen "
                    "`rtol`/`atol` (the field may be stiff).",
                    reason=Reason.MAX_STEPS,
                )
            if record is not None:
                record.append((j, t0, y, k0, dt))
            (t0, y, k0, dt), step, ok, stuck = loop.advance(tj, t0, y, k0, dt)
            if record is not None:
                record.append(ok)
            last = step if last is None else {k: _select(ok, loop.b(ok), step[k], last[k]) for k in step}
            n_steps = n_steps + run.to(torch.int64)
        assert last is not None
        if record is not None:
            record.append(last)
        out.append(loop.interpolate(last, tj))
    return torch.stack(out)


def _select(ok: torch.Tensor, okb: torch.Tensor, new: Any, old: Any) -> Any:
    if isinstance(new, list):
        return [torch.where(okb, a, b) for a, b in zip(new, old)]
    return torch.where(okb if new.dim() > ok.dim() else ok, new, old)


def vmap_options(run: Any) -> dict[str, Any]:
    """The loop's options from a :class:`~solvers.run.Run`'s: unset ones dropped, the seminorm (a backward
    solve's) read as the default norm."""
    options = {k: v for k, v in run.options.items() if v is not None}
    if options.get("norm") == "seminorm":
        options.pop("norm")
    return options


def solve_vmapped(run: Any, gradient: Any) -> torch.Tensor | None:
    """The engine's solve of ``run`` (:class:`~solvers.run.Run`) under ``torch.vmap``: the adaptive explicit
    Runge-Kutta methods on this loop, differentiated by autograd (``gradient="backprop"``; the engine serves the
    adjoints, the checkpoint, the symplectic adjoint and forward sensitivities by their own functions first);
    ``None`` for the fixed-step explicit methods, whose host-side grid ``vmap`` already runs. Anything else is
    refused by name."""
    method = run.method
    check_autocast_region(run.y0)
    if method not in vmap_methods():
        if method in FIXED_METHODS:
            if transforms.batched(run.t):
                raise ValueError(
                    f"per-instance `t` under torch.vmap with the fixed-step method={method!r}: its grid is built on "
                    "the host from the times, which vmap cannot batch; use an adaptive method "
                    f"{vmap_methods()} (each instance on its own times), or solve the instances in a loop."
                )
            return None
        raise ValueError(
            f"method={method!r} under torch.vmap: vmap solves each instance on its own steps with the adaptive "
            f"explicit Runge-Kutta methods {vmap_methods()}, or steps the fixed-step ones {list(FIXED_METHODS)}; "
            "use one of them (or solve the instances in a loop)."
        )
    needed = torch.is_grad_enabled() and (tracked(run.y0) or any(tracked(p) for p in run.params))
    if gradient.name != "backprop" and needed:
        raise ValueError(
            f"gradient={gradient.name!r} under torch.vmap: its backward pass reads the steps on the host, which vmap "
            "cannot batch; use gradient='backprop' (autograd through the vmapped loop, every instance's own steps) "
            "or one of the methods with a vmapped backward pass of their own: 'adjoint', 'checkpoint', 'symplectic', "
            "'forward', 'interpolating', 'gauss'."
        )
    options = vmap_options(run)
    # the counting wrapper of ODEBlock's solves registers hooks per evaluation: vmap calls the field itself
    func = run.func.field if isinstance(run.func, Counted) else run.func
    s = run.solver
    level = innermost_vmap()
    if level is not None and _stackable(level, run.y0, s.rtol, s.atol, options):
        return _solve_stacked(level, func, run, options, steps=getattr(gradient, "steps", "differentiated"))
    return odeint_vmappable(
        func,
        run.y0,
        run.t,
        method=method,
        rtol=s.rtol,
        atol=s.atol,
        options=options,
        max_steps=s.max_steps,
        steps=getattr(gradient, "steps", "differentiated"),
    )


def _stackable(level: VmapLevel, y0: torch.Tensor, rtol: Any, atol: Any, options: Mapping[str, Any]) -> bool:
    """Whether the innermost ``vmap``'s instances can be solved as the rows of one stacked batch (the default norm,
    a state with axes, tolerances shared by every instance)."""
    shared = all(not (isinstance(tol, torch.Tensor) and level.batched(tol)) for tol in (rtol, atol))
    return "norm" not in options and y0.dim() > 0 and not y0.is_complex() and shared


def _solve_stacked(level: VmapLevel, func: Callable, run: Any, options: Mapping[str, Any], steps: str) -> torch.Tensor:
    """The innermost ``vmap``'s instances solved as the rows of one batch, each on its own clock (``rows=1``): the
    loop's decisions run once on the stacked tensors instead of through ``vmap``'s batching rules, and only the
    field sees the instances (the same values: every row's steps are its instance's)."""
    y0, t = level.stack(run.y0), run.t
    if level.batched(t):  # per-instance output times: one row of times per instance
        t = level.stack(t)

    def stacked(s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return level.evaluate(func, s, y)

    s = run.solver
    with stacked_linears(level, func), level.popped():
        out = odeint_vmappable(
            stacked,
            y0,
            t,
            method=run.method,
            rtol=s.rtol,
            atol=s.atol,
            options=options,
            max_steps=s.max_steps,
            rows=1,
            steps=steps,
        )
    return level.instance(out, 1)
