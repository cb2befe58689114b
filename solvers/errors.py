"""Exceptions raised by the numerical layer. Every message names the argument at fault and a fix."""

from __future__ import annotations

import difflib
import enum
import math
from collections.abc import Iterable

import torch

from .transforms import host_any, wrapped

__all__ = [
    "Reason",
    "SolverError",
    "check_finite",
    "check_positive",
    "check_positive_int",
    "check_init_std",
    "did_you_mean",
]


class Reason(enum.Enum):
    """Why a solve stopped: code branches on this, never on the message."""

    UNDERFLOW = "step size underflow"
    MAX_STEPS = "max_steps reached"
    NONFINITE = "non-finite state"
    NONFINITE_GRADIENT = "non-finite gradient"
    BACKWARD_UNSTABLE = "backward solve diverged"
    NEWTON_DIVERGED = "newton_diverged"
    NEWTON_MAX_ITERS = "newton_max_iters"
    NEWTON_SINGULAR = "newton_singular"
    NO_EVENT = "event never changed sign"
    OTHER = "other"


# What a failed time-reversed (adjoint) solve says: integrating backwards is unstable where the forward solution
# is attracting, and the exact gradients of the steps need no backward integration.
BACKWARD_UNSTABLE = (
    "The adjoint integrates the state backwards in time, where a solution that attracts forwards (a stiff or "
    "dissipative field, e.g. Van der Pol's limit cycle) diverges; gradient='checkpoint' or gradient='backprop' "
    "give the exact gradient of the forward steps without integrating backwards."
)


class SolverError(RuntimeError):
    """The solver could not finish: step-size underflow, max steps reached, or a non-finite state.

    ``nfe`` holds the number of field evaluations made before it gave up; ``reason`` is a :class:`Reason`.
    """

    def __init__(self, message: str, nfe: int | None = None, reason: Reason = Reason.OTHER):
        super().__init__(message)
        self.nfe = nfe
        self.reason = reason


def nonfinite_forward(what: str, nfe: int) -> SolverError:
    """The error of a forward solve (``what``: the method) whose state went NaN/inf, naming the fixes."""
    return SolverError(
        f"the state became non-finite (NaN/inf) in the forward solve ({what}) after {nfe} field evaluations; "
        "lower `rtol`/`atol` or the learning rate.",
        nfe=nfe,
        reason=Reason.NONFINITE,
    )


def check_positive(name: str, value: float, fix: str = "") -> float:
    """Raise ``ValueError`` unless ``value`` is a finite number > 0."""
    if isinstance(value, (str, bytes, bool)):
        raise TypeError(f"`{name}` must be a positive number, got {value!r}.")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` must be a positive number, got {value!r}.") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.{(' ' + fix) if fix else ''}")
    return v


def check_positive_int(name: str, value: object, what: str = "") -> int:
    """Raise ``ValueError`` unless ``value`` is an integer >= 1 (``bool`` is refused: ``True`` is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer{(' (' + what + ')') if what else ''}, got {value!r}.")
    return value


def check_odd_kernel_size(value: object) -> int:
    """``kernel_size`` of a same-size (zero-padded) convolution: a positive odd integer (``bool`` is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % 2 == 0:
        raise ValueError(f"`kernel_size` must be a positive odd integer (same-size padding), got {value!r}.")
    return value


def check_init_std(value: float | None) -> float | None:
    """``init_std``: ``None`` (the field's default) or a finite number >= 0 (0 starts the weights at zero)."""
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"`init_std` must be a number, got {value!r}.") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"`init_std` must be a finite number >= 0 (a standard deviation), got {value!r}.")
    return v


def check_finite(name: str, y: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``y`` holds NaN or inf, naming how many entries and the first bad sample.

    Skipped while ``torch.compile`` traces: the data-dependent branch would break the graph of every block call
    (one graph, and one C++ compilation, per break)."""
    if torch.compiler.is_compiling():
        return
    bad = ~torch.isfinite(y)
    if wrapped(y):  # under torch.vmap: read every instance, name none
        if host_any(bad):
            raise ValueError(
                f"`{name}` holds non-finite value(s) (NaN or inf) in some instance of the vmapped batch; clean the "
                "input or lower the learning rate if it came from training."
            )
        return
    if bad.any():
        n = int(bad.sum())
        first = int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0]) if y.dim() > 0 else 0
        raise ValueError(
            f"`{name}` holds {n} non-finite value(s) (NaN or inf), first in sample {first}; "
            "clean the input or lower the learning rate if it came from training."
        )


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
