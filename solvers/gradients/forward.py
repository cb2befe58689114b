r"""Forward sensitivity: the Jacobian of the solve by forward-mode differentiation through its steps.

The solve's outputs ``Y = (y(t_0), …, y(t_m))`` are a function of its inputs ``x = (y_0, θ)``. A solve in tangent
mode (:mod:`solvers.gradients.tangents`) carries beside every value its derivative along a direction ``ẋ``; with the
``n`` unit directions carried together (one primal solve, ``n`` tangents per value) it gives the whole Jacobian
``∂Y/∂x``, whatever the number of outputs, and the backward pass is the contraction ``∂L/∂x = Jᵀ ∂L/∂Y``. Its
tangent arithmetic grows with ``n``, reverse mode's backward pass does not: this is the discrete forward
sensitivity (forward-mode automatic differentiation through the solver) that Ma et al. (2021, "A comparison of
automatic differentiation and continuous sensitivity analysis for derivatives of differential equation solutions")
find fastest below about 100 parameters plus states; the crossover here is measured in
``benchmarks/forward_sensitivity.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd.functional import jacobian

from ..errors import SolverError, check_positive_int
from ..grids import stepper_options
from ..options import REVERSIBLE_METHODS
from ..steppers.fast_rk import FAST_METHODS, fast_applies, odeint_fast
from .base import GradientMethod, Run
from .checkpoint import backwards_in_time
from .second_order import first_order, remember_inputs, served
from .step_sizes import check_steps
from .tangents import dense_zero_tangents, dual_solve, find_slots, swapped

__all__ = ["Forward", "jacobian_solve"]


@dataclass(frozen=True, repr=False)
class Forward(GradientMethod):
    """The Jacobian of the outputs with respect to ``y0`` and every parameter that requires grad, by one solve that
    carries a tangent per input element, computed in the forward call; the backward pass is ``Jᵀ g``. Exact for the
    solver's map: on the library's own stepper it equals ``Backprop()``'s gradient to rounding.

    ``steps`` (:mod:`~solvers.gradients.step_sizes`): as :class:`~solvers.gradients.Backprop`'s; ``"differentiated"``
    (the default) carries every adaptive step size's tangent through the error estimate and the controller, ``"fixed"``
    holds the sizes constant. ``max_entries``: the most Jacobian entries (outputs × inputs) a call may store
    (default ``2**27``, 1 GiB in float64); above it the call is refused, since the Jacobian alone would take that
    memory. Its tangent arithmetic grows with the number of inputs, so it pays for few (see the gradients guide).

    Serves the methods of the library's Runge-Kutta stepper (:data:`~solvers.steppers.fast_rk.FAST_METHODS`), on
    float32/float64 states with torchdiffeq's step options. The implicit, composition and ``alf`` methods, the
    Adams methods and the per-sample controller are refused by name.
    """

    steps: str = "differentiated"
    max_entries: int = 2**27

    name = "forward"
    per_input = True

    def __post_init__(self) -> None:
        check_steps(self.steps)
        check_positive_int("max_entries", self.max_entries, "the most Jacobian entries a call may store")
        if self.steps == "torchdiffeq":
            raise ValueError(
                "Forward(steps='torchdiffeq') is not offered: torchdiffeq has no forward mode to match. Use "
                "steps='differentiated' (the default) or 'fixed'."
            )

    def describe(self) -> str:
        return self.name if self.steps == "differentiated" else f"{self.name} ({self.steps} steps)"

    def supports(self, method: str) -> bool:
        return method in FAST_METHODS

    def refusal(self, method: str) -> str:
        if method in REVERSIBLE_METHODS:
            return super().refusal(method)
        return (
            f"gradient='forward' differentiates the library's own Runge-Kutta stepper in tangent mode; method="
            f"{method!r} does not run on it. Use one of {sorted(FAST_METHODS)}, or gradient='backprop'/'checkpoint'"
            f"/'adjoint' with {method!r}."
        )

    def solve(self, run: Run) -> torch.Tensor:
        if len(run.t) > 1 and float(run.t[0]) > float(run.t[-1]):
            run = backwards_in_time(run)
        s = run.solver
        return jacobian_solve(
            run.func,
            run.y0,
            run.t,
            run.params,
            method=s.method,
            rtol=s.rtol,
            atol=s.atol,
            options=stepper_options(run.options),
            gradient=self,
        )


def jacobian_solve(
    func: Any,
    y0: torch.Tensor,
    t: torch.Tensor,
    params: tuple[torch.Tensor, ...],
    *,
    method: str,
    rtol: Any,
    atol: Any,
    options: dict,
    gradient: Forward,
) -> torch.Tensor:
    """The states at ``t`` (increasing), with the backward pass ``Jᵀ g`` of the Jacobian ``J`` with respect to
    ``y0`` and each of ``params`` that requires grad, found by one solve carrying every input direction."""
    if not fast_applies(method, True, y0, t, (), options):
        raise ValueError(
            f"gradient='forward' runs on the library's own stepper, which does not take this call "
            f"(method={method!r}, a {y0.dtype} state, options {sorted(options)}): use a float32/float64 state "
            "and torchdiffeq's step options only, or gradient='backprop'."
        )

    def solve(start: torch.Tensor) -> torch.Tensor:
        return odeint_fast(
            func, start, t, method=method, rtol=rtol, atol=atol, options=options, graph=True, steps=gradient.steps
        )

    # each tensor once: a parameter listed twice gets its gradient once
    wrt = list({id(x): x for x in (y0, *params) if x.requires_grad}.values()) if torch.is_grad_enabled() else []
    if not wrt:
        with torch.no_grad():
            return odeint_fast(func, y0, t, method=method, rtol=rtol, atol=atol, options=options, graph=False)
    n = sum(x.numel() for x in wrt)
    entries = n * len(t) * y0.numel()
    if entries > gradient.max_entries:
        raise ValueError(
            f"gradient='forward' would store a Jacobian of {entries} entries ({n} inputs x {len(t) * y0.numel()} "
            f"outputs), above max_entries={gradient.max_entries}: its memory alone would be "
            f"{entries * y0.element_size() / 2**30:.2g} GiB, and every value of the solve carries {n} tangents. Use "
            "gradient='checkpoint' "
            "(reverse mode: one backward pass whatever the number of parameters), or raise Forward(max_entries=)."
        )
    inputs = {id(x): x for x in (y0, *params)}
    slots = find_slots(func, {k: x for k, x in inputs.items() if x is not y0})
    missing = slots.missing({k: x for k, x in inputs.items() if x is not y0})
    if missing:
        x = missing[0]
        raise ValueError(
            f"gradient='forward' sets each tangent where the field reads the tensor, but a tensor to differentiate "
            f"(shape {tuple(x.shape)}) is neither a parameter or buffer of the field's modules nor an attribute "
            "or closure variable it holds: keep it in an nn.Module field (or pass only those as adjoint_params)."
        )
    # the tangent solve runs here: inside an autograd Function's forward, forward-mode differentiation is off
    ys, blocks = _jacobian(solve, y0, inputs, slots, wrt, func)
    return _Jacobian.apply((ys, dict(zip((id(x) for x in wrt), blocks)), solve), y0, *params)


def _jacobian(
    solve: Any, y0: torch.Tensor, inputs: dict, slots: Any, wrt: list[torch.Tensor], func: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The states and, per input of ``wrt``, the Jacobian ``(*states.shape, *x.shape)``: one solve carrying every
    tangent direction at once (torch's vectorised forward-mode Jacobian, a batch of tangents beside one primal:
    every step size and decision of the solver is the primal's, so all directions share them)."""
    plain = {k: x.detach() for k, x in inputs.items()}
    keys = [id(x) for x in wrt]
    primal: list[torch.Tensor] = []
    counters = _Counters(func)

    def through(*xs: torch.Tensor) -> torch.Tensor:
        values = {**plain, **dict(zip(keys, xs))}
        with swapped(slots, values), dense_zero_tangents():
            out = solve(values[id(y0)])
        primal.append(fwAD.unpack_dual(out).primal.clone())
        return out

    try:
        with torch.enable_grad():
            J = jacobian(through, tuple(plain[k] for k in keys), vectorize=True, strategy="forward-mode")
        return primal[-1], list(J)
    except SolverError:
        raise
    except RuntimeError:
        pass  # torch's batched tangents do not cover every operation (a 1-D state's matmul): one direction a solve
    blocks = []
    for x in wrt:
        columns = []
        for i in range(x.numel()):
            e = torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
            e[i] = 1
            counters.rewind()
            ys, dy = dual_solve(solve, y0, inputs, {id(x): e.view(x.shape)}, slots)
            columns.append(dy)
        blocks.append(torch.stack(columns, -1).view(*ys.shape, *x.shape))
    return ys, blocks


class _Counters:
    """The step counts a solve keeps on its field wrapper (the statistics' steps and rejections, the functional
    API's ``max_num_steps`` count): where the directions take one solve each, each starts from the counts the
    first started from, since all take the same steps; field evaluations add up, since each one is made."""

    _NAMES = (("stats", "steps_forward"), ("stats", "rejected_forward"), (None, "n_steps"))

    def __init__(self, func: Any) -> None:
        self.start: list[tuple[Any, str, Any]] = []
        for owner, name in self._NAMES:
            obj = getattr(func, owner, None) if owner else func
            if obj is not None and isinstance(getattr(obj, name, None), int):
                self.start.append((obj, name, getattr(obj, name)))

    def rewind(self) -> None:
        for obj, name, value in self.start:
            setattr(obj, name, value)


def _second_order(ctx: Any, cotangents: tuple, outs: tuple) -> tuple | str:
    """Forward sensitivities' second derivative: ``Jᵀ g`` is the vector-Jacobian product of the solver's steps, so
    its derivative is that of the same product taken by autograd through the steps recomputed with a graph (the
    steps and decisions of the forward solve, as backpropagation takes them: exact for the solver's map)."""
    y0, *params = ctx.inputs
    if any(x._version != v for x, v in zip(ctx.inputs, ctx.versions)):
        return "gradient='forward': an input of the solve was modified in place since; its second derivative needs it."
    solve = ctx.solve

    def recompute(free: list[torch.Tensor], params: list[torch.Tensor]) -> tuple:
        start, g = free
        wrt = [x for x, out in zip((start, *params), outs[1:]) if out is not None]
        found = iter(torch.autograd.grad(solve(start), wrt, g, allow_unused=True, create_graph=True))
        return (None, *(None if out is None else next(found) for out in outs[1:]))

    return served("forward", outs, [y0, cotangents[0]], params, recompute)


class _Jacobian(torch.autograd.Function):
    """The states, with the backward pass ``∂L/∂x_k = J_kᵀ ∂L/∂Y`` of the Jacobian blocks found in forward."""

    @staticmethod
    def forward(ctx: Any, found: tuple, y0: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ys, ctx.blocks, ctx.solve = found
        ctx.keys = [id(y0), *(id(p) for p in params)]
        ctx.shapes = [y0.shape, *(p.shape for p in params)]
        # kept on the context, not saved for backward: only a second derivative reads them (checked unchanged then)
        ctx.inputs, ctx.versions = (y0, *params), [x._version for x in (y0, *params)]
        remember_inputs(ctx, y0, *params)
        return ys

    @staticmethod
    @first_order("forward", serve=_second_order)
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat = g.reshape(-1)
        grads: list[torch.Tensor | None] = []
        seen: set[int] = set()  # a tensor passed twice gets its gradient once
        for key, shape in zip(ctx.keys, ctx.shapes):
            block = None if key in seen else ctx.blocks.get(key)
            seen.add(key)
            grads.append(None if block is None else (flat @ block.reshape(flat.numel(), -1)).view(shape))
        return (None, *grads)
