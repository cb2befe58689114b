"""The checks of a solve's inputs and of its field's first output, shared by both doors of the library: the
torchdiffeq-compatible functions (:mod:`cde_nets.functional`) and the blocks (:class:`~cde_nets.ODEBlock`), so
that the same bad input is refused by the same named error in both.

Every function here is pure: it reads its arguments, raises ``TypeError``/``ValueError`` naming the argument and
the fix, and returns the input normalised. None of them runs per step: a state, a tolerance and the times are
checked once per call, a field's or an event function's output on its first evaluation only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .transforms import host_all, host_any, physical, wrapped

__all__ = [
    "check_event_output",
    "check_field_output",
    "check_floating",
    "check_half_precision",
    "check_output_times",
    "check_state",
    "check_tolerance",
    "check_tolerances",
    "finite_times",
    "nonfinite_message",
]

State = torch.Tensor | tuple[torch.Tensor, ...]

TOLERANCE_HINT = {
    "rtol": "Typical values: 1e-3 (training) to 1e-10 (reference solutions).",
    "atol": "Typical values: 1e-4 (training) to 1e-12 (reference solutions).",
}


def check_tolerance(name: str, tol: Any, *, zero_ok: bool) -> Any:
    """A relative or absolute tolerance: a number, a tensor (one per element of the state) or, for a tuple state,
    a tuple of them; every value finite and ``> 0`` (``>= 0`` with ``zero_ok``: torchdiffeq's ``rtol=0`` asks for
    absolute error only). A number comes back as a float; one host read for a tensor."""
    if isinstance(tol, tuple | list):
        for v in tol:
            check_tolerance(name, v, zero_ok=zero_ok)
        return tol
    bound = ">= 0" if zero_ok else "> 0"
    if isinstance(tol, torch.Tensor):
        if not (tol.is_floating_point() or tol.dtype in (torch.int32, torch.int64)) or tol.numel() == 0:
            raise TypeError(f"`{name}` must be a number or a non-empty real tensor, got a {tol.dtype} tensor.")
        with torch.no_grad():
            # every instance's values under torch.vmap (per-instance tolerances), read beneath its wrappers
            values = physical(tol.detach())
            # the least and largest values in one read: NaN propagates through both
            lo, hi = torch.stack(torch.aminmax(values.reshape(-1).double())).tolist()
            if not (lo >= 0 if zero_ok else lo > 0) or not math.isfinite(hi):
                bad = ~torch.isfinite(values) | ((values < 0) if zero_ok else (values <= 0))
                first = tuple(bad.nonzero()[0].tolist())
                raise ValueError(
                    f"`{name}` must hold finite numbers {bound}, got {float(values[first]):g} at index {first}. "
                    f"{TOLERANCE_HINT.get(name, '')}".rstrip()
                )
        return tol
    if isinstance(tol, str | bytes | bool):
        raise TypeError(f"`{name}` must be a positive number, got {tol!r}.")
    try:
        v = float(tol)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` must be a positive number, got {tol!r}.") from None
    if not math.isfinite(v) or (v < 0 if zero_ok else v <= 0):
        raise ValueError(
            f"`{name}` must be a finite number {bound}, got {tol!r}. {TOLERANCE_HINT.get(name, '')}".rstrip()
        )
    return v


def check_tolerances(rtol: Any, atol: Any, *, zero_ok: bool) -> tuple[Any, Any]:
    """Both tolerances (:func:`check_tolerance`), and not both zero: the error bound ``atol + rtol·|y|`` would be
    zero, so no step of an adaptive method could be accepted (checked where both are numbers)."""
    rtol, atol = check_tolerance("rtol", rtol, zero_ok=zero_ok), check_tolerance("atol", atol, zero_ok=zero_ok)
    if isinstance(rtol, float) and isinstance(atol, float) and rtol == 0 and atol == 0:
        raise ValueError(
            "`rtol`=0 and `atol`=0 together ask for a zero error bound atol + rtol·|y|, which no step meets; "
            "give `atol` (or `rtol`) a positive value."
        )
    return rtol, atol


def check_floating(name: str, y: torch.Tensor, complex_ok: bool = False) -> None:
    """Refuse an integer or boolean state: the solve's steps and times need a floating-point dtype."""
    if y.is_floating_point() or (complex_ok and y.is_complex()):
        return
    raise TypeError(f"`{name}` must be a floating-point tensor, got {y.dtype}; call `.float()` or `.double()`.")


def check_half_precision(method: str, dtype: torch.dtype, state: str, fixed_step: str) -> None:
    """Refuse a half-precision state under an adaptive ``method``: its error norms and step times are computed
    in the state's dtype, where they overflow or cannot resolve a step."""
    if dtype in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"the adaptive method={method!r} does not support {str(dtype).removeprefix('torch.')} states: its "
            "error norms and step times are computed in the state's dtype, where they overflow or cannot resolve a "
            f"step. Use a float32/float64 {state}, or a fixed-step method (e.g. method='rk4' with {fixed_step}), "
            "which runs in half precision."
        )


def check_state(y0: Any, method: str, adaptive: bool) -> tuple[torch.Tensor, list[torch.Size] | None]:
    """The state as one flat tensor (a tuple's parts concatenated) and the parts' shapes (``None``: a tensor);
    refused, naming ``y0``, where it is not a (tuple of) floating-point or complex tensor(s), holds NaN/inf, or
    is half precision under an adaptive method."""
    if isinstance(y0, torch.Tensor):
        flat, shapes = y0, None
        check_floating("y0", y0, complex_ok=True)
    else:
        if not isinstance(y0, tuple) or not y0 or not all(isinstance(y, torch.Tensor) for y in y0):
            raise TypeError(f"`y0` must be a tensor or a tuple of tensors, got {type(y0).__name__}.")
        for k, y in enumerate(y0):
            check_floating(f"y0[{k}]", y, complex_ok=True)
        if len({y.dtype for y in y0}) > 1 or len({y.device for y in y0}) > 1:
            raise ValueError("the tensors of a tuple `y0` must share one dtype and device; cast them first.")
        flat, shapes = torch.cat([y.reshape(-1) for y in y0]), [y.shape for y in y0]
    if adaptive:
        check_half_precision(method, flat.dtype, "`y0`", "options={'step_size': ...}")
    if not torch.compiler.is_compiling():
        _check_finite_state(y0, flat, shapes)
    return flat, shapes


def _check_finite_state(y0: State, flat: torch.Tensor, shapes: list[torch.Size] | None) -> None:
    """Refuse a ``y0`` holding NaN/inf, naming the part and the first index: the solve would start from it (one
    host read)."""
    with torch.no_grad():
        bad = ~torch.isfinite(flat)
        if not host_any(bad):  # under torch.vmap: in any instance
            return
    if wrapped(flat):
        raise ValueError(
            "`y0` holds non-finite value(s) (NaN or inf) in some instance of the vmapped batch: the solve starts "
            "from it. Clean the input (or lower the learning rate if it came from training)."
        )
    parts: list[torch.Tensor] = [flat] if shapes is None else list(y0)
    for k, y in enumerate(parts):
        part_bad = ~torch.isfinite(y.detach())
        if bool(part_bad.any()):
            name = "`y0`" if shapes is None else f"`y0[{k}]`"
            first = tuple(part_bad.nonzero()[0].tolist())
            raise ValueError(
                f"{name} holds {int(part_bad.sum())} non-finite value(s) (NaN or inf), the first at index {first}: "
                "the solve starts from it. Clean the input (or lower the learning rate if it came from training)."
            )


def finite_times(name: str, t: torch.Tensor) -> None:
    """Refuse NaN/inf among the times ``t`` (detached, 1-D): a solve towards an infinite time never ends, and a
    NaN time has no place in the order (one host read)."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"`{name}` holds a non-finite time (NaN or inf): `{name}[{i}]`={float(t[i])}; every time must be a "
            "finite number (a solve to infinity never ends: integrate to a finite end time, or use an event)."
        )


def check_output_times(t: Any, device: torch.device) -> torch.Tensor:
    """torchdiffeq's times ``t``: a 1-D floating-point tensor of at least one time, finite, strictly increasing or
    strictly decreasing; returned on ``device`` (one host read for the three conditions)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or len(t) == 0 or not t.is_floating_point():
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"`t` must be a 1-D floating-point tensor of at least one time, got {got}.")
    d = t.detach()
    if wrapped(d):  # per-instance times under torch.vmap: each condition in every instance
        conditions = (torch.isfinite(d).all(), (d[1:] > d[:-1]).all(), (d[1:] < d[:-1]).all())
        finite, up, down = (host_all(c) for c in conditions)
    elif len(d) <= 64:  # one read, the comparisons on the host
        v = d.tolist()
        finite = all(math.isfinite(x) for x in v)
        up, down = all(a < b for a, b in zip(v, v[1:])), all(a > b for a, b in zip(v, v[1:]))
    else:
        checks = [torch.isfinite(d).all(), (d[1:] > d[:-1]).all(), (d[1:] < d[:-1]).all()]
        finite, up, down = torch.stack(checks).tolist()
    if not finite:
        finite_times("t", d)
    if len(d) > 1 and not (up or down):
        if wrapped(d) and host_all((d[1:] > d[:-1]).all() | (d[1:] < d[:-1]).all()):
            raise ValueError(
                "per-instance `t` under torch.vmap: every instance's times are strictly monotone, but some increase "
                "and some decrease, and one vmapped solve runs every instance the same way; split the batch by "
                "direction (one vmap call for the increasing instances, one for the decreasing), or solve the "
                "instances in a loop."
            )
        raise ValueError("`t` must be strictly increasing or strictly decreasing.")
    return t.to(device)


def check_field_output(out: Any, y: State, who: str, call: str = "F(t, y)", fix: str = "") -> None:
    """Refuse a field output ``out = F(t, y)`` that is not shaped like the state ``y`` (a tensor; or a tuple of
    tensors of the parts' sizes), naming the field (``who``), the shape expected and the shape got. ``y' = F(t, y)``
    needs ``F(t, y)`` in the state's space; a wrong shape would otherwise fail deep inside a solver's step
    arithmetic, or broadcast into a silently wrong answer. For a solve's first evaluation only."""
    if isinstance(y, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{who} returned {type(out).__name__}; {call} must return a tensor of y's shape.")
        if out.shape != y.shape:
            raise ValueError(
                f"{who} returned shape {tuple(out.shape)} for a state y of shape {tuple(y.shape)}; {call} must "
                f"return y's shape {tuple(y.shape)} (dy/dt has one entry per entry of y){fix}."
            )
        return
    if not isinstance(out, tuple | list) or len(out) != len(y) or not all(isinstance(o, torch.Tensor) for o in out):
        got = f"{type(out).__name__} of {len(out)}" if isinstance(out, tuple | list) else type(out).__name__
        raise TypeError(
            f"{who} returned {got}; for a tuple state of {len(y)} tensors {call} must return a tuple of "
            f"{len(y)} tensors, shaped like y's parts."
        )
    for k, (o, part) in enumerate(zip(out, y)):
        # torchdiffeq flattens a tuple's parts, so it takes any shape of the part's size: so does this
        if o.numel() != part.numel():
            raise ValueError(
                f"{who} returned shape {tuple(o.shape)} for part {k} of the state, of shape {tuple(part.shape)}; "
                f"{call} must return each part's shape."
            )


def check_event_output(g: Any, who: str, shape: tuple[int, ...] | None = None) -> None:
    """Refuse an event function's output ``g`` that is not a real tensor of ``shape`` (``None``: of any shape
    with at least one value: torchdiffeq's several events at once, the first to change sign ending the solve),
    naming the function (``who``). For its first evaluation only."""
    want = "a real tensor" + ("" if shape is None else f" of shape {shape} (one value per sample)")
    if not isinstance(g, torch.Tensor) or g.is_complex():
        got = f"a {g.dtype} tensor" if isinstance(g, torch.Tensor) else type(g).__name__
        raise TypeError(f"{who} returned {got}; it must return {want}, which changes sign at the event.")
    if (shape is not None and tuple(g.shape) != shape) or g.numel() == 0:
        raise ValueError(
            f"{who} returned shape {tuple(g.shape)}; it must return {want}"
            + (", which changes sign at the event." if shape is None else ", e.g. `y[:, 0] - 1` rather than y.")
        )


def nonfinite_message(t: float, evaluation: int, where: str, fix: str) -> str:
    """The message of a solve whose field first returned NaN/inf at time ``t`` on its ``evaluation``-th call."""
    return (
        f"the state became non-finite (NaN/inf) in the forward solve: the field first returned a non-finite value "
        f"at t={t:.6g}{where}, evaluation {evaluation}. The solution blows up there: {fix}"
    )
