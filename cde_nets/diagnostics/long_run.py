r"""Long-horizon conservation of a scheme on a time-invariant Hamiltonian field: energy error, its fitted secular
drift, the symplecticity defect of the step map, and Noether's ``a·F``.

A symplectic one-step method applied to ``y' = J ∇H(y)`` conserves a modified energy ``H̃ = H + O(h^p)`` over
exponentially long times, so ``|H(y_n) − H(y_0)|`` stays bounded and oscillates; a non-symplectic method's error
grows, typically linearly in ``t`` (Hairer, Lubich & Wanner 2006, "Geometric numerical integration", Thm. IX.8.1
and §X.3; Galimberti et al. 2023 for the fields). :func:`energy_error_fit` separates the two: the secular drift is
the least-squares slope of every step's error in each sample weighted by a Hann window over the run, which
averages the oscillation out before the trend is fitted; the oscillation amplitude is the error's maximum over
the first 1 % of the run. Noether (Ruseckas, eqs. R21, R24-25): for a time-invariant field the adjoint
``a_n = ∂L/∂y_n`` of the numerical flow and ``F(y_n)`` keep ``a·F`` constant along the exact flow; its drift along
the layers measures how far the discrete adjoint is from the continuous one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["step_jacobians", "energy_error_fit", "long_run_energy", "noether_drift"]


def step_jacobians(step: Callable[[torch.Tensor], torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """Each sample's Jacobian ``Φ_b = ∂ step(y)_b / ∂ y_b`` ``(B, n, n)`` of a batched map ``step`` of ``(B, n)``
    states (rows independent); pass it to :func:`~cde_nets.diagnostics.symplecticity_defect`."""
    from cde_nets.solvers.steppers.implicit import stage_jacobian

    return stage_jacobian(lambda t, x: step(x), 0.0, y)[1]


def energy_error_fit(t: Any, err: Any, window: float = 0.01) -> dict[str, float]:
    """Secular drift and oscillation of an energy error at times ``t``: ``err`` is each sample's signed error
    ``H(y_n^b) − H(y_0^b)`` ``(N, B)`` (preferred), or one error signal ``(N,)`` such as ``max_b |H(y_n^b) −
    H(y_0^b)|``. Pass every step of the run (a sparse sample of a fast oscillation aliases into noise that any fit
    reads as slope).

    ``slope``, the secular drift, is the least-squares slope against ``t`` with Hann-window weights
    ``w(t) = sin²(π (t − t_0) / (t_N − t_0))``, fitted to each sample's error, and of those the one of largest
    magnitude (the worst trajectory's drift). A linear drift ``d t`` is recovered exactly (the weights are
    symmetric), while a bounded oscillation leaves almost nothing, since the fit's kernel ``w(t) (t − t̄)`` vanishes
    smoothly at both ends instead of cutting the oscillation's first and last periods (with unit weights those
    leave a slope of order ``a P / T²`` for amplitude ``a``, period ``P`` and run length ``T``; tapered, below
    ``1e-4 a / T`` once ``T ≫ P``). Each sample is fitted on its own because one sample's error of a symplectic
    method is a smooth quasi-periodic function of ``t`` (Hairer, Lubich & Wanner 2006, Thm. X.3.1), while the
    maximum over samples is not: it switches between samples whose frequencies differ slightly, and those slow
    beats, at periods near ``T``, read as slope under any window. ``batch_max_slope`` is the same tapered fit of
    ``max_b |err_b|`` for comparison, ``pointwise_slope`` its unit-weight fit. From ``max_b |err_b|`` also:
    ``amplitude`` (its maximum over the first ``window`` of the run), ``max``, ``ratio = max / amplitude``
    (bounded, ≈ 1–10, for a symplectic method; growing with the run for one with drift) and ``final``."""
    t, err = np.asarray(t, dtype=float), np.asarray(err, dtype=float)
    if t.ndim != 1 or err.ndim not in (1, 2) or err.shape[0] != t.shape[0] or t.size < 3:
        raise ValueError(
            f"`t` must be 1-d of length >= 3 and `err` (N,) or (N, B) with N = len(t); got {t.shape} and {err.shape}."
        )
    per_sample = err if err.ndim == 2 else err[:, None]
    top_err = np.abs(per_sample).max(1)
    span = t[-1] - t[0]
    early = top_err[t <= t[0] + window * span]
    amp = float(early.max()) if early.size else float(top_err[0])
    taper = np.sin(np.pi * (t - t[0]) / span)  # polyfit squares its weights: sin² = Hann
    slopes = np.polyfit(t, per_sample, 1, w=taper)[0]
    top = float(top_err.max())
    return {
        "slope": float(slopes[np.argmax(np.abs(slopes))]),
        "batch_max_slope": float(np.polyfit(t, top_err, 1, w=taper)[0]),
        "pointwise_slope": float(np.polyfit(t, top_err, 1)[0]),
        "amplitude": amp,
        "max": top,
        "ratio": top / amp if amp > 0 else math.inf,
        "final": float(top_err[-1]),
    }


def _bound(field: Any, scheme: Any) -> tuple[Any, Any]:
    from cde_nets.fields.bound import BoundField
    from cde_nets.solvers.schemes import get_scheme

    if getattr(field, "grid", None) is not None and field.grid.L != 1:
        raise ValueError(
            f"the long-run study needs a time-invariant field (one parameter piece); this one has {field.grid.L}. "
            "Build it with layers=1."
        )
    return BoundField(field), get_scheme(scheme).for_field(field)


def long_run_energy(
    field: Any, scheme: Any, y0: torch.Tensor, h: float, steps: int, samples: int = 200
) -> dict[str, Any]:
    """Run ``steps`` steps of ``scheme`` (a name or :class:`~cde_nets.solvers.schemes.Scheme`) of size ``h`` on the
    one-piece Hamiltonian ``field`` from ``y0``, recording ``max_b |H(y_n) − H(y_0)|`` after every step. Returns
    ``t`` and ``error`` at about ``samples`` log-spaced and ``samples`` equally spaced steps (for plots), ``nfe``
    (field evaluations, Newton iterations included), ``wall_s`` (the steps alone) and, as ``fit``, the
    :func:`energy_error_fit` of every step's error in every sample (kept on ``y0``'s device: ``steps × batch``
    values)."""
    f, sch = _bound(field, scheme)
    uniform = {int(round(x)) for x in np.linspace(steps / samples, steps, samples)} - {0}
    marks = sorted({int(round(x)) for x in np.geomspace(1, steps, samples)} | uniform | {steps})
    E0 = field.energy(0.0, y0)
    errors = torch.empty(steps, len(y0), dtype=y0.dtype, device=y0.device)
    state, nfe, wall = sch.init(y0), 0, 0.0
    with torch.no_grad():
        for n in range(steps):
            start = time.perf_counter()
            state = sch.step(f, 0, state, h, None, 0.0)
            wall += time.perf_counter() - start
            nfe += sch.evaluations(0)
            errors[n] = field.energy(0.0, sch.readout(state)) - E0
    signed = errors.cpu().numpy()
    err = np.abs(signed).max(1)
    t = h * np.arange(1, steps + 1)
    return {
        "t": [float(t[n - 1]) for n in marks],
        "error": [float(err[n - 1]) for n in marks],
        "nfe": nfe,
        "wall_s": wall,
        "fit": energy_error_fit(t, signed),
    }


def noether_drift(field: Any, scheme: Any, y0: torch.Tensor, h: float, steps: int) -> float:
    """``max_{n, b} |a_n·F(y_n) − a_N·F(y_N)| / max_b |a_N·F(y_N)|`` along ``steps`` steps of ``scheme``, with
    ``a_n = ∂L/∂y_n`` the discrete adjoint of ``L = Σ y_N`` (constant for the exact flow of a time-invariant
    field: Noether, Ruseckas eqs. R24-25)."""
    f, sch = _bound(field, scheme)
    with torch.no_grad():
        states = [sch.init(y0.detach())]
        for _ in range(steps):
            states.append(sch.step(f, 0, states[-1], h, None, 0.0))
    # each step re-rooted at its own input: autograd's derivative with respect to an intermediate tensor would
    # also count that tensor's uses inside the step that made it (a split scheme's last half step reads the new q)
    a = tuple(torch.ones_like(x) for x in states[-1])
    with torch.no_grad():
        af = [(sch.readout(a) * field(0.0, sch.readout(states[-1]))).sum(1)]
    for st in reversed(states[:-1]):
        with torch.enable_grad():
            x = tuple(v.detach().requires_grad_(True) for v in st)
            out = sch.step(f, 0, x, h, None, 0.0)
            g = torch.autograd.grad(out, x, a, allow_unused=True)
        a = tuple(torch.zeros_like(v) if gv is None else gv for v, gv in zip(x, g))
        with torch.no_grad():
            af.append((sch.readout(a) * field(0.0, sch.readout(st))).sum(1))
    aF = torch.stack(af)
    return float((aF - aF[-1]).abs().max() / aF[-1].abs().max())
