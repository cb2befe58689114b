"""Pattern-dependent stopping depth: each sample stops on its own, and a stopped sample stops costing compute.

The batch is compacted with index operations (never masked), so the field evaluates ``Σ depths`` rows in all
instead of ``batch × max_depth`` (SPEC §4, N §5.3). Gradients flow through each sample's final state; the
stopping index is not differentiated. torchdiffeq's event handling would stop the whole batch at the first
event, which is why continuous stopping runs its own window loop here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import check_positive

__all__ = ["unroll", "integrate_until_converged"]

State = tuple[torch.Tensor, ...]


def _check(eps: float, max_depth: int, name: str = "max_depth") -> None:
    check_positive("eps", eps, "It is the per-sample convergence threshold, e.g. 1e-4.")
    if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth <= 0:
        raise ValueError(f"`{name}` must be a positive integer, got {max_depth!r}.")


def _per_sample_norm(d: torch.Tensor) -> torch.Tensor:
    return d.reshape(d.shape[0], -1).norm(dim=1)


def _assemble(parts: list[tuple[torch.Tensor, State]], batch: int) -> State:
    """Put per-group final states back in batch order (differentiable: a cat and one gather)."""
    idx = torch.cat([i for i, _ in parts])
    order = torch.empty_like(idx)
    order[idx] = torch.arange(batch, device=idx.device)
    n = len(parts[0][1])
    return tuple(torch.cat([s[c] for _, s in parts])[order] for c in range(n))


def unroll(step: Callable[[int, State, torch.Tensor], State], state0: State | torch.Tensor, *, eps: float,
           max_depth: int, readout: Callable[[State], torch.Tensor] | None = None) -> tuple[State, torch.Tensor]:
    """Iterate ``state ← step(i, state, idx)`` per sample until ``‖readout(x_i) − readout(x_{i−1})‖ < eps``.

    ``state0`` is a tensor or a tuple of tensors with the batch first; ``step`` receives only the rows still
    running and ``idx``, their rows in the original batch. Returns the final states (batch order, a tuple if
    ``state0`` was one) and the per-sample depth (number of steps taken, ``<= max_depth``).
    """
    _check(eps, max_depth)
    single = isinstance(state0, torch.Tensor)
    cur: State = (state0,) if single else tuple(state0)
    read = readout or (lambda s: s[0])
    batch = cur[0].shape[0]
    device = cur[0].device
    idx = torch.arange(batch, device=device)
    depths = torch.full((batch,), max_depth, dtype=torch.long, device=device)
    parts: list[tuple[torch.Tensor, State]] = []
    for i in range(max_depth):
        nxt = step(i, cur if not single else cur, idx)
        nxt = (nxt,) if isinstance(nxt, torch.Tensor) else tuple(nxt)
        with torch.no_grad():
            done = _per_sample_norm(read(nxt) - read(cur)) < eps
        cur = nxt
        if bool(done.any()):
            depths[idx[done]] = i + 1
            parts.append((idx[done], tuple(t[done] for t in cur)))
            keep = ~done
            idx, cur = idx[keep], tuple(t[keep] for t in cur)
        if idx.numel() == 0:
            break
    if idx.numel():
        parts.append((idx, cur))
    final = _assemble(parts, batch)
    return (final[0] if single else final), depths


def integrate_until_converged(
    solve: Callable[[torch.Tensor, float, float, torch.Tensor], torch.Tensor],
    field: Callable[[float, torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor, *, t_max: float, window: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integrate per sample until ``‖F(t, y)‖ < eps`` (checked at the end of each window), up to ``t_max``.

    ``solve(y, t0, t1, idx)`` integrates the active rows ``idx`` from ``t0`` to ``t1`` (any torchdiffeq method);
    ``field(t, y, idx)`` evaluates ``F`` on them. Returns the final states and the per-sample stopping times
    (resolution ``window``; ``t_max`` for samples that never converge).
    """
    check_positive("t_max", t_max)
    check_positive("window", window, "It is the interval between convergence checks.")
    check_positive("eps", eps, "It is the per-sample threshold on ‖F(t, y)‖.")
    batch = y0.shape[0]
    idx = torch.arange(batch, device=y0.device)
    times = torch.full((batch,), float(t_max), dtype=torch.float64)
    parts: list[tuple[torch.Tensor, State]] = []
    cur, t = y0, 0.0
    while t < t_max * (1 - 1e-12) and idx.numel():
        t1 = min(t + window, t_max)
        cur = solve(cur, t, t1, idx)
        with torch.no_grad():
            done = _per_sample_norm(field(t1, cur, idx)) < eps
        if bool(done.any()):
            times[idx[done].cpu()] = t1
            parts.append((idx[done], (cur[done],)))
            idx, cur = idx[~done], cur[~done]
        t = t1
    if idx.numel():
        parts.append((idx, (cur,)))
    return _assemble(parts, batch)[0], times
