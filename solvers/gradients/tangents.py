r"""Forward-mode tangents through a solve: the tensors a field reads, swapped for dual ones while the solve runs.

Forward-mode automatic differentiation (Griewank & Walther 2008, "Evaluating Derivatives", §3.1, the tangent mode)
carries with every value ``v`` its directional derivative ``v̇ = (∂v/∂x) ẋ``. In torch the carriers are dual
tensors (``torch.autograd.forward_ad``), made from a tensor and its tangent; a field reads its parameters from its
modules, so the solve in tangent mode runs with each parameter's slot (a module's parameter or buffer table, an
object's attribute, a closure cell) holding the dual tensor, and every slot restored afterwards.

Every run also gets fresh per-call caches (:func:`cde_nets.blocks.gathering.gathered`: a field's memoised constants, a
piecewise parameter's views), so no constant built from the plain parameters leaks into the tangent solve and no
dual one out of it.

The solve runs under grad mode with nothing requiring grad: the stepper then takes the path that differentiates
the step sizes (:mod:`solvers.gradients.step_sizes`, whose formulas see a tangent as they see a graph), and records
nothing.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["Slots", "dense_zero_tangents", "dual_solve", "find_slots", "swapped"]

# the per-call caches of cde_nets.blocks.gathering.gathered, by attribute name: a fresh value for each tangent solve
_CACHES = ("_memo", "_constants", "_unbound")


class Slots:
    """Where each tensor of ``targets`` is stored (``places[id(x)]``: a list of ``(table, key)``, ``table`` a dict
    or a closure cell), and the per-call caches met on the way (``caches``: ``(object, attribute)``)."""

    def __init__(self) -> None:
        self.places: dict[int, list[tuple[Any, str | None]]] = {}
        self.caches: list[tuple[Any, str]] = []

    def missing(self, targets: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        return [x for key, x in targets.items() if key not in self.places]


def find_slots(root: object, targets: Mapping[int, torch.Tensor], depth: int = 8) -> Slots:
    """Every place reachable from ``root`` that holds one of ``targets`` (by identity): the parameter and buffer
    tables and attributes of modules, the attributes of plain wrapper objects, bound methods' objects and
    functions' closure cells, ``depth`` references deep at most."""
    slots = Slots()
    seen: set[int] = set()
    frontier: list[object] = [root]
    for _ in range(depth):
        nxt: list[object] = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, (type, types.ModuleType, torch.Tensor)):
                continue
            seen.add(id(obj))
            tables: list[dict] = []
            if isinstance(obj, nn.Module):
                tables += [obj._parameters, obj._buffers, obj._modules]
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                tables.append(attrs)
                slots.caches += [(obj, name) for name in _CACHES if attrs.get(name) is not None]
            if isinstance(obj, types.MethodType):
                nxt.append(obj.__self__)
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # a cell not yet filled
                    continue
                if isinstance(value, torch.Tensor):
                    if id(value) in targets:
                        slots.places.setdefault(id(value), []).append((cell, None))
                elif value is not None:
                    nxt.append(value)
            for table in tables:
                for key, value in table.items():
                    if isinstance(value, torch.Tensor):
                        if id(value) in targets:
                            slots.places.setdefault(id(value), []).append((table, key))
                    elif _worth_visiting(value):
                        nxt.append(value)
        frontier = nxt
    return slots


def _worth_visiting(value: object) -> bool:
    """Objects that may hold a field's tensors: modules, callables and plain wrapper objects (not numbers,
    strings, containers or classes)."""
    if isinstance(value, (nn.Module, types.FunctionType, types.MethodType)):
        return True
    return hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType))


def _get(table: Any, key: str | None) -> Any:
    return table.cell_contents if key is None else table[key]


def _set(table: Any, key: str | None, value: Any) -> None:
    if key is None:
        table.cell_contents = value
    else:
        table[key] = value


@contextmanager
def swapped(slots: Slots, values: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Every slot of a tensor in ``values`` holding its replacement, and fresh per-call caches, until exit."""
    saved: list[tuple[Any, str | None, Any]] = []
    try:
        for key, value in values.items():
            for table, name in slots.places.get(key, ()):
                saved.append((table, name, _get(table, name)))
                _set(table, name, value)
        for obj, name in slots.caches:
            old = vars(obj)[name]
            saved.append((vars(obj), name, old))
            vars(obj)[name] = () if name == "_unbound" else {}
        yield
    finally:
        for table, name, old in reversed(saved):
            _set(table, name, old)


# binary arithmetic whose forward-mode formula, for an operand without a tangent (a plain tensor, a Python number),
# multiplies a zero tensor of torch's own kind, each costing a shape computation on the meta device (~0.2 ms a call
# on the CPU, torch 2.13): given a dense zero tangent instead, the same formula costs microseconds
_BINARY = {
    getattr(torch.Tensor, name)
    for name in (
        "__add__",
        "__radd__",
        "__sub__",
        "__rsub__",
        "__mul__",
        "__rmul__",
        "__truediv__",
        "__rtruediv__",
        "add",
        "sub",
        "mul",
        "div",
        "add_",
        "sub_",
        "mul_",
        "div_",
    )
} | {torch.add, torch.sub, torch.mul, torch.div, torch.maximum, torch.minimum}


class _DenseZeroTangents(TorchFunctionMode):
    """Inside a tangent solve: the operand without a tangent of a binary operation with a dual one gets a dense
    zero tangent (a Python number becomes a 0-d tensor of the dual operand's dtype, the value it is cast to anyway),
    so the result's value and tangent are the same and cheaper to compute."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BINARY and len(args) == 2:
            a, b = args
            if _dual(a) and not _dual(b):
                args = (a, _zero_dual(b, a))
            elif _dual(b) and not _dual(a) and not func.__name__.endswith("_"):
                args = (_zero_dual(a, b), b)
        return func(*args, **kwargs)


def dense_zero_tangents() -> TorchFunctionMode:
    """The mode of a tangent solve (:class:`_DenseZeroTangents`)."""
    return _DenseZeroTangents()


def _dual(x: object) -> bool:
    return isinstance(x, torch.Tensor) and fwAD.unpack_dual(x).tangent is not None


def _zero_dual(x: object, like: torch.Tensor) -> object:
    if isinstance(x, float):
        x = torch.tensor(x, dtype=like.dtype, device=like.device)
    elif not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return x
    return fwAD.make_dual(x, torch.zeros_like(x))


def dual_solve(
    solve: Callable[[torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    inputs: Mapping[int, torch.Tensor],
    tangents: Mapping[int, torch.Tensor],
    slots: Slots,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``solve(y0)`` in tangent mode: every tensor of ``inputs`` (by identity; ``y0`` may be one) detached, those
    of ``tangents`` made dual with their tangent. Returns the solution and its tangent (zeros where it has
    none)."""
    with fwAD.dual_level(), torch.enable_grad():
        values = {
            key: fwAD.make_dual(x.detach(), tangents[key]) if key in tangents else x.detach()
            for key, x in inputs.items()
        }
        start = values.get(id(y0), y0.detach())
        with swapped(slots, values), _DenseZeroTangents():
            out = solve(start)
        primal, tangent = fwAD.unpack_dual(out)
        primal = primal.clone()
        tangent = torch.zeros_like(primal) if tangent is None else tangent.clone()
    return primal, tangent
