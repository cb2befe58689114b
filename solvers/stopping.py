"""Pattern-dependent stopping depth: each sample stops on its own, and a stopped sample stops costing compute.

Ciccone et al. (N §5.3): unroll each sample until ``‖x(i) − x(i−1)‖ < ε``, up to a maximum depth; the continuous
analogue stops a sample once ``‖F(t, x)‖ < ε``. The batch is compacted with index operations (never masked),
so a discrete unroll evaluates ``Σ depths`` rows in all instead of ``batch × max_depth``. Gradients flow
through each sample's final state (a differentiable gather); the stopping index itself is not differentiated.

torchdiffeq's ``event_fn`` ends the solve of the *whole* batch at the first event, so continuous stopping runs
its own loop over windows here, removing converged rows between windows.

This module is numerical only: the caller passes callables (a step, a field on the active rows), so per-sample
data bound to a model (e.g. a block input ``u``) is restricted to the active rows by the caller via ``idx``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .errors import check_positive

__all__ = ["unroll", "per_sample_norm"]

State = tuple[torch.Tensor, ...]
StateLike = Any  # a tensor or a tuple of tensors, batch first


def per_sample_norm(d: torch.Tensor) -> torch.Tensor:
    """Euclidean norm of each sample: ``(batch, ...) -> (batch,)``."""
    return torch.linalg.vector_norm(d, dim=1 if d.dim() == 2 else tuple(range(1, d.dim())))


def _check_eps(eps: float, what: str) -> float:
    return check_positive("eps", eps, f"It is the per-sample convergence threshold on {what}, e.g. 1e-4.")


def _check_max_depth(max_depth: int) -> int:
    if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth <= 0:
        raise ValueError(
            f"`max_depth` must be a positive integer (the most steps a sample may take), got {max_depth!r}."
        )
    return max_depth


def _assemble(parts: list[tuple[torch.Tensor, State]], batch: int) -> State:
    """Put the per-group final states back in batch order (differentiable: a cat and a gather per tensor)."""
    idx = torch.cat([i for i, _ in parts])
    order = torch.empty_like(idx)
    order[idx] = torch.arange(batch, device=idx.device)
    return tuple(torch.cat([s[c] for _, s in parts])[order] for c in range(len(parts[0][1])))


def _as_state(state0: StateLike) -> State:
    """``state0`` as a tuple of tensors sharing the batch size (a tensor: a tuple of one)."""
    cur: State = (state0,) if isinstance(state0, torch.Tensor) else tuple(state0)
    if not cur:
        raise ValueError("`state0` is an empty tuple; pass a tensor or a tuple of tensors (batch first).")
    batch = cur[0].shape[0]
    if any(t.shape[0] != batch for t in cur):
        raise ValueError(f"`state0` tensors must share the batch size, got {[t.shape[0] for t in cur]}.")
    return cur


def unroll(
    step: Callable[[int, StateLike, torch.Tensor], StateLike],
    state0: StateLike,
    *,
    eps: float,
    max_depth: int,
    readout: Callable[[StateLike], torch.Tensor] | None = None,
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    done: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    converged: torch.Tensor | None = None,
) -> tuple[StateLike, torch.Tensor]:
    """Iterate ``state ← step(i, state, idx)`` per sample until the read-out stops moving:
    ``norm(readout(x(i)) − readout(x(i−1))) < eps``.

    Args:
        step: ``step(i, state, idx) -> next state`` for step ``i = 0, 1, ...``; it receives only the
            rows still running (``state`` in the form of ``state0``: a tensor or a tuple of tensors, batch
            first) and ``idx``, their rows in the original batch (``(n_active,)`` long), to restrict
            per-sample data.
        state0: the initial state, a tensor or a tuple of tensors whose first dimension is the batch.
        eps: per-sample threshold (> 0) on the change of the read-out between consecutive steps.
        max_depth: the most steps any sample takes (> 0).
        readout: the part of the state whose change is measured; default the state itself (its first tensor
            when the state is a tuple).
        norm: per-sample norm, ``(n, ...) -> (n,)``; default Euclidean over all non-batch dimensions.
        done: instead of the ``eps`` rule, ``done(i, readout before, readout after, idx) -> (n_active,)`` bool:
            which of the active rows stop after step ``i`` (per-sample events on the layer index).
        converged: a ``(batch,)`` bool tensor, filled in place: True where the sample met the test, False where
            it took ``max_depth`` steps without (a depth of ``max_depth`` alone does not tell them apart).

    Returns:
        ``(final, depths)``: the final states in batch order (same form as ``state0``) and the per-sample
        depth ``(batch,)`` long, the number of steps taken (``max_depth`` for samples that never met the
        test). ``step`` evaluates ``depths.sum()`` rows in all.
    """
    if done is None:
        _check_eps(eps, "the change of the state per step")
    _check_max_depth(max_depth)
    single = isinstance(state0, torch.Tensor)
    cur = _as_state(state0)
    batch, device = cur[0].shape[0], cur[0].device
    depths = torch.full((batch,), max_depth, dtype=torch.long, device=device)
    if batch == 0:
        return state0, depths
    as_user: Callable[[State], Any] = (lambda s: s[0]) if single else (lambda s: s)
    read: Callable[[Any], torch.Tensor] = readout or (lambda s: s if single else s[0])
    norm = norm or per_sample_norm

    def test(i: int, before: torch.Tensor, after: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return norm(after - before) < eps if done is None else done(i, before, after, idx)

    grad = torch.is_grad_enabled()  # (entering no_grad costs as much as a small layer: only when needed)
    idx = torch.arange(batch, device=device)
    parts: list[tuple[torch.Tensor, State]] = []
    before = read(state0)
    for i in range(max_depth):
        out = step(i, as_user(cur), idx)
        cur = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        after = read(out)
        if grad:
            with torch.no_grad():
                finished = test(i, before, after, idx)
        else:
            finished = test(i, before, after, idx)
        before = after
        if bool(finished.any()):
            depths[idx[finished]] = i + 1
            parts.append((idx[finished], tuple(t[finished] for t in cur)))
            keep = ~finished
            idx, cur, before = idx[keep], tuple(t[keep] for t in cur), before[keep]
            if idx.numel() == 0:
                break
    if converged is not None:
        converged.fill_(True)
        converged[idx] = False  # the rows still running when max_depth ran out
    if idx.numel():
        parts.append((idx, cur))
    return as_user(_assemble(parts, batch)), depths
