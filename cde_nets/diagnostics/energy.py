r"""Energy along a trajectory and the extended phase-space energy of time-varying Hamiltonian fields.

For ``y' = J ∇H(y, t)`` with a time-invariant ``J`` (Galimberti et al., eqs. H5, H8), ``dH/dt = ∂H/∂t``: ``H`` is
conserved
when the parameters are constant. With time-varying parameters the proof of Lemma H4 (H, appendix II-E) adds a
conjugate pair ``(ε, t)`` to the state and the extended Hamiltonian ``H̃ = H(y, t) + ε`` with ``dε/dt = −∂H/∂t``;
``H̃`` is conserved along the extended flow. For the piecewise-constant parameters of cde_nets (piece ``l`` on
``[t_l, t_{l+1})``), ``∂H/∂t = Σ_l δ(t − t_l) [H_l(y(t_l)) − H_{l−1}(y(t_l))]``, so

    ε(t) = ε(0) − Σ_{0 < t_l ≤ t} [H_l(y(t_l)) − H_{l−1}(y(t_l))],     ε(0) = 0,
    E(t) = H(y(t), t) + ε(t) = H_0(y(0))   for all t.

That is: ``H_l`` is conserved inside each piece, and ``E`` removes exactly the energy that each parameter jump
injects. For a discrete net ``y_{l+1} = Ψ_l(y_l)`` the same bookkeeping gives
``E_{l+1} − E_l = H_l(y_{l+1}) − H_l(y_l)``: the discrete extended energy drifts only by the scheme's energy error
on each piece (zero for the exact flow).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from .flow import merge_times

if TYPE_CHECKING:
    from cde_nets.blocks.ode import ODEBlock

__all__ = ["energy_trajectory", "discrete_energy", "relative_drift"]

EnergyFn = Callable[[int, torch.Tensor], torch.Tensor]


def relative_drift(E: torch.Tensor) -> float:
    """``max_{k, b} |E_k,b − E_0,b| / mean_b |E_0,b|`` for ``E`` of shape ``(times, batch)``.

    Undefined when the initial energies vanish (a ratio to zero would report rounding noise as a huge drift):
    then a ``ValueError`` says so, and the absolute drift ``(E − E[0]).abs().max()`` is the number to report.
    """
    scale = E[0].abs().mean()
    if not bool(scale > 64 * torch.finfo(E.dtype).eps * E.abs().max()):
        raise ValueError(
            f"the relative drift is undefined: the initial energies are zero (mean |E_0| = "
            f"{float(scale):.3g}); report the absolute drift (E - E[0]).abs().max() instead, or shift "
            "the energy by a constant."
        )
    return float((E - E[0]).abs().max() / scale)


def _drift(E: torch.Tensor) -> float | None:
    """:func:`relative_drift`, or ``None`` where it is undefined (zero initial energies)."""
    try:
        return relative_drift(E)
    except ValueError:
        return None


def _energy_fn(field: nn.Module, energy: EnergyFn | None) -> EnergyFn:
    if energy is not None:
        return energy
    if not getattr(field, "hamiltonian", False) or not hasattr(field, "energy_at"):
        raise TypeError(
            f"{type(field).__name__} declares no energy; pass `energy=lambda l, y: ...` (per-piece energy, "
            "returning (batch,)) or use a Hamiltonian field."
        )
    # Duck-typed (any module with energy_at, checked above); nn.Module types it as Tensor | Module, hence the cast.
    return cast(EnergyFn, field.energy_at)


@torch.no_grad()
def energy_trajectory(
    block: ODEBlock,
    y0: torch.Tensor,
    t: torch.Tensor | Sequence[float],
    energy: EnergyFn | None = None,
) -> dict:
    """Energy ``H(y(t), t)`` and extended energy ``E(t)`` along the block's trajectory (see module docstring).

    Args:
        block: an :class:`~cde_nets.ODEBlock` (any solver; its ``solve(y0, t=...)`` is used).
        y0: ``(batch, n)`` initial states.
        t: increasing times starting at 0 within ``[0, T]``; piece boundaries are added internally.
        energy: per-piece energy ``(l, y) -> (batch,)``; default ``block.field.energy_at``.
    Returns:
        ``times`` (len K), ``H`` and ``extended`` ``(K, batch)``, ``jumps`` (one dict per interior boundary:
        ``t`` and the mean over the batch of ``H_l − H_{l−1}``), ``drift`` and ``extended_drift``
        (:func:`relative_drift`; ``None`` where the initial energies are zero and a relative drift is undefined).
    """
    field = block.field
    energy = _energy_fn(field, energy)
    merged, index = merge_times(field, t, block.T)
    ys = block.solve(y0, t=torch.tensor(merged, dtype=torch.float64)).ys
    grid = getattr(field, "grid", None)
    bounds = set(grid.jumps.tolist()) if grid is not None else set()
    H_k: list[torch.Tensor] = []
    E_k: list[torch.Tensor] = []
    jumps = []
    eps = torch.zeros(y0.shape[0], dtype=y0.dtype, device=y0.device)
    for s, y in zip(merged, ys):
        l = grid.index(s) if grid is not None else 0
        if s in bounds:
            jump = energy(l, y) - energy(l - 1, y)
            eps = eps - jump
            jumps.append({"t": s, "mean_jump": float(jump.mean())})
        h = energy(l, y)
        H_k.append(h)
        E_k.append(h + eps)
    H, E = torch.stack(H_k)[index], torch.stack(E_k)[index]
    return {
        "times": [merged[i] for i in index],
        "H": H,
        "extended": E,
        "jumps": jumps,
        "drift": _drift(H),
        "extended_drift": _drift(E),
    }


@torch.no_grad()
def discrete_energy(
    field: nn.Module, states: Sequence[torch.Tensor] | torch.Tensor, energy: EnergyFn | None = None
) -> dict:
    """Layer-by-layer energy of a discrete net ``y_{l+1} = Ψ_l(y_l)``, ``l = 0 .. L−1``.

    Args:
        field: provides ``energy_at(l, y)`` (or pass ``energy``); layer ``l`` uses piece ``min(l, L−1)``.
        states: ``L + 1`` states ``y_0 .. y_L``, each ``(batch, n)`` (a list or a ``(L+1, batch, n)`` tensor).
    Returns:
        ``H`` ``(L+1, batch)`` with ``H[l] = H_l(y_l)`` (the last with piece ``L−1``), ``step_error``
        ``(L, batch)`` = ``H_l(y_{l+1}) − H_l(y_l)``, ``extended`` ``(L+1, batch)`` = ``H_0(y_0) + Σ_{k<l}
        step_error_k``, and the relative drifts of both.
    """
    energy = _energy_fn(field, energy)
    states = list(states)
    if len(states) < 2:
        raise ValueError(f"`states` must hold at least two layer states y_0, y_1, got {len(states)}.")
    L = len(states) - 1
    pieces = getattr(getattr(field, "grid", None), "L", L)
    piece = [min(l, pieces - 1) for l in range(L + 1)]
    H = torch.stack([energy(piece[l], y) for l, y in enumerate(states)])
    step = torch.stack([energy(piece[l], states[l + 1]) - energy(piece[l], states[l]) for l in range(L)])
    E = torch.cat([H[:1], H[:1] + step.cumsum(0)])
    return {"H": H, "step_error": step, "extended": E, "drift": _drift(H), "extended_drift": _drift(E)}
