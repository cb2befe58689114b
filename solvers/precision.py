r"""Mixed precision: the field evaluated under ``torch.autocast``, everything else in the state's dtype.

A solve of ``y' = f(t, y)`` with ``autocast=torch.bfloat16`` evaluates ``f`` as

    ``k = cast_{dtype(y)}( f_{autocast}(t, y) )``,

so the field's matrix products run in the low precision (autocast's list of ops; elementwise ops follow their
inputs) and its output is cast back to the state's dtype before the stepper sees it. The state, the stages'
combinations ``y + h Σ a_ij k_j``, the embedded error estimate and the step-size controller stay in the state's
dtype (float32). The wrapper sits beneath every gradient method, so the continuous adjoint's field evaluations and
vector-Jacobian products ``aᵀ ∂f/∂y``, ``aᵀ ∂f/∂θ`` and the replays of checkpointing run under autocast too
(autograd takes each product in the dtype its operation ran in). Celledoni, Owren, Ruthotto & Yang (2025, "Mixed
precision training of neural ODEs", arXiv 2510.23498) evaluate the field in low precision as here, and also store
the intermediate states in it, with a dynamic scaling of the adjoint; here the states stay in the state's dtype.

What cannot work is refused by name (:func:`check_autocast`, :func:`check_autocast_state`): a dtype that
``torch.autocast`` does not run on the state's device; a float64 state (autocast leaves float64 tensors alone, so
nothing would run in low precision); and a relative tolerance below :data:`MIN_RTOL` of the low precision. The
field's values then carry relative rounding ``u`` (``2⁻⁸`` for bfloat16), which enters the error estimate as a
noise of about ``h·u·|f|`` that no step size removes: the controller shrinks the steps chasing it while the
solution's error stays at the floor the rounding sets (measured in ``benchmarks/mixed_precision.py``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .transforms import under_vmap

__all__ = ["MIN_RTOL", "autocast_field", "check_autocast", "check_autocast_region", "check_autocast_state", "min_rtol"]

#: the smallest relative tolerance served under autocast, in units of the low precision's unit roundoff
#: ``u = eps / 2`` (bfloat16 2⁻⁸). Measured (dopri5, an 8-64-8 tanh MLP, benchmarks/mixed_precision.py): under
#: bfloat16 the error against float64 stays at 2.3-2.7e-3 for every rtol from 2⁻⁶ down to 2⁻¹⁴ while the
#: evaluations grow from 38 at rtol = u to 326 at 2⁻¹⁴ (float32: 26 to 32, its error falling to 1.6e-5)
MIN_RTOL = 1.0

_LOW = (torch.bfloat16, torch.float16)


def min_rtol(dtype: torch.dtype) -> float:
    """The smallest ``rtol`` served when the field runs in ``dtype``: :data:`MIN_RTOL` × its unit roundoff
    (bfloat16 ``2⁻⁸``, float16 ``2⁻¹¹``)."""
    return MIN_RTOL * torch.finfo(dtype).eps / 2


def check_autocast(dtype: Any, rtol: Any = None, name: str = "autocast", rtol_name: str = "rtol") -> Any:
    """``dtype`` (``None``: no autocast) if it is a low-precision floating dtype, else a ``ValueError`` naming
    ``name``; with ``rtol`` (a number, or a tensor of them) also refuse a tolerance below :func:`min_rtol`."""
    if dtype is None:
        return None
    if dtype not in _LOW:
        raise ValueError(
            f"`{name}`={dtype!r} is not a low-precision dtype: the field is evaluated under torch.autocast in "
            "torch.bfloat16 or torch.float16 (the state stays in its own dtype). Use one of them, or drop "
            f"`{name}` to evaluate the field in the state's dtype."
        )
    if rtol is not None:
        smallest = float(torch.as_tensor(rtol).detach().min()) if not isinstance(rtol, float | int) else float(rtol)
        floor = min_rtol(dtype)
        if smallest < floor:
            low = str(dtype).removeprefix("torch.")
            raise ValueError(
                f"`{rtol_name}`={smallest:g} is below the resolution of the field under {name}={low} (unit "
                f"roundoff {floor:.3g}): the field's rounding enters every error estimate, so the steps would "
                f"shrink chasing it and the solution would not get more accurate. Use {rtol_name} >= {floor:.3g}, "
                f"or drop `{name}`."
            )
    return dtype


_UNBATCHED_LINEAR = (
    "torch (2.13) does not apply autocast to a vmapped `nn.Linear` (its batching rule runs below autocast), so the "
    "field would silently run"
)


def check_autocast_region(y0: torch.Tensor) -> None:
    """Refuse a caller's ``torch.autocast`` region around a solve under ``torch.vmap``, as the ``autocast`` option
    is refused there: the field's ``nn.Linear`` layers would run in the state's dtype and the rest in the region's."""
    device = y0.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        raise ValueError(
            f"a torch.autocast region around a solve under torch.vmap: {_UNBATCHED_LINEAR} partly in the state's "
            "dtype. Leave the region around the vmapped call, or solve the instances as one batch (they share the "
            "field) inside the region."
        )


def check_autocast_state(dtype: Any, y0: torch.Tensor, name: str = "autocast") -> None:
    """Refuse, naming ``name`` and the fix, a state autocast cannot serve: float64 (autocast casts no float64
    tensor, so the field would silently run in float64) or complex, or a device where ``torch.autocast`` does
    not run ``dtype``."""
    if dtype is None:
        return
    if under_vmap():
        raise ValueError(
            f"`{name}`={dtype} under torch.vmap: {_UNBATCHED_LINEAR} in float32. Drop "
            f"`{name}` inside vmap, or solve the instances as one batch (they share the field) with `{name}`."
        )
    if y0.dtype == torch.float64 or y0.is_complex():
        raise ValueError(
            f"`{name}`={dtype} with a {str(y0.dtype).removeprefix('torch.')} state: torch.autocast casts only "
            "float32 tensors, so the field would run in the state's precision. Use a float32 state and field "
            f"(`.float()`), or drop `{name}`."
        )
    device = y0.device.type
    message = None
    if not torch.amp.is_autocast_available(device):
        message = f"torch.autocast does not run on device {device!r}"
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autocast(device_type=device, dtype=dtype):
                pass
        if caught:
            message = str(caught[0].message).split("\n")[-1] or str(caught[0].message)
    if message is not None:
        raise ValueError(
            f"`{name}`={dtype} cannot run on the state's device {device!r}: {message}. Use a dtype autocast "
            f"supports there (torch.bfloat16 on the CPU), or drop `{name}`."
        )


def _device(y: Any) -> str:
    return (y if isinstance(y, torch.Tensor) else y[0]).device.type


def _cast_like(out: Any, y: Any) -> Any:
    """The field's output in the state's dtype (a tuple's parts each in its own part's)."""
    if isinstance(out, torch.Tensor):
        dtype = y.dtype if isinstance(y, torch.Tensor) else y[0].dtype
        return out if out.dtype == dtype else out.to(dtype)
    parts = y if isinstance(y, tuple | list) else (y,) * len(out)
    return type(out)(o if o.dtype == p.dtype else o.to(p.dtype) for o, p in zip(out, parts))


def _evaluate(field: Callable, dtype: torch.dtype, t: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
    # without autocast's cache of weight casts: inside a caller's own autocast region the cache would outlive this
    # evaluation, every evaluation would share one low-precision copy of each weight, and backpropagation would
    # sum that weight's gradient over all of them in the low precision (a replay, run after the region, in float32)
    with torch.autocast(device_type=_device(y), dtype=dtype, cache_enabled=False):
        out = field(t, y, *args, **kwargs)
    return _cast_like(out, y)


class _Autocast:
    """``field`` evaluated under ``torch.autocast(dtype)``, its output cast back to the state's dtype; every
    other attribute (torchdiffeq's callbacks, a block's ``pieces``, ...) read from ``field``."""

    def __init__(self, field: Callable, dtype: torch.dtype):
        self.__dict__["field"], self.__dict__["autocast_dtype"] = field, dtype

    def __call__(self, t: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        return _evaluate(self.field, self.autocast_dtype, t, y, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["field"], name)


class _AutocastRows(_Autocast):
    """:class:`_Autocast` of a field that reads per-sample data for the ``rows`` it is handed."""

    def __call__(self, t: Any, y: Any, rows: Any) -> Any:
        return _evaluate(self.field, self.autocast_dtype, t, y, rows=rows)


class _AutocastModule(nn.Module):
    """:class:`_Autocast` for a module: its parameters are the field's (``func.parameters()`` still lists them)."""

    def __init__(self, field: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.field, self.autocast_dtype = field, dtype

    def forward(self, t: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        return _evaluate(self.field, self.autocast_dtype, t, y, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("field"), name)


class _AutocastRowsModule(_AutocastModule):
    """:class:`_AutocastModule` of a field that reads per-sample data for the ``rows`` it is handed."""

    def forward(self, t: Any, y: Any, rows: Any) -> Any:
        return _evaluate(self.field, self.autocast_dtype, t, y, rows=rows)


def _wants_rows(field: Callable) -> bool:
    fn = field.forward if isinstance(field, nn.Module) else field
    try:
        return "rows" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def autocast_field(field: Callable, dtype: torch.dtype | None) -> Callable:
    """``field`` evaluated under ``torch.autocast(dtype)`` with its output in the state's dtype; ``field`` itself
    when ``dtype`` is ``None``. A module stays a module (with the field's parameters), any other callable stays a
    plain callable, so the doors' rules for finding the parameters to differentiate read the same."""
    if dtype is None:
        return field
    rows = _wants_rows(field)
    if isinstance(field, nn.Module):
        return (_AutocastRowsModule if rows else _AutocastModule)(field, dtype)
    return (_AutocastRows if rows else _Autocast)(field, dtype)
