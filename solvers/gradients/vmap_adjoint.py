r"""The continuous adjoint under ``torch.vmap``: each vmapped instance's adjoint solved backwards on its own steps.

Pontryagin's adjoint (Chen et al. 2018, "Neural ordinary differential equations", eqs. 4-5): for
``y' = F(t, y, θ)`` and a loss ``ℒ(y(t_0), …, y(t_N))``, backwards from ``t_N``,

    ``y' = F``,   ``a' = −aᵀ ∂F/∂y``,   ``g' = −aᵀ ∂F/∂θ``,

``a`` jumping by ``∂ℒ/∂y(t_i)`` at each output time and ``y`` restarted there from the forward solution; then
``∂ℒ/∂y_0 = a(t_0)`` and ``∂ℒ/∂θ = g(t_0)``. The backward error norm is the seminorm ``max(‖y‖, ‖a‖)`` (Kidger,
Chen & Lyons 2021, "Hey, that's not an ODE"), or every part's with ``Adjoint(seminorm=False)``.

Both solves run on the loop of tensor decisions (:mod:`solvers.steppers.vmappable`), inside an ``autograd.Function``
written the way ``torch.func`` takes one (a context-free ``forward``, ``setup_context``, ``generate_vmap_rule``):
under ``vmap`` torch runs the forward and the backward themselves under ``vmap``, so every instance takes its own
forward and backward steps, and ``grad``/``jacrev`` stacked on ``vmap`` (or beneath it) get the adjoint's gradient.

``torch.func`` refuses an ``autograd.Function`` whose field closes over tensors the transforms track (batched by
``vmap``, differentiated by ``grad``): those tensors must be its inputs. The tensors to differentiate
(``adjoint_params``) and every such tensor the field reaches (a module's parameters and buffers, attributes, a
closure's cells, the values of a dict or list it holds) are therefore passed in, and swapped into their places in
the field for each evaluation; every one of them gets its adjoint gradient. A differentiated tensor the field
reaches otherwise (through a global or a tuple, say), which would get no gradient, is refused by name: one evaluation
of the field with every swapped tensor detached shows it (:func:`field_inputs`, for every gradient method here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch._C._functorch import TransformType
from torch.func import vjp

from ..counting import Counted
from ..norms import StateNorm
from ..steppers.vmappable import VMAP_OPTIONS, _largest_part, odeint_vmappable, vmap_methods
from ..transforms import tracked, wrapped

_F = torch._C._functorch

__all__ = ["CLOSURE_REFUSAL", "adjoint_vmapped", "applied", "closure_refusal", "differentiated", "field_inputs", "live"]

#: the refusal where the field reaches a tracked tensor the search of its slots does not find
CLOSURE_REFUSAL = (
    "gradient='adjoint' under torch.func: the field reaches a tensor that torch.func tracks (batched by vmap or "
    "differentiated by grad/jacrev/vjp) in a place this gradient method cannot swap for an input of its own (a "
    "global, a tuple, an object without __dict__), so its gradient would be lost (and torch.func refuses an "
    "autograd.Function that closes over one). Hold it in a module, an attribute, a closure variable, a dict or a "
    "list the field reaches (and pass it in `adjoint_params` if it is to get a gradient), or use "
    "gradient='backprop'."
)

_DEPTH = 8


class _Slot:
    """A place in the field's reach that holds a tensor: a dict's (or list's) entry, an attribute, a closure cell."""

    def __init__(self, holder: Any, key: Any, kind: str):
        self.holder, self.key, self.kind = holder, key, kind

    def get(self) -> torch.Tensor:
        if self.kind == "cell":
            return self.holder.cell_contents
        return self.holder[self.key]

    def set(self, value: torch.Tensor) -> None:
        if self.kind == "cell":
            self.holder.cell_contents = value
        else:
            self.holder[self.key] = value


def _slots(func: Any) -> list[_Slot]:
    """Every slot holding a tensor that the field reaches through modules, attributes, closures, dicts and lists."""
    found: list[_Slot] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if depth > _DEPTH or id(obj) in seen or isinstance(obj, torch.Tensor | str | int | float | type | ModuleType):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            holders: list[tuple[Any, Any, str]] = [(obj, k, "item") for k in obj]
        elif isinstance(obj, list):
            holders = [(obj, k, "item") for k in range(len(obj))]
        elif isinstance(obj, tuple):  # entries not swappable: only what they hold
            holders = []
            for v in obj:
                visit(v, depth + 1)
        elif callable(obj) and hasattr(obj, "__code__"):  # a function: its closure cells, its bound self
            holders = [(c, None, "cell") for c in obj.__closure__ or ()]
            visit(getattr(obj, "__self__", None), depth + 1)
        elif hasattr(obj, "__func__"):  # a bound method
            visit(obj.__func__, depth + 1)
            visit(obj.__self__, depth + 1)
            holders = []
        elif hasattr(obj, "__dict__"):
            holders = [(vars(obj), k, "item") for k in vars(obj)]
        else:
            holders = []
        for holder, key, kind in holders:
            try:
                value = holder.cell_contents if kind == "cell" else holder[key]
            except ValueError:  # an empty cell
                continue
            if isinstance(value, torch.Tensor):
                found.append(_Slot(holder, key, kind))
            else:
                visit(value, depth + 1)

    visit(func, 0)
    return found


class _Swapped:
    """The field with its tensors swapped for the ``autograd.Function``'s inputs during each evaluation."""

    def __init__(self, func: Callable, slots: list[list[_Slot]], tensors: Sequence[torch.Tensor]):
        self.func, self.slots, self.tensors = func, slots, tensors

    def __call__(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.with_tensors(self.tensors)(t, y)

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def call(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            held = [[s.get() for s in group] for group in self.slots]
            try:
                for group, value in zip(self.slots, tensors):
                    for s in group:
                        s.set(value)
                return self.func(t, y)
            finally:
                for group, values in zip(self.slots, held):
                    for s, v in zip(group, values):
                        s.set(v)

        return call


class _VmapAdjoint(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(y0: torch.Tensor, t: torch.Tensor, cfg: dict, *tensors: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return odeint_vmappable(_Swapped(cfg["func"], cfg["slots"], tensors), y0, t, **cfg["forward"])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        t, cfg, tensors = inputs[1], inputs[2], inputs[3:]
        ctx.cfg = cfg
        ctx.save_for_backward(t, output, *tensors)

    @staticmethod
    def backward(ctx: Any, grad_ys: torch.Tensor) -> tuple:
        cfg = ctx.cfg
        t, ys, *tensors = (live(x) for x in ctx.saved_tensors)
        field = _Swapped(cfg["func"], cfg["slots"], tensors)
        shape, n = ys.shape[1:], ys[0].numel()
        sizes = [p.numel() for p in tensors]

        def augmented(s: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            y, a = state[:n].reshape(shape), state[n : 2 * n].reshape(shape)
            f, pull = vjp(lambda z, *p: field.with_tensors(p)(s, z), y, *tensors)[:2]
            return torch.cat([f.reshape(-1), *(v.reshape(-1) for v in pull(-a))])

        def reversed_time(s: torch.Tensor, state: torch.Tensor) -> torch.Tensor:  # the loop steps forwards
            return -augmented(-s, state)

        part = cfg["norm"]
        norm: Callable[[torch.Tensor], torch.Tensor]
        if cfg["seminorm"]:

            def norm(x: torch.Tensor) -> torch.Tensor:
                return torch.maximum(part(x[:n]), part(x[n : 2 * n]))
        else:
            norm = _largest_part((n, n, *sizes))
        options = {**cfg["backward_options"], "norm": norm}
        a, g = grad_ys[-1], [torch.zeros(k, dtype=ys.dtype, device=ys.device) for k in sizes]
        for i in range(len(t) - 1, 0, -1):
            state = torch.cat([ys[i].reshape(-1), a.reshape(-1), *g])
            span = -t[i - 1 : i + 1].flip(0)
            end = odeint_vmappable(reversed_time, state, span, options=options, **cfg["backward"])[-1]
            a = end[n : 2 * n].reshape(shape) + grad_ys[i - 1]
            g = list(end[2 * n :].split(sizes)) if sizes else []
        return (a, None, None, *(x.reshape(p.shape).to(p.dtype) for x, p in zip(g, tensors)))


def field_inputs(run: Any, name: str) -> tuple[Callable, list[list[_Slot]], list[torch.Tensor]]:
    """The field of ``run`` and the tensors an ``autograd.Function`` under ``torch.func`` must take as inputs:
    ``run.params`` and every tracked tensor the field reaches, each with the slots that hold it."""
    func = run.func.field if isinstance(run.func, Counted) else run.func
    slots = _slots(func)
    groups: list[list[_Slot]] = []
    tensors: list[torch.Tensor] = []
    for p in run.params:
        mine = [sl for sl in slots if sl.get() is p]
        if not mine:
            raise ValueError(
                f"gradient={name!r} under torch.func: a tensor of `adjoint_params` is not one the field reaches "
                "(a module's parameter, an attribute, a closure variable, a dict or list entry), so its "
                "gradient cannot be taken; pass the field's own tensors, or use gradient='backprop'."
            )
        groups.append(mine)
        tensors.append(p)
    for sl in slots:  # tracked tensors beyond adjoint_params: inputs too (torch.func refuses them closed over)
        value = sl.get()
        if wrapped(value) and not any(value is p for p in tensors):
            groups.append([x for x in slots if x.get() is value])
            tensors.append(value)
    if _reaches_hidden(run, func, groups, tensors):
        raise ValueError(closure_refusal(name))
    return func, groups, tensors


def differentiated(x: torch.Tensor) -> bool:
    """Whether a ``torch.func`` level (``grad``, ``jacrev``, ``vjp``) differentiates ``x`` (autograd beneath every
    level aside: as outside ``vmap``, a tensor that only requires grad and is not in ``adjoint_params`` gets no
    gradient)."""
    while wrapped(x):
        if x.requires_grad:
            return True
        x = _F.get_unwrapped(x)
    return False


def _reaches_hidden(run: Any, func: Callable, slots: list[list[_Slot]], tensors: list[torch.Tensor]) -> bool:
    """Whether the field depends on a tensor a ``torch.func`` level differentiates beyond the ones swapped in:
    one evaluation at ``(t_0, y_0)`` with ``y_0``, ``t_0`` and every swapped tensor detached whose value a level
    still differentiates. Without the check such a tensor's gradient is silently zero: the gradient methods'
    backward passes take only their inputs' (a dependence on a branch this evaluation does not take escapes it)."""
    stack = _F.get_interpreter_stack() or ()
    if not torch.is_grad_enabled() or not any(level.key() == TransformType.Grad for level in stack):
        return False
    y0 = run.y0.detach()
    out = _Swapped(func, slots, [x.detach() for x in tensors])(run.t[0].detach(), y0)
    return any(differentiated(x) for x in (out if isinstance(out, tuple | list) else (out,)))


def live(x: torch.Tensor) -> torch.Tensor:
    """``x`` without the wrappers of ``torch.func`` levels that have exited: an ``autograd.Function``'s saved input
    under ``vmap(vjp(...))`` is wrapped at the ``vjp`` level, gone by the time its pullback runs, around a tensor
    batched at the ``vmap`` level beneath, and torch's batching refuses (an internal assert) to mix it with that
    level's cotangents; the tensor beneath holds the same values."""
    while wrapped(x) and not _F.is_batchedtensor(x) and _F.maybe_get_level(x) == -2:  # -2: a dead level's wrapper
        x = _F.get_unwrapped(x)
    return x


def applied(function: Any, name: str, *args: Any) -> Any:
    """``function.apply(*args)`` (a vmap-ready ``autograd.Function`` of ``gradient=name``), torch.func's error for a
    tracked tensor the field closes over where it could not be swapped in refused by name."""
    try:
        return function.apply(*args)
    except RuntimeError as exc:
        if "wrapper" in str(exc) or "functorch" in str(exc).lower():
            raise ValueError(closure_refusal(name)) from exc
        raise


def closure_refusal(name: str) -> str:
    """The refusal where the field reaches a tracked tensor that no slot holds."""
    return CLOSURE_REFUSAL.replace("gradient='adjoint'", f"gradient={name!r}")


def adjoint_vmapped(run: Any, gradient: Any, forward_options: dict) -> torch.Tensor | None:
    """The engine's solve of ``run`` under ``torch.vmap`` with the continuous adjoint (``gradient``, an
    :class:`~solvers.gradients.Adjoint`): the states at ``run.t``, gradients with respect to ``run.y0``,
    ``run.params`` and every tracked tensor the field reaches by the adjoint solve of each instance; ``None``
    where nothing the solve reads is differentiated (the plain loop serves)."""
    s, b = run.solver, run.backward
    method = (b.method if b is not None else gradient.method) or s.method
    if method not in vmap_methods():
        raise ValueError(
            f"adjoint_method={method!r} under torch.func: the backward solve runs on the adaptive loop, whose "
            f"methods are {vmap_methods()}."
        )
    rtol = b.rtol if b is not None else (s.rtol if gradient.rtol is None else gradient.rtol)
    atol = b.atol if b is not None else (s.atol if gradient.atol is None else gradient.atol)
    back_options = dict(b.options) if b is not None else dict(forward_options)
    user_norm = back_options.pop("norm", None)
    if user_norm not in (None, "seminorm") and not isinstance(user_norm, StateNorm):
        raise ValueError(
            "adjoint_options={'norm': <callable>} under torch.func: the backward norm there is the seminorm "
            "(or, with Adjoint(seminorm=False), every part's); drop the norm."
        )
    back_options = {k: v for k, v in back_options.items() if k in VMAP_OPTIONS and v is not None}
    func, groups, tensors = field_inputs(run, "adjoint")
    if not (tracked(run.y0) or any(tracked(p) for p in tensors)):
        return None
    state_norm = forward_options.get("norm")
    if isinstance(state_norm, StateNorm) and state_norm.sizes is not None:
        part: Callable = _largest_part(state_norm.sizes)
    else:
        part = StateNorm()
    cfg = dict(
        func=func,
        slots=groups,
        forward=dict(method=s.method, rtol=s.rtol, atol=s.atol, options=forward_options, max_steps=s.max_steps),
        backward=dict(method=method, rtol=rtol, atol=atol, max_steps=s.max_steps),
        backward_options=back_options,
        norm=part,
        seminorm=getattr(gradient, "seminorm", True),
    )
    return applied(_VmapAdjoint, "adjoint", run.y0, run.t, cfg, *tensors)
