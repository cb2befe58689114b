r"""The adjoint state, Noether's conserved ``a·F``, and log-density / entropy change (Ruseckas; Chen et al. 2018; R §2).

- Adjoint (R §2.1): ``a(t) = ∂L/∂y(t)`` solves ``da/dt = −a ∂F/∂y`` backwards from ``a(T) = ∂L/∂y(T)``.
  Here it is obtained by autograd through sub-solves (:func:`~cde_nets.diagnostics.flow.solve_segments`): the
  exact adjoint of the numerical flow on its mesh (the step sizes held fixed: their dependence on the state is
  the controller's, not the ODE's), which tends to the continuous ``a(t)`` as the tolerance tightens.
- Noether (eqs. R21, R24-25): ``a·F`` is the Hamiltonian of the forward/backward system, so for
  time-invariant parameters ``a(t)·F(y(t)) = a(T)·F(y(T))``. With piecewise-constant parameters it jumps at
  each boundary by ``a(t_l)·(F_l − F_{l−1})(y(t_l))``; subtracting those jumps gives the extended quantity
  ``a·F(t) − Σ_{0<t_l≤t} a(t_l)·(F_l − F_{l−1})(y(t_l)) = a(0)·F_0(y(0))``.
- Density (eq. R28): ``d log P(y(t), t)/dt = −Tr ∂F/∂y``; entropy (eqs. R31-32):
  ``dℋ/dt = E_P[Tr ∂F/∂y]``, estimated over a batch drawn from ``P(·, 0)`` as ``ℋ(T) − ℋ(0) ≈ −mean_b Δlog P_b``.
- Hutchinson: ``Tr A = E[εᵀ A ε]`` for Rademacher ``ε`` (entries ±1); ``m`` probes give the mean and the
  standard error ``std/√m``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from .flow import evaluate_at, evaluate_piece, merge_times, piece_of, solve_piece, solve_segments

if TYPE_CHECKING:
    from cde_nets.blocks.ode import ODEBlock

__all__ = ["adjoint_state", "exact_trace", "hutchinson_trace", "log_density_change"]

VectorFn = Callable[[torch.Tensor], torch.Tensor]


def adjoint_state(
    block: ODEBlock,
    y0: torch.Tensor,
    t: torch.Tensor | Sequence[float],
    a_T: torch.Tensor | None = None,
    loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict:
    """``a(t)`` and the Noether quantity ``a·F`` at times ``t`` (module docstring; eqs. R24-25).

    Args:
        block: :class:`~cde_nets.ODEBlock` whose field, method and tolerances are used (``t`` must end at
            ``block.T``: ``a(T)`` is the terminal condition).
        y0: ``(batch, n)``.
        t: increasing times from 0 to ``T``.
        a_T: terminal adjoint ``∂L/∂y(T)``, ``(batch, n)``; or give ``loss`` (``y(T) -> scalar``) instead.
    Returns:
        ``times`` (K), ``y`` and ``a`` ``(K, batch, n)``, ``aF`` and ``aF_extended`` ``(K, batch)``, ``drift`` and
        ``extended_drift`` (``max |q(t) − q(T)| / mean |q(T)|`` over times and batch).
    """
    if (a_T is None) == (loss is None):
        raise ValueError("give exactly one of `a_T` (terminal adjoint, shaped like y0) or `loss` (y(T) -> scalar).")
    times = torch.as_tensor(t, dtype=torch.float64)
    if abs(float(times[-1]) - block.T) > 1e-12 * block.T:
        raise ValueError(f"`t` must end at T={block.T} (where a(T) is given), got {float(times[-1])}.")
    field = block.field
    merged, index = merge_times(field, times, block.T)
    with torch.enable_grad():
        start = y0.detach().requires_grad_(True)
        states = solve_segments(block, start, merged, graph=True)
        if a_T is None:
            assert loss is not None  # exactly one of a_T and loss was given
            a_T = torch.autograd.grad(loss(states[-1]), states[-1], retain_graph=True)[0]
        if tuple(a_T.shape) != tuple(y0.shape):
            raise ValueError(f"`a_T` has shape {tuple(a_T.shape)}; it must match y0 {tuple(y0.shape)}.")
        a = list(torch.autograd.grad(states[-1], states[:-1], grad_outputs=a_T.detach())) + [a_T.detach()]
    grid = getattr(field, "grid", None)
    bounds = set(grid.jumps.tolist()) if grid is not None else set()
    aF_k: list[torch.Tensor] = []
    ext_k: list[torch.Tensor] = []
    shift = torch.zeros(y0.shape[0], dtype=y0.dtype, device=y0.device)
    with torch.no_grad():
        for s, y, ak in zip(merged, states, a):
            y = y.detach()
            l = piece_of(field, s)
            if s in bounds:
                shift = shift - (ak * (evaluate_piece(field, l, y) - evaluate_piece(field, l - 1, y))).flatten(1).sum(1)
            q = (ak * evaluate_at(field, l, y, s)).flatten(1).sum(1)
            aF_k.append(q)
            ext_k.append(q + shift)
    aF, ext = torch.stack(aF_k)[index], torch.stack(ext_k)[index]
    ext = ext - ext[-1] + aF[-1]  # anchor the extended quantity at a(T)·F(y(T)), as in eq. R25

    def drift(q: torch.Tensor) -> float:
        return float((q - q[-1]).abs().max() / q[-1].abs().mean().clamp_min(torch.finfo(q.dtype).tiny))

    return {
        "times": [merged[i] for i in index],
        "y": torch.stack([states[i].detach() for i in index]),
        "a": torch.stack([a[i] for i in index]),
        "aF": aF,
        "aF_extended": ext,
        "drift": drift(aF),
        "extended_drift": drift(ext),
    }


def exact_trace(fn: VectorFn, y: torch.Tensor) -> torch.Tensor:
    """``Tr ∂fn/∂y`` per sample by ``n`` vector-Jacobian products; ``y`` is ``(batch, n)``, returns ``(batch,)``.

    ``fn`` must act on each row independently (no coupling across the batch).
    """
    if y.dim() != 2:
        raise ValueError(f"`y` must be (batch, n), got shape {tuple(y.shape)}; flatten the state first.")
    with torch.enable_grad():
        y = y.detach().requires_grad_(True)
        out = fn(y)
        tr = torch.zeros(y.shape[0], dtype=y.dtype, device=y.device)
        for i in range(y.shape[1]):
            (g,) = torch.autograd.grad(out[:, i].sum(), y, retain_graph=i + 1 < y.shape[1])
            tr = tr + g[:, i]
    return tr.detach()


def _rademacher(shape: tuple[int, ...], like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    bits = torch.randint(0, 2, shape, generator=generator, device="cpu")
    return (2.0 * bits - 1.0).to(dtype=like.dtype, device=like.device)


def _quadratic_forms(fn: VectorFn, y: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``εₖᵀ (∂fn/∂y) εₖ`` per probe and sample: ``eps`` is ``(m, batch, n)``, returns ``(m, batch)``."""
    with torch.enable_grad():
        y = y.detach().requires_grad_(True)
        out = fn(y)
        m = eps.shape[0]
        forms = []
        for k in range(m):
            (g,) = torch.autograd.grad(out, y, grad_outputs=eps[k], retain_graph=k + 1 < m)
            forms.append((g * eps[k]).sum(-1))
    return torch.stack(forms).detach()


def hutchinson_trace(fn: VectorFn, y: torch.Tensor, probes: int = 16, generator: torch.Generator | None = None) -> dict:
    """Hutchinson's estimate of ``Tr ∂fn/∂y`` with ``probes`` Rademacher vectors per sample.

    Returns ``estimate`` and ``stderr`` ``(batch,)`` (sample standard deviation over probes / √probes) and the
    per-probe ``samples`` ``(probes, batch)``.
    """
    if not isinstance(probes, int) or probes < 2:
        raise ValueError(f"`probes` must be an integer >= 2 (the standard error needs two), got {probes!r}.")
    if y.dim() != 2:
        raise ValueError(f"`y` must be (batch, n), got shape {tuple(y.shape)}; flatten the state first.")
    eps = _rademacher((probes, *y.shape), y, generator)
    samples = _quadratic_forms(fn, y, eps)
    return {"estimate": samples.mean(0), "stderr": samples.std(0) / probes**0.5, "samples": samples}


class _WithLogDensity(nn.Module):
    """Augmented field on ``(y, ℓ_1..ℓ_m)``: ``y' = F_l(y)``, ``ℓ_k' = −Tr`` (exact, or probe ``k``'s estimate)."""

    def __init__(self, field: nn.Module, l: int, n: int, eps: torch.Tensor | None):
        super().__init__()
        self.field, self.l, self.n, self.eps = field, l, n, eps

    def forward(self, t: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = z[:, : self.n]

        def fn(v: torch.Tensor) -> torch.Tensor:
            return evaluate_piece(self.field, self.l, v)

        with torch.no_grad():
            f = fn(y)
        if self.eps is None:
            dl = -exact_trace(fn, y)[:, None]
        else:
            dl = -_quadratic_forms(fn, y, self.eps).T
        return torch.cat([f, dl], 1)


@torch.no_grad()
def log_density_change(
    block: ODEBlock,
    y0: torch.Tensor,
    trace: str = "exact",
    probes: int = 8,
    generator: torch.Generator | None = None,
) -> dict:
    """``Δ log P_b = log P(y_b(T), T) − log P(y_b(0), 0) = −∫_0^T Tr ∂F/∂y dt`` per sample (eq. R28) and the
    batch entropy change ``ℋ(T) − ℋ(0) ≈ −mean_b Δ log P_b`` (eq. R32).

    ``trace="exact"`` integrates the exact trace (``n`` VJPs per evaluation, small ``n``); ``"hutchinson"``
    integrates ``probes`` fixed Rademacher probes per sample alongside the state (the same probe for the whole
    trajectory keeps the augmented ODE smooth) and adds ``stderr`` ``(batch,)`` across probes.
    Solved piece by piece with the block's method and tolerances; not differentiable. Returns ``y_T``,
    ``delta_log_p`` ``(batch,)``, ``entropy_change`` (float) and, for Hutchinson, ``stderr``.
    """
    if trace not in ("exact", "hutchinson"):
        raise ValueError(f"`trace` must be 'exact' or 'hutchinson', got {trace!r}.")
    if y0.dim() != 2:
        raise ValueError(f"`y0` must be (batch, n), got shape {tuple(y0.shape)}.")
    field = block.field
    n = y0.shape[1]
    eps = None
    if trace == "hutchinson":
        if not isinstance(probes, int) or probes < 2:
            raise ValueError(f"`probes` must be an integer >= 2 (the standard error needs two), got {probes!r}.")
        eps = _rademacher((probes, *y0.shape), y0, generator)
    m = 1 if eps is None else probes
    z = torch.cat([y0, torch.zeros(y0.shape[0], m, dtype=y0.dtype, device=y0.device)], 1)
    merged, _ = merge_times(field, [0.0, block.T], block.T)
    for a, b in zip(merged[:-1], merged[1:]):
        aug = _WithLogDensity(field, piece_of(field, a), n, eps)
        z = solve_piece(block, aug, z, a, b)
    ell = z[:, n:]
    dlogp = ell.mean(1)
    out = {"y_T": z[:, :n], "delta_log_p": dlogp, "entropy_change": float(-dlogp.mean())}
    if eps is not None:
        out["stderr"] = ell.std(1) / probes**0.5
    return out
