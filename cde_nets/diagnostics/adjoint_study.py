r"""Every gradient method on one problem (Chen et al. 2018; Zhuang et al. 2020; Ma et al. 2021): one table of
gradient error, field evaluations, time and memory per cell.

The rows are every gradient method registered in :data:`~cde_nets.solvers.gradients.GRADIENTS` when the study runs
(a method added by one registry line appears without a change here), plus configured instances
(``gradients=registered_gradients([...])``), for every solver method and tolerance or step count; a cell the
gradient method refuses is a row with its refusal message (:meth:`GradientMethod.refusal`), never left out.
Beside them, the discrete-mode net (one scheme step per parameter piece, the architecture map), differentiated by
autograd: the gradient of the network itself, which differs from the ODE's gradient by the scheme's error.

Each row's ``rel_grad_error`` is ``‖g − g_ref‖ / ‖g_ref‖`` against backprop through dopri5 at ``rtol 1e-10``
in float64 (configurable: another method, tolerance or fixed step), with the step sizes held on their mesh
(``Backprop(steps="fixed")``): the discrete adjoint of that mesh converges to the ODE's gradient with the tolerance,
while the derivative of the step sizes adds terms that need not (rk4 at 1024 steps reads 3.7e-9 from the
fixed-mesh reference, 2.2e-8 from the differentiated one). NFE come from each call's ``Solution.stats`` (for
``discrete``: field evaluations, a half field ``evaluate_part`` counting ½; its backward does one VJP per
evaluation). Memory is the peak of bytes saved for backward over the forward pass
(:class:`~cde_nets.diagnostics.memory.SavedTensorMemory`, which says why not ``getrusage``); time is the median over
``repeat`` forward+backward runs. :func:`gradient_growth` fits the exponential rate of the gradient norm against
the horizon over studies of one chaotic problem.
"""

from __future__ import annotations

import copy
import math
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
from cde_nets.solvers.gradients import GRADIENTS, Backprop, GradientMethod, as_gradient
from cde_nets.solvers.options import ADAPTIVE_METHODS, FIXED_METHODS, OWN_FIXED_METHODS, REVERSIBLE_METHODS

from .memory import SavedTensorMemory

__all__ = ["adjoint_study", "discrete_forward", "gradient_growth", "markdown_table", "registered_gradients"]


def discrete_forward(field: nn.Module, scheme: str, y0: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """``y_L`` of the discrete-mode net ``discretize(field, scheme)``: one ``scheme`` step per piece (the architecture
    map); ``u``: the block input of a field that needs one."""
    from cde_nets.blocks.discrete import discretize

    return discretize(field, scheme)(y0, u)


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


def _block_runs(
    block: ODEBlock, y0: torch.Tensor, u: torch.Tensor | None = None
) -> tuple[Callable[[], torch.Tensor], Callable[[], dict]]:
    """A study row's forward and statistics callables, bound to this block (not to a loop variable); the
    statistics are those of the last forward's solution (its backward counts fill in when it is differentiated)."""
    last: list[Solution] = []

    def forward() -> torch.Tensor:
        last[:] = [block.solve(y0, u)]
        return last[0].y

    return forward, (lambda: last[-1].stats.as_dict())


def _counted_stats(counter: _CountEvaluations) -> Callable[[], dict]:
    """A discrete row's statistics: the field evaluations counted in its forward pass (the backward does one
    VJP per evaluation)."""
    return lambda: {"nfe_forward": counter.count, "nfe_backward": counter.count}


def registered_gradients(extra: Sequence[str | GradientMethod] = ()) -> list[GradientMethod]:
    """Every gradient method registered in :data:`~cde_nets.solvers.gradients.GRADIENTS` now (its default
    instance, in registry order), then ``extra`` (configured instances such as ``Checkpoint(steps="fixed")``)."""
    return [cls() for cls in GRADIENTS.values()] + [as_gradient(g) for g in extra]


def adjoint_study(
    model_factory_or_field: nn.Module | Callable[[], nn.Module],
    batch: torch.Tensor | tuple,
    loss_fn: Callable[..., torch.Tensor],
    tolerances: Sequence[float] = (1e-3, 1e-6, 1e-9),
    steps: Sequence[int] = (),
    methods: Sequence[str] = ("dopri5",),
    gradients: Sequence[str | GradientMethod] | None = None,
    schemes: Sequence[str] | None = None,
    reference: dict | None = None,
    repeat: int = 1,
    keep_gradients: bool = False,
    solve: dict | None = None,
) -> dict:
    """Every gradient method against a float64 reference: error, field evaluations, time and memory per cell.

    Args:
        model_factory_or_field: a field (copied, not modified) or a callable returning one; a plain
            ``nn.Module`` with ``forward(t, y)`` needs ``T``.
        batch: ``y0`` ``(batch, n)`` or ``(y0, *extra)``; ``loss_fn(y_T, *extra) -> scalar``.
        tolerances: ``rtol = atol`` values for the adaptive ``methods``.
        steps: total fixed steps over ``[0, T]`` for the fixed-step ``methods`` (``step_size = T/steps``),
            explicit, implicit (``radauIIA5``, ``gl4``, ...), compositions and ``alf``.
        methods: the solver methods, adaptive ones run over ``tolerances``, fixed ones over ``steps``.
        gradients: gradient methods, objects or short names; default (``None``): every method registered in
            :data:`~cde_nets.solvers.gradients.GRADIENTS` when the study runs (:func:`registered_gradients`).
            A cell a gradient method refuses is a row with ``refused`` (its :meth:`refusal` message). Configured
            instances beside the registered ones: ``registered_gradients([Checkpoint(steps="fixed")])``.
        schemes: discrete-mode schemes (one row each); default ``euler`` plus ``symplectic_euler`` for split
            fields, none for a plain module.
        reference: ``dict(method="dopri5", rtol=1e-10, atol=1e-10)``, also ``step_size`` and ``options``;
            always backprop with the step sizes held fixed, in float64.
        repeat: forward+backward runs timed per row (median).
        keep_gradients: add each row's flat gradient (``grad``, a tensor) and the reference's.
        solve: how every row's solve is called: ``u`` (the block input of a field that needs one, NAIS), ``T``
            (the horizon of a plain module; fields carry theirs), ``options`` (solver options, e.g.
            ``{"max_num_steps": n}``), ``dtype`` (of the rows; default float64).
    Returns:
        ``{"reference": {...}, "rows": [...]}``; every row has ``mode``, ``method``, ``rtol``, ``steps``,
        ``status`` (``"ok"``, ``"refused"``, ``"failed"``), ``rel_grad_error``, ``grad_norm``, ``loss``,
        ``nfe_forward``, ``nfe_backward``, ``time_s``, ``peak_saved_bytes`` (``None`` unless ok), and
        ``refused`` or ``error`` (the message) where the gradient method refused the cell or the solve failed (a
        ``SolverError``'s message; any other exception's type and message).
    """
    base = model_factory_or_field() if not isinstance(model_factory_or_field, nn.Module) else model_factory_or_field
    solve_cfg = _solve_settings(solve)
    T, u, dtype = solve_cfg["T"], solve_cfg["u"], solve_cfg["dtype"]
    grads, ref_cfg = _check_study(
        base, methods, registered_gradients() if gradients is None else gradients, steps, repeat, reference, T
    )
    y0, extra = _split_batch(batch)
    if schemes is None:
        split = getattr(base, "split", None) is not None
        schemes = [] if T is not None else ["euler"] + (["symplectic_euler"] if split else [])
    g_ref, loss_ref, ref_stats = _reference_gradient(base, y0, extra, loss_fn, ref_cfg, solve_cfg)

    field = copy.deepcopy(base).to(dtype)
    yd = y0.detach().to(dtype)
    extra_d = tuple(e.to(dtype) if isinstance(e, torch.Tensor) and e.is_floating_point() else e for e in extra)
    ud = None if u is None else u.detach().to(dtype)
    rows: list[dict] = []

    def record(row: dict, forward: Callable[[], torch.Tensor], stats: Callable[[], dict]) -> None:
        rows.append({**row, **_measure(field, forward, stats, loss_fn, extra_d, yd, g_ref, repeat, keep_gradients)})

    _continuous_rows(field, yd, methods, tolerances, steps, grads, record, rows, {**solve_cfg, "u": ud})
    _discrete_rows(field, yd, ud, schemes, record)
    reference_row = {**ref_cfg, "mode": "backprop (fixed steps)", "dtype": "float64", "loss": loss_ref}
    reference_row |= {"nfe_forward": ref_stats["nfe_forward"], "grad_norm": float(g_ref.norm())}
    return {"reference": {**reference_row, **({"grad": g_ref} if keep_gradients else {})}, "rows": rows}


def _solve_settings(solve: dict | None) -> dict:
    """The study's ``solve`` settings with their defaults; an unknown key raises."""
    cfg = {"T": None, "u": None, "options": None, "dtype": torch.float64}
    unknown = set(solve or {}) - set(cfg)
    if unknown:
        raise ValueError(f"`solve` has unknown keys {sorted(unknown)}; use T, u, options, dtype.")
    return cfg | (solve or {})


def _measure(field, forward, stats, loss_fn, extra, y0, g_ref, repeat: int, keep_gradients: bool) -> dict:
    """One cell's numbers, or its failure: a ``SolverError``'s message, any other exception's type and message
    (a method that breaks on one cell is shown there, not fatal to the study)."""
    try:
        g, loss, peak = _gradient(field, forward, loss_fn, extra, y0)
        st = stats()
        t = _timed(field, forward, loss_fn, extra, repeat)
    except SolverError as exc:
        return _unmeasured({}, "failed", str(exc))
    except Exception as exc:
        return _unmeasured({}, "failed", f"{type(exc).__name__}: {exc}")
    err = float((g.to(torch.float64) - g_ref).norm() / g_ref.norm().clamp_min(1e-300))
    measured = {"status": "ok", "rel_grad_error": err, "grad_norm": float(g.norm()), "loss": loss}
    measured |= {"nfe_forward": st["nfe_forward"], "nfe_backward": st["nfe_backward"]}
    measured |= {"time_s": t, "peak_saved_bytes": peak}
    return measured | ({"grad": g} if keep_gradients else {})


_MEASURES = ("rel_grad_error", "grad_norm", "loss", "nfe_forward", "nfe_backward", "time_s", "peak_saved_bytes")


def _unmeasured(row: dict, status: str, message: str) -> dict:
    """A cell without numbers: refused by its gradient method (``refused``) or failed in the solve (``error``)."""
    key = "refused" if status == "refused" else "error"
    return {**row, "status": status, **dict.fromkeys(_MEASURES), key: message}


Record = Callable[[dict, Callable[[], torch.Tensor], Callable[[], dict]], None]


def _check_study(
    base: nn.Module,
    methods: Sequence[str],
    gradients: Sequence[str | GradientMethod],
    steps: Sequence[int],
    repeat: int,
    reference: dict | None,
    T: float | None,
) -> tuple[list[GradientMethod], dict]:
    """The study's arguments checked: the gradient methods as objects and the reference's settings."""
    if not isinstance(base, nn.Module) or (T is None and not hasattr(base, "grid")):
        raise TypeError(
            "`model_factory_or_field` must be a Field (with a time grid), a module with `T` given, or a callable "
            "returning one."
        )
    known = (*ADAPTIVE_METHODS, *FIXED_METHODS, *REVERSIBLE_METHODS, *OWN_FIXED_METHODS)
    for m in methods:
        if m not in known:
            raise ValueError(
                f"`methods` has unknown {m!r}; adaptive: {sorted(ADAPTIVE_METHODS)}, fixed: {sorted(FIXED_METHODS)}, "
                f"reversible: {sorted(REVERSIBLE_METHODS)}, implicit and compositions: {sorted(OWN_FIXED_METHODS)}."
            )
    grads = [as_gradient(g) for g in gradients]
    for s_ in steps:
        check_positive_int("steps", s_, "total fixed steps over [0, T]")
    check_positive_int("repeat", repeat)
    ref_cfg = {"method": "dopri5", "rtol": 1e-10, "atol": 1e-10, **(reference or {})}
    unknown = set(ref_cfg) - {"method", "rtol", "atol", "step_size", "options", "dtype"}
    if unknown:
        raise ValueError(f"`reference` has unknown keys {sorted(unknown)}; use method, rtol, atol, step_size, options.")
    ref_cfg.pop("dtype", None)
    if "step_size" in ref_cfg:
        ref_cfg.pop("rtol"), ref_cfg.pop("atol")
    return grads, ref_cfg


def _reference_gradient(
    base: nn.Module,
    y0: torch.Tensor,
    extra: tuple,
    loss_fn: Callable[..., torch.Tensor],
    ref_cfg: dict,
    solve_cfg: dict,
) -> tuple[torch.Tensor, float, dict]:
    """The reference: backprop through ``ref_cfg``'s solve with the step sizes held fixed, in float64."""
    field64 = copy.deepcopy(base).to(torch.float64)
    y64 = y0.detach().to(torch.float64)
    extra64 = tuple(e.to(torch.float64) if isinstance(e, torch.Tensor) and e.is_floating_point() else e for e in extra)
    u64 = None if solve_cfg["u"] is None else solve_cfg["u"].detach().to(torch.float64)
    ref_block = ODEBlock(field64, T=solve_cfg["T"], gradient=Backprop(steps="fixed"), **ref_cfg)
    ref_forward, ref_counts = _block_runs(ref_block, y64, u64)
    g_ref, loss_ref, _ = _gradient(field64, ref_forward, loss_fn, extra64, y64)
    return g_ref, loss_ref, ref_counts()


def _settings(method: str, tolerances: Sequence[float], steps: Sequence[int], T: float) -> list[dict[str, Any]]:
    """The solver settings of one method's rows: its tolerances (adaptive) or step sizes (fixed)."""
    if method in ADAPTIVE_METHODS:
        return [{"rtol": r, "atol": r} for r in tolerances]
    return [{"step_size": T / s} for s in steps]


def _continuous_rows(
    field: nn.Module,
    yd: torch.Tensor,
    methods: Sequence[str],
    tolerances: Sequence[float],
    steps: Sequence[int],
    grads: list[GradientMethod],
    record: Record,
    rows: list[dict],
    solve_cfg: dict,
) -> None:
    """One row per method, tolerance (adaptive) or step count (fixed), and gradient method; a pairing the
    gradient method refuses is a row carrying its refusal."""
    T = solve_cfg["T"] if solve_cfg["T"] is not None else cast(TimeGrid, field.grid).T
    for method in methods:
        for cfg in _settings(method, tolerances, steps, T):
            for gradient in grads:
                row = {
                    "mode": gradient.describe(),
                    "method": method,
                    "rtol": cfg.get("rtol"),
                    "steps": round(T / cfg["step_size"]) if "step_size" in cfg else None,
                }
                if not gradient.supports(method):
                    rows.append(_unmeasured(row, "refused", gradient.refusal(method)))
                    continue
                block = ODEBlock(
                    field, T=solve_cfg["T"], method=method, gradient=gradient, options=solve_cfg["options"], **cfg
                )
                record(row, *_block_runs(block, yd, solve_cfg["u"]))


def _discrete_rows(
    field: nn.Module, yd: torch.Tensor, ud: torch.Tensor | None, schemes: Sequence[str], record: Record
) -> None:
    """One row per discrete-mode scheme: the discrete net's own gradient (one layer per piece)."""
    grid = cast(TimeGrid, field.grid) if schemes else None
    for scheme in schemes:
        counter = _CountEvaluations(field)

        def forward(scheme=scheme, counter=counter):
            counter.count = 0.0
            with counter:
                return discrete_forward(field, scheme, yd, ud)

        row = {"mode": "discrete", "method": scheme, "rtol": None, "steps": cast(TimeGrid, grid).L}
        record(row, forward, _counted_stats(counter))


def markdown_table(study: dict) -> str:
    """The study's rows as a markdown table; a refused or failed cell shows its message in full."""
    head = "| mode | method | rtol | steps | rel. grad error | NFE fwd | NFE bwd | time ms | peak saved KiB |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in study["rows"]:
        rtol = "" if r["rtol"] is None else f"{r['rtol']:.0e}"
        steps = "" if r["steps"] is None else str(r["steps"])
        where = f"| {r['mode']} | {r['method']} | {rtol} | {steps} |"
        if r.get("status", "ok") != "ok":
            message = (r.get("refused") or r.get("error") or "").replace("|", "/")
            lines.append(f"{where} {r['status']}: {message} | | | | |")
            continue
        lines.append(
            f"{where} {r['rel_grad_error']:.2e} | {r['nfe_forward']:g} | {r['nfe_backward']:g} | "
            f"{1e3 * r['time_s']:.1f} | {r['peak_saved_bytes'] / 1024:.0f} |"
        )
    return "\n".join(lines)


def gradient_growth(studies: dict[float, dict], lyapunov: float | None = None) -> dict:
    r"""The gradient norm against the horizon, per gradient method, and its exponential rate.

    ``studies``: one :func:`adjoint_study` per horizon ``T`` (the same problem). For a chaotic system the
    sensitivity ``∂y(T)/∂θ`` grows like ``e^{λ₁T}`` (λ₁ the largest Lyapunov exponent; for Lorenz σ=10, ρ=28,
    β=8/3, λ₁ ≈ 0.906, Sprott 2003, "Chaos and time-series analysis", table A.1), and so does every exact
    gradient. Per mode (and for the reference) the least-squares slope of ``log ‖g‖`` against ``T`` over the
    horizons where the cell ran: ``{"lyapunov": λ₁, "reference": {...}, "modes": {mode: {"horizons", "norms",
    "errors", "rate", "messages"}}}``.
    """
    horizons = sorted(studies)
    out: dict[str, Any] = {"lyapunov": lyapunov, "horizons": horizons}
    ref_norms = [studies[T]["reference"]["grad_norm"] for T in horizons]
    out["reference"] = {"norms": ref_norms, "rate": _rate(horizons, ref_norms)}
    modes: dict[str, dict] = {}
    for T in horizons:
        for r in studies[T]["rows"]:
            m = modes.setdefault(f"{r['mode']} {r['method']}", {"horizons": [], "norms": [], "errors": []})
            m.setdefault("messages", {})
            if r.get("status", "ok") != "ok":
                m["messages"][T] = r.get("refused") or r.get("error")
                continue
            m["horizons"].append(T)
            m["norms"].append(r["grad_norm"])
            m["errors"].append(r["rel_grad_error"])
    for m in modes.values():
        m["rate"] = _rate(m["horizons"], m["norms"])
    out["modes"] = modes
    return out


def _rate(horizons: Sequence[float], norms: Sequence[float]) -> float | None:
    """Least-squares slope of ``log norm`` against the horizon (``None`` with fewer than two finite points)."""
    pts = [(T, math.log(n)) for T, n in zip(horizons, norms) if n is not None and 0 < n < math.inf]
    if len(pts) < 2:
        return None
    mt = statistics.fmean(p[0] for p in pts)
    ml = statistics.fmean(p[1] for p in pts)
    return sum((t - mt) * (l - ml) for t, l in pts) / sum((t - mt) ** 2 for t, _ in pts)
