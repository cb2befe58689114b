"""Counting the solver's work: :class:`SolverStats`, and the wrapper every solve calls the field through.

torchdiffeq reports no evaluation counts and signals step-size underflow or too many steps with bare
``assert``s. :class:`Counted` wraps the field: it counts evaluations, and its torchdiffeq callbacks
(``callback_step`` and friends, forward and adjoint) count accepted/rejected steps and raise
:class:`~solvers.errors.SolverError` with the NFE so far before torchdiffeq's own assertion would fire — in the
forward solve and in the adjoint's backward solve alike.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from .errors import BACKWARD_UNSTABLE, Reason, SolverError

__all__ = ["Counted", "CountedAdaptive", "CountedFixed", "SolverStats", "count_evaluation", "counted"]


@dataclass
class SolverStats:
    """Counts of one call. ``nfe_backward`` counts field evaluations of the adjoint solve (``adjoint``) or the
    vector-Jacobian products through recorded evaluations (``backprop``). The checkpointed replay
    (``Checkpoint``) reports the most states it kept at once (``stored_states``) and the steps its backward pass
    recomputed from them (``recomputed_steps``, nonzero only with a ``budget``)."""

    nfe_forward: int = 0
    nfe_backward: int = 0
    steps_forward: int = 0
    rejected_forward: int = 0
    steps_backward: int = 0
    rejected_backward: int = 0
    stored_states: int = 0
    recomputed_steps: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    # read like a dict (``stats["nfe_forward"]``): a Solution's stats stay live, so backward counts appear later
    def __getitem__(self, key: str) -> int:
        if key not in self.__dataclass_fields__:
            raise KeyError(f"{key!r}; the counts are {sorted(self.__dataclass_fields__)}")
        return getattr(self, key)

    def count_vjp(self, grad: torch.Tensor) -> None:
        """A tensor hook: one vector-Jacobian product through a recorded evaluation."""
        self.nfe_backward += 1

    def keys(self):
        return self.as_dict().keys()

    def items(self):
        return self.as_dict().items()


def count_evaluation(stats: SolverStats, out: torch.Tensor, backward: bool, count_vjp: bool) -> None:
    """Count one field evaluation: of the backward solve, or of the forward one — whose vector-Jacobian product
    (``count_vjp``: backpropagation through it) then counts as one backward evaluation when autograd takes it."""
    if backward:
        stats.nfe_backward += 1
    else:
        stats.nfe_forward += 1
        if count_vjp and out.requires_grad:
            out.register_hook(stats.count_vjp)


def _finite(y) -> bool:
    """Whether a state (a tensor, or the adjoint's tuple of tensors) holds only finite values."""
    return all(bool(torch.isfinite(v).all()) for v in ((y,) if isinstance(y, torch.Tensor) else y))


def _float(x: float | torch.Tensor) -> float:
    """A time or step size as a Python float (the fast path passes floats; torchdiffeq passes 0-d tensors)."""
    return x if isinstance(x, float) else float(torch.as_tensor(x).detach())


class Counted(nn.Module):
    """Wraps a field: counts evaluations and steps, enforces ``max_steps``, turns failures into SolverError."""

    field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __init__(
        self,
        field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        stats: SolverStats,
        max_steps: int,
        count_vjp: bool,
    ):
        super().__init__()
        self.field = field
        self.stats = stats
        self.max_steps = max_steps
        self.count_vjp = count_vjp
        self.backward_phase = False
        self.scan_backward = True  # the piecewise adjoint checks its state once per interval instead
        self.backward_jumps: list[float] = []  # jump_t of an adaptive backward solve, increasing
        self.field_error: BaseException | None = None
        self.recorder: Any = None  # a solvers.gradients.replay.Recorder while a replayed forward solve runs
        self.vjp_probes: deque = deque(maxlen=32)  # (t, finite) of the backward solve's last products
        self.backward_start_finite: bool | None = None

    def __call__(self, t, y):
        # a private wrapper nobody hooks: straight to forward (nn.Module's hook dispatch costs ~1 µs an evaluation)
        return self.forward(t, y)

    def forward(self, t, y):
        try:
            out = self.field(t, y)
        except BaseException as exc:
            self.field_error = exc  # the field's own exception passes through unchanged
            raise
        count_evaluation(self.stats, out, self.backward_phase, self.count_vjp)
        if self.backward_phase:
            if isinstance(y, torch.Tensor) and y.requires_grad:  # the adjoint's vector-Jacobian product at t
                y.register_hook(partial(self._probe_vjp, t))
        elif self.recorder is not None:
            self.recorder.evaluated(out)
        return out

    def _probe_vjp(self, t, grad):
        # kept lazily (no host sync per evaluation) for the last few evaluations; read only when the backward
        # solve fails, which it does within a step of the first non-finite product
        self.vjp_probes.append((t, torch.isfinite(grad).all()))

    # torchdiffeq calls these at the start of every step (before its own assertions) and on accept/reject.
    def _check_step(self, t0, y0, dt, backward: bool):
        nfe = self.stats.nfe_backward if backward else self.stats.nfe_forward
        steps = (
            (self.stats.steps_backward + self.stats.rejected_backward)
            if backward
            else (self.stats.steps_forward + self.stats.rejected_forward)
        )
        where = "adjoint (backward) solve" if backward else "forward solve"
        if steps >= self.max_steps:
            t0f = _float(t0)
            raise SolverError(
                f"max_steps={self.max_steps} reached in the {where} at t={t0f:.6g} after {nfe} field "
                "evaluations; raise `max_steps`, loosen `rtol`/`atol`, or regularise the field (it may be stiff).",
                nfe=nfe,
                reason=Reason.MAX_STEPS,
            )
        t0f, dtf = _float(t0), _float(dt)
        if backward and self.backward_start_finite is None:  # once: did the backward solve start finite?
            self.backward_start_finite = _finite(y0)
        if backward and self.backward_jumps and isinstance(dt, torch.Tensor):  # the stepper's own: land_on_jumps
            self._clip_on_jump(t0f, dtf, dt)
        moved = (t0f - dtf != t0f) if backward else (t0f + dtf != t0f)
        if not moved or not dtf > 0:
            # a NaN/inf state or slope makes the error estimate NaN and the step collapse: name the cause
            self._check_finite(y0, t0f, nfe, where, backward)
            raise SolverError(
                f"step size underflow (dt={dtf:.3g}) in the {where} at t={t0f:.6g} after {nfe} field evaluations; "
                "the solution is blowing up or the field is stiff: loosen `rtol`/`atol`, use float64, "
                "shrink the weights, or try a fixed-step method." + (f" {BACKWARD_UNSTABLE}" if backward else ""),
                nfe=nfe,
                reason=Reason.UNDERFLOW,
            )
        # torchdiffeq asserts finiteness itself in the forward solve (caught in `integrate`); the adjoint solve's
        # state is a tuple whose failure would surface as a bare AssertionError from `backward()`, so check here.
        if backward and self.scan_backward:
            self._check_finite(y0, t0f, nfe, where, backward)

    def _check_finite(self, y0, t0f: float, nfe: int, where: str, backward: bool) -> None:
        """Raise if the state or the backward solve's vector-Jacobian products went non-finite, naming the cause:
        the products when the backward solve started from a finite state, else the state."""
        state_finite = _finite(y0)
        bad = [t for t, finite in (self.vjp_probes if backward else ()) if not bool(finite)]
        if bad and (state_finite or self.backward_start_finite):
            raise SolverError(
                f"the adjoint's backward solve turned non-finite: the vector-Jacobian product aᵀ ∂F/∂y of "
                f"the field was NaN/inf at t={_float(bad[0]):.6g} (after {nfe} backward field evaluations), "
                "though the forward solve and the gradient it started from were finite. Check the field's "
                "derivatives there (a sqrt or log at 0, a custom backward), or use gradient='backprop' to see "
                "which operation.",
                nfe=nfe,
                reason=Reason.NONFINITE_GRADIENT,
            )
        if not state_finite:
            raise SolverError(
                f"the state became non-finite (NaN/inf) in the {where} at t={t0f:.6g} after {nfe} field "
                "evaluations; lower the learning rate, tighten the tolerance, or check the inputs.",
                nfe=nfe,
                reason=Reason.NONFINITE,
            )

    def _clip_on_jump(self, t0: float, dt: float, dt_tensor: torch.Tensor) -> None:
        """torchdiffeq clips a step at a jump only when the jump lies strictly inside it; a step that ends exactly
        on one (common with equal pieces: after a clipped step of one piece the next proposal is often the same
        size) neither re-evaluates the field on the jump's far side nor moves on to the next jump, so every
        later step of the solve crosses jumps. Widening ``dt`` by a few ulps makes the solver clip it there.
        The backward solve runs in negated time ``s = −t``: the step ends at ``s = −t0 + dt``."""
        end = -t0 + dt
        k = bisect.bisect_left(self.backward_jumps, -end)
        if k == len(self.backward_jumps) or self.backward_jumps[k] != -end:
            return
        wider = dt
        while -t0 + wider <= end:
            wider = math.nextafter(wider, math.inf)
        dt_tensor.fill_(wider)

    def callback_step(self, t0, y0, dt):
        self._check_step(t0, y0, dt, backward=False)
        if self.recorder is not None:
            self.recorder.step(t0, y0, dt)

    def callback_step_adjoint(self, t0, y0, dt):
        self._check_step(t0, y0, dt, backward=True)


class CountedAdaptive(Counted):
    def callback_accept_step(self, t0, y0, dt):
        self.stats.steps_forward += 1
        if self.recorder is not None:
            self.recorder.accept(t0, y0, dt)

    def callback_reject_step(self, t0, y0, dt):
        self.stats.rejected_forward += 1
        if self.recorder is not None:
            self.recorder.reject(t0, y0, dt)

    def callback_accept_step_adjoint(self, t0, y0, dt):
        self.stats.steps_backward += 1

    def callback_reject_step_adjoint(self, t0, y0, dt):
        self.stats.rejected_backward += 1


class CountedFixed(Counted):
    def callback_step(self, t0, y0, dt):
        super().callback_step(t0, y0, dt)
        self.stats.steps_forward += 1
        if self.recorder is not None:
            self.recorder.accept(t0, y0, dt)

    def callback_step_adjoint(self, t0, y0, dt):
        super().callback_step_adjoint(t0, y0, dt)
        self.stats.steps_backward += 1


def counted(
    field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    stats: SolverStats,
    max_steps: int,
    *,
    adaptive: bool,
    count_vjp: bool,
) -> Counted:
    """The wrapper for a solve: step callbacks of an adaptive method (accept/reject) or of a fixed grid."""
    return (CountedAdaptive if adaptive else CountedFixed)(field, stats, max_steps, count_vjp)
