r"""Projection onto invariants after each step (Hairer, Lubich & Wanner 2006, "Geometric numerical integration",
§IV.4, Algorithm 4.2: standard projection).

Given invariants ``g = (g_1, …, g_m)`` of the flow (an energy, an angular momentum, …) and a step's result ``ỹ``,
the projected result is ``y = ỹ + G(ỹ)ᵀ λ`` with ``G = ∂g/∂y`` and ``λ ∈ R^m`` solving ``g(ỹ + G(ỹ)ᵀ λ) = g(y_n)``
(each sample of the batch on its own): the closest point, to first order, on the manifold where the invariants keep
their values at the step's start. ``λ`` comes from simplified Newton,
``Δλ = −(G Gᵀ)^{−1} (g(ỹ + Gᵀλ) − g(y_n))``, iterated to rounding.

What it preserves and what it breaks: the invariants hold to rounding at every step, and a method of order ``p``
stays of order ``p`` (the projection moves the state by ``O(h^{p+1})``, HLW Thm. IV.4.2); but the projected map is
in general not symplectic (nor symmetric, nor volume-preserving) even when the method is, so the long-time behaviour
of a symplectic method (its modified Hamiltonian) is lost, and invariants not projected onto may drift.

Gradients are exact for the projected map, by the implicit function theorem: ``λ*`` is converged without a graph,
then one Newton step with the exact Jacobian ``A = ∂g/∂y(y*) G(ỹ)ᵀ`` is taken in the graph at ``λ*``,
``λ = λ* − A^{−1} (g(ỹ + G(ỹ)ᵀ λ*) − g(y_n))``. Its value is ``λ*`` (the residual is zero to rounding) and its
derivative with respect to ``ỹ``, ``y_n`` and any tensor ``g`` reads is ``−A^{−1} ∂r/∂(·)``, the implicit function
theorem's, whatever number of iterations the forward took. Second derivatives of ``g`` enter through ``G(ỹ)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

__all__ = ["Projection", "ProjectionError"]

Invariant = Callable[[float, torch.Tensor], torch.Tensor]


class ProjectionError(ValueError):
    """The projection's Newton iteration did not converge, or its matrix ``G Gᵀ`` is singular."""


@dataclass(frozen=True)
class Projection:
    """Standard projection onto ``invariant`` (one callable or a sequence of them) after each step.

    Each invariant is ``g(t, y)`` of the state ``y`` ``(batch, n)`` → ``(batch,)`` (the per-sample value), e.g. a
    Hamiltonian field's ``field.energy``; ``t`` is the step's midpoint, so a piecewise invariant reads the piece
    the step lies on. ``max_iters``: simplified Newton iterations before a :class:`ProjectionError`.
    """

    invariant: Invariant | Sequence[Invariant]
    max_iters: int = 20

    def __post_init__(self) -> None:
        inv = self.invariants
        if not inv or not all(callable(g) for g in inv):
            raise TypeError(
                "`invariant` must be a callable g(t, y) -> (batch,) or a non-empty sequence of them, e.g. "
                f"Projection(invariant=field.energy); got {self.invariant!r}."
            )
        if not isinstance(self.max_iters, int) or self.max_iters < 1:
            raise ValueError(f"`max_iters` must be an integer >= 1, got {self.max_iters!r}.")

    @property
    def invariants(self) -> tuple[Invariant, ...]:
        inv = self.invariant
        if isinstance(inv, (list, tuple)):
            return tuple(inv)
        return (cast(Invariant, inv),)

    def values(self, t: float, y: torch.Tensor) -> torch.Tensor:
        """``g(t, y)`` as ``(batch, m)``."""
        out = []
        for g in self.invariants:
            v = g(t, y)
            if not isinstance(v, torch.Tensor) or v.shape != y.shape[:1]:
                shape = getattr(v, "shape", type(v).__name__)
                raise ValueError(
                    f"an invariant must return one value per sample, shape ({y.shape[0]},); {g!r} returned {shape}."
                )
            out.append(v)
        return torch.stack(out, -1)

    def _jacobian(self, t: float, y: torch.Tensor, create_graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g(t, y), ∂g/∂y)``: ``(batch, m)`` and ``(batch, m, n)`` (rows of the batch independent)."""
        with torch.enable_grad():
            x = y if create_graph and y.requires_grad else y.detach().requires_grad_(True)
            gv = self.values(t, x)
            rows = [
                torch.autograd.grad(gv[:, k].sum(), x, create_graph=create_graph, retain_graph=True)[0]
                for k in range(gv.shape[1])
            ]
        return gv, torch.stack(rows, 1)

    def project(self, t: float, y_start: torch.Tensor, y_step: torch.Tensor) -> torch.Tensor:
        """``y_step`` projected onto ``g(t, ·) = g(t, y_start)`` (module docstring), with exact gradients."""
        with torch.no_grad():
            target = self.values(t, y_start)
            _, G = self._jacobian(t, y_step.detach(), False)
            M = G @ G.transpose(1, 2)
            lam = torch.zeros_like(target)
            y = y_step.detach()
            scale = 4 * torch.finfo(y.dtype).eps * (1.0 + target.abs())
            for _ in range(self.max_iters):
                r = self.values(t, y) - target
                if bool((r.abs() <= scale).all()):
                    break
                try:
                    dlam = torch.linalg.solve(M, -r.unsqueeze(-1)).squeeze(-1)
                except RuntimeError:
                    raise ProjectionError(
                        "the projection's matrix G Gᵀ (G = ∂g/∂y) is singular: an invariant has a zero gradient "
                        "at this state, or two invariants have parallel gradients. Drop one of them, or project "
                        "away from equilibria."
                    ) from None
                lam = lam + dlam
                y = y_step.detach() + (G.transpose(1, 2) @ lam.unsqueeze(-1)).squeeze(-1)
            else:
                raise ProjectionError(
                    f"the projection did not reach its invariants in max_iters={self.max_iters} simplified Newton "
                    f"iterations (largest residual {float(r.abs().max()):.3g}): the step moved too far from the "
                    "manifold. Take smaller steps, or raise `max_iters`."
                )
        if not torch.is_grad_enabled() or not _needs_graph(t, y_step, y_start, self):
            return y
        return self._ift_step(t, y_start, y_step, lam, y)

    def _ift_step(
        self, t: float, y_start: torch.Tensor, y_step: torch.Tensor, lam: torch.Tensor, y_star: torch.Tensor
    ) -> torch.Tensor:
        """One Newton step in the graph at the converged ``λ*``: the implicit function theorem's derivative."""
        with torch.no_grad():
            _, J = self._jacobian(t, y_star, False)
            _, G0 = self._jacobian(t, y_step.detach(), False)
            A = J @ G0.transpose(1, 2)
        with torch.enable_grad():
            _, G = self._jacobian(t, y_step, True)
            Gt = G.transpose(1, 2)
            r = self.values(t, y_step + (Gt @ lam.unsqueeze(-1)).squeeze(-1)) - self.values(t, y_start)
            lam_g = lam - torch.linalg.solve(A, r.unsqueeze(-1)).squeeze(-1)
            return y_step + (Gt @ lam_g.unsqueeze(-1)).squeeze(-1)

    def describe(self) -> str:
        return ", ".join(getattr(g, "__name__", type(g).__name__) for g in self.invariants)


def _needs_graph(t: float, y_step: torch.Tensor, y_start: torch.Tensor, proj: Any) -> bool:
    """Whether a graph is wanted: an input requires grad, or an invariant reads a tensor that does (a module's
    parameters, or any tensor it closes over; checked by one evaluation)."""
    if y_step.requires_grad or y_start.requires_grad:
        return True
    with torch.enable_grad():
        return bool(proj.values(t, y_step.detach()[:1]).requires_grad)
