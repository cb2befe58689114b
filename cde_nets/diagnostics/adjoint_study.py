r"""Discrete versus continuous adjoints (Chen et al. 2018): one table of gradient error, NFE, time and memory.

Three ways to the gradient of ``loss(y(T))`` with respect to the field's parameters:

- ``adjoint``: the continuous adjoint (R §2.1; ``ODEBlock(gradient="adjoint")``, torchdiffeq's
  ``odeint_adjoint``): ``da/dt = −a ∂F/∂y`` solved backwards, ``dL/dθ = ∫ a ∂F/∂θ dt``.
- ``backprop``: backpropagation through the solver's steps (``gradient="backprop"``): the exact gradient of
  the numerical (adaptive or fixed-step) map, i.e. the discrete adjoint of the solver.
- ``discrete``: the discrete-mode net (one scheme step per parameter piece, the architecture map), differentiated by
  autograd: the gradient of the network itself, which differs from the ODE's gradient by the scheme's error.

Each row's ``rel_grad_error`` is ``‖g − g_ref‖ / ‖g_ref‖`` against backprop through dopri5 at ``rtol 1e-10``
in float64 (configurable), with the step sizes held on their mesh (``Backprop(steps="fixed")``): the discrete
adjoint of that mesh converges to the ODE's gradient with the tolerance, while the derivative of the step sizes
adds terms that need not (rk4 at 1024 steps reads 3.7e-9 from the fixed-mesh reference, 2.2e-8 from the
differentiated one). NFE come from each call's ``Solution.stats`` (for ``discrete``: field evaluations, a
half field ``evaluate_part`` counting ½; its backward does one VJP per evaluation). Memory is the peak of bytes
saved for backward over the forward pass (:class:`~cde_nets.diagnostics.memory.SavedTensorMemory`, which says why not
``getrusage``); time is the median over ``repeat`` forward+backward runs.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from cde_nets.blocks.ode import ODEBlock
from cde_nets.blocks.solution import Solution
from cde_nets.fields.pieces import TimeGrid
from cde_nets.solvers.errors import SolverError, check_positive_int
from cde_nets.solvers.gradients import Backprop, GradientMethod, as_gradient
from cde_nets.solvers.options import ADAPTIVE_METHODS, FIXED_METHODS, REVERSIBLE_METHODS

from .memory import SavedTensorMemory

__all__ = ["adjoint_study", "markdown_table", "discrete_forward"]


def discrete_forward(field: nn.Module, scheme: str, y0: torch.Tensor) -> torch.Tensor:
    """``y_L`` of the discrete-mode net ``discretize(field, scheme)``: one ``scheme`` step per piece (the architecture
    map)."""
    from cde_nets.blocks.discrete import discretize

    return discretize(field, scheme)(y0)


class _CountEvaluations:
    """Counts outermost ``evaluate`` (1) and ``evaluate_part``/``evaluate_half`` (½) calls on a field instance."""

    def __init__(self, field: nn.Module):
        self.field, self.count, self._depth = field, 0.0, 0

    def _call(self, fn, weight: float, *args):
        if self._depth == 0:
            self.count += weight
        self._depth += 1
        try:
            return fn(*args)
        finally:
            self._depth -= 1

    def __enter__(self) -> _CountEvaluations:
        f = self.field
        for name, weight in (("evaluate", 1.0), ("evaluate_part", 0.5), ("evaluate_half", 0.5)):
            fn = getattr(f, name)
            f.__dict__[name] = lambda *args, _fn=fn, _w=weight: self._call(_fn, _w, *args)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in ("evaluate", "evaluate_part", "evaluate_half"):
            self.field.__dict__.pop(name, None)


def _split_batch(batch) -> tuple[torch.Tensor, tuple]:
    if isinstance(batch, torch.Tensor):
        return batch, ()
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0], tuple(batch[1:])
    raise TypeError("`batch` must be a tensor y0 or a tuple (y0, *extra) whose extras are passed to `loss_fn`.")


def _gradient(field: nn.Module, forward: Callable[[], torch.Tensor], loss_fn, extra, y0) -> tuple:
    params = [p for p in field.parameters() if p.requires_grad]
    tracker = SavedTensorMemory(exclude=[*params, y0, *[e for e in extra if isinstance(e, torch.Tensor)]])
    with tracker:
        out = forward()
    loss = loss_fn(out, *extra)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    g = torch.cat([(torch.zeros_like(p) if gi is None else gi).flatten() for p, gi in zip(params, grads)])
    return g.detach(), float(loss.detach()), tracker.peak_bytes


def _timed(field, forward, loss_fn, extra, repeat: int) -> float:
    params = [p for p in field.parameters() if p.requires_grad]
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.autograd.grad(loss_fn(forward(), *extra), params, allow_unused=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _block_runs(block: ODEBlock, y0: torch.Tensor) -> tuple[Callable[[], torch.Tensor], Callable[[], dict]]:
    """A study row's forward and statistics callables, bound to this block (not to a loop variable); the
    statistics are those of the last forward's solution (its backward counts fill in when it is differentiated)."""
    last: list[Solution] = []

    def forward() -> torch.Tensor:
        last[:] = [block.solve(y0)]
        return last[0].y

    return forward, (lambda: last[-1].stats.as_dict())


def _counted_stats(counter: _CountEvaluations) -> Callable[[], dict]:
    """A discrete row's statistics: the field evaluations counted in its forward pass (the backward does one
    VJP per evaluation)."""
    return lambda: {"nfe_forward": counter.count, "nfe_backward": counter.count}


def adjoint_study(
    model_factory_or_field: nn.Module | Callable[[], nn.Module],
    batch: torch.Tensor | tuple,
    loss_fn: Callable[..., torch.Tensor],
    tolerances: Sequence[float] = (1e-3, 1e-6, 1e-9),
    steps: Sequence[int] = (),
    methods: Sequence[str] = ("dopri5",),
    gradients: Sequence[str | GradientMethod] = ("adjoint", "backprop"),
    schemes: Sequence[str] | None = None,
    reference: dict | None = None,
    dtype: torch.dtype = torch.float64,
    repeat: int = 1,
    keep_gradients: bool = False,
) -> dict:
    """Gradient by continuous adjoint, backprop through the solver, and the discrete net, against a reference.

    Args:
        model_factory_or_field: a field (copied, not modified) or a callable returning one.
        batch: ``y0`` ``(batch, n)`` or ``(y0, *extra)``; ``loss_fn(y_T, *extra) -> scalar``.
        tolerances: ``rtol = atol`` values for the adaptive ``methods``.
        steps: total fixed steps over ``[0, T]`` for the fixed-step ``methods`` (``step_size = T/steps``).
        methods: torchdiffeq methods, adaptive ones run over ``tolerances``, fixed ones over ``steps``.
        gradients: continuous gradient methods, objects or short names (``adjoint``, ``backprop``,
            ``checkpoint``, ``symplectic``, ``reversible``, or any registered in
            :data:`~cde_nets.solvers.gradients.GRADIENTS`); a pairing with a method the gradient method does not
            serve (``reversible`` needs ``alf``, ``checkpoint`` and ``symplectic`` a tableau method) gives no row.
        schemes: discrete-mode schemes (one row each); default ``euler`` plus ``symplectic_euler`` for split fields.
        reference: ``dict(method="dopri5", rtol=1e-10, atol=1e-10)``; always backprop with the step sizes held
            fixed, in float64.
        dtype: dtype of the study's rows.
        repeat: forward+backward runs timed per row (median).
        keep_gradients: add each row's flat gradient (``grad``, a tensor) and the reference's.
    Returns:
        ``{"reference": {...}, "rows": [...]}``; each row has ``mode``, ``method``, ``rtol``, ``steps``,
        ``rel_grad_error``, ``loss``, ``nfe_forward``, ``nfe_backward``, ``time_s``, ``peak_saved_bytes``, and
        ``error`` (the message) instead of numbers when the solver failed.
    """
    base = model_factory_or_field() if not isinstance(model_factory_or_field, nn.Module) else model_factory_or_field
    grads, ref_cfg = _check_study(base, methods, gradients, steps, repeat, reference)
    y0, extra = _split_batch(batch)
    if schemes is None:
        schemes = ["euler"] + (["symplectic_euler"] if getattr(base, "split", None) is not None else [])
    g_ref, loss_ref, ref_stats = _reference_gradient(base, y0, extra, loss_fn, ref_cfg)

    field = copy.deepcopy(base).to(dtype)
    yd = y0.detach().to(dtype)
    extra_d = tuple(e.to(dtype) if isinstance(e, torch.Tensor) and e.is_floating_point() else e for e in extra)
    rows = []

    def record(row: dict, forward: Callable[[], torch.Tensor], stats: Callable[[], dict]) -> None:
        try:
            g, loss, peak = _gradient(field, forward, loss_fn, extra_d, yd)
            st = stats()
            t = _timed(field, forward, loss_fn, extra_d, repeat)
        except SolverError as exc:
            rows.append({**row, "error": str(exc)})
            return
        err = float((g.to(torch.float64) - g_ref).norm() / g_ref.norm().clamp_min(1e-300))
        measured = {"rel_grad_error": err, "loss": loss, "nfe_forward": st["nfe_forward"]}
        measured |= {"nfe_backward": st["nfe_backward"], "time_s": t, "peak_saved_bytes": peak}
        rows.append({**row, **measured, **({"grad": g} if keep_gradients else {})})

    _continuous_rows(field, yd, methods, tolerances, steps, grads, record)
    _discrete_rows(field, yd, schemes, record)
    reference_row = {**ref_cfg, "mode": "backprop", "dtype": "float64", "loss": loss_ref}
    reference_row |= {"nfe_forward": ref_stats["nfe_forward"], "grad_norm": float(g_ref.norm())}
    return {"reference": {**reference_row, **({"grad": g_ref} if keep_gradients else {})}, "rows": rows}


Record = Callable[[dict, Callable[[], torch.Tensor], Callable[[], dict]], None]


def _check_study(
    base: nn.Module,
    methods: Sequence[str],
    gradients: Sequence[str | GradientMethod],
    steps: Sequence[int],
    repeat: int,
    reference: dict | None,
) -> tuple[list[GradientMethod], dict]:
    """The study's arguments checked: the gradient methods as objects and the reference's settings."""
    if not isinstance(base, nn.Module) or not hasattr(base, "grid"):
        raise TypeError("`model_factory_or_field` must be a Field (with a time grid) or a callable returning one.")
    for m in methods:
        if m not in ADAPTIVE_METHODS and m not in FIXED_METHODS and m not in REVERSIBLE_METHODS:
            raise ValueError(
                f"`methods` has unknown {m!r}; adaptive: {sorted(ADAPTIVE_METHODS)}, fixed: {sorted(FIXED_METHODS)}, "
                f"reversible: {sorted(REVERSIBLE_METHODS)}."
            )
    grads = [as_gradient(g) for g in gradients]
    for s_ in steps:
        check_positive_int("steps", s_, "total fixed steps over [0, T]")
    check_positive_int("repeat", repeat)
    ref_cfg = {"method": "dopri5", "rtol": 1e-10, "atol": 1e-10, **(reference or {})}
    unknown = set(ref_cfg) - {"method", "rtol", "atol", "dtype"}
    if unknown:
        raise ValueError(f"`reference` has unknown keys {sorted(unknown)}; use method, rtol, atol.")
    ref_cfg.pop("dtype", None)
    return grads, ref_cfg


def _reference_gradient(
    base: nn.Module, y0: torch.Tensor, extra: tuple, loss_fn: Callable[..., torch.Tensor], ref_cfg: dict
) -> tuple[torch.Tensor, float, dict]:
    """The reference: backprop through ``ref_cfg``'s solve with the step sizes held fixed, in float64."""
    field64 = copy.deepcopy(base).to(torch.float64)
    y64 = y0.detach().to(torch.float64)
    extra64 = tuple(e.to(torch.float64) if isinstance(e, torch.Tensor) and e.is_floating_point() else e for e in extra)
    ref_block = ODEBlock(field64, gradient=Backprop(steps="fixed"), **ref_cfg)
    ref_forward, ref_counts = _block_runs(ref_block, y64)
    g_ref, loss_ref, _ = _gradient(field64, ref_forward, loss_fn, extra64, y64)
    return g_ref, loss_ref, ref_counts()


def _continuous_rows(
    field: nn.Module,
    yd: torch.Tensor,
    methods: Sequence[str],
    tolerances: Sequence[float],
    steps: Sequence[int],
    grads: list[GradientMethod],
    record: Record,
) -> None:
    """One row per method, tolerance (adaptive) or step count (fixed), and gradient method that serves it."""
    grid = cast(TimeGrid, field.grid)  # checked above (hasattr); nn.Module types attributes as Tensor | Module
    T = grid.T
    for method in methods:
        settings: list[dict[str, Any]] = (
            [{"rtol": r, "atol": r} for r in tolerances]
            if method in ADAPTIVE_METHODS
            else [{"step_size": T / s} for s in steps]
        )
        for cfg in settings:
            for gradient in grads:
                if not gradient.supports(method):
                    continue  # a pairing the block refuses by name (e.g. reversible needs alf): no row
                block = ODEBlock(field, method=method, gradient=gradient, **cfg)
                row = {
                    "mode": gradient.describe(),
                    "method": method,
                    "rtol": cfg.get("rtol"),
                    "steps": round(T / cfg["step_size"]) if "step_size" in cfg else None,
                }
                record(row, *_block_runs(block, yd))


def _discrete_rows(field: nn.Module, yd: torch.Tensor, schemes: Sequence[str], record: Record) -> None:
    """One row per discrete-mode scheme: the discrete net's own gradient (one layer per piece)."""
    grid = cast(TimeGrid, field.grid)
    for scheme in schemes:
        counter = _CountEvaluations(field)

        def forward(scheme=scheme, counter=counter):
            counter.count = 0.0
            with counter:
                return discrete_forward(field, scheme, yd)

        record({"mode": "discrete", "method": scheme, "rtol": None, "steps": grid.L}, forward, _counted_stats(counter))


def markdown_table(study: dict) -> str:
    """The study's rows as a markdown table."""
    head = "| mode | method | rtol | steps | rel. grad error | NFE fwd | NFE bwd | time ms | peak saved KiB |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in study["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['mode']} | {r['method']} | {r['rtol']} | {r['steps']} | failed: {r['error'][:60]} | | | | |"
            )
            continue
        rtol = "" if r["rtol"] is None else f"{r['rtol']:.0e}"
        steps = "" if r["steps"] is None else str(r["steps"])
        lines.append(
            f"| {r['mode']} | {r['method']} | {rtol} | {steps} | {r['rel_grad_error']:.2e} | "
            f"{r['nfe_forward']:g} | {r['nfe_backward']:g} | {1e3 * r['time_s']:.1f} | "
            f"{r['peak_saved_bytes'] / 1024:.0f} |"
        )
    return "\n".join(lines)
