r"""The linear algebra of simplified Newton for an implicit Runge-Kutta step: the iteration matrix
``M = I − h A ⊗ J`` (Hairer & Wanner 1996, eq. IV.8.10), factored densely or in the eigenbasis of ``A``, and
:class:`NewtonMatrix`, which carries one factorisation from step to step of a chain while the iteration contracts
fast (HW 1996, §IV.8: the Jacobian is re-evaluated only when the observed rate ``θ`` grows).
"""

from __future__ import annotations

import numpy as np
import torch

from .implicit_tableaux import ImplicitTableau

__all__ = ["Carry", "Iteration", "SingularMatrix", "eigen_solver", "kron_matrix"]


def kron_matrix(A: torch.Tensor, J: torch.Tensor, h: float, transpose: bool = False) -> torch.Tensor:
    """``I − h (A ⊗ I) diag(J_j)`` per sample, ``(B, s n, s n)``: block ``(i, j)`` is ``δ_ij I − h a_ij J_j``. ``J``
    is ``(B, n, n)`` (one for all stages) or ``(s, B, n, n)``. ``transpose``: the transposed matrix,
    block ``(j, i)`` is ``δ_ij I − h a_ij J_iᵀ``. Assembled block by block (an einsum over the 5-d product is ~50×
    slower on CPU)."""
    s = A.shape[0]
    B, n = J.shape[-3], J.shape[-1]
    M = torch.zeros(B, s, n, s, n, dtype=J.dtype, device=J.device)
    a = A.tolist()
    for i in range(s):
        for j in range(s):
            if a[i][j]:
                if transpose:
                    Ji = J if J.dim() == 3 else J[i]
                    M[:, j, :, i, :] = (-h * a[i][j]) * Ji.transpose(1, 2)
                else:
                    M[:, i, :, j, :] = (-h * a[i][j]) * (J if J.dim() == 3 else J[j])
    M = M.reshape(B, s * n, s * n)
    M.diagonal(dim1=1, dim2=2).add_(1.0)
    return M


class SingularMatrix(ArithmeticError):
    """A Newton matrix ``I − h A ⊗ J`` that has no inverse; ``samples``: the batch rows whose matrix is singular.
    :func:`~solvers.steppers.implicit.solve_stages` turns it into an ``ImplicitSolveError`` naming the step."""

    def __init__(self, samples: list[int]):
        super().__init__(f"singular Newton matrix in sample(s) {samples}")
        self.samples = samples


def _factor(M: torch.Tensor) -> tuple:
    """A batched factorisation to apply with :func:`_apply`: small matrices are inverted (one batched matmul per
    Newton iteration beats per-matrix triangular solves), larger ones LU-factored. :class:`SingularMatrix` if a
    matrix of the batch has no inverse (one host read, as the checked factorisations make)."""
    if M.shape[-1] <= 32:
        inverse, info = torch.linalg.inv_ex(M)
        fac: tuple = ("inv", inverse)
    else:
        LU, pivots, info = torch.linalg.lu_factor_ex(M)
        fac = ("lu", LU, pivots)
    if bool(info.any()):
        raise SingularMatrix(info.reshape(-1).nonzero().reshape(-1).tolist())
    return fac


def _apply(fac: tuple, rhs: torch.Tensor) -> torch.Tensor:
    return fac[1] @ rhs if fac[0] == "inv" else torch.linalg.lu_solve(fac[1], fac[2], rhs)


class _EigenSolver:
    """``(I − h A ⊗ J)^{−1}`` in the eigenbasis of ``A = T Λ T^{−1}``: ``I − h Λ ⊗ J`` is block diagonal, so one
    ``n × n`` factorisation per eigenvalue (one complex one per conjugate pair) replaces the ``s n × s n`` one
    (Hairer & Wanner 1996, §IV.8, "transformation to Jordan canonical form"). For tableaux with distinct
    eigenvalues and a well-conditioned ``T`` (Gauss, Radau IIA); :func:`eigen_solver` returns ``None`` otherwise."""

    def __init__(self, lam: np.ndarray, T: torch.Tensor, Tinv: torch.Tensor, J: torch.Tensor, h: float):
        cdtype = torch.complex128 if J.dtype == torch.float64 else torch.complex64
        self.T, self.Tinv = T.to(device=J.device, dtype=cdtype), Tinv.to(device=J.device, dtype=cdtype)
        n, self.lus, self.partner = J.shape[-1], {}, {}
        eye = torch.eye(n, dtype=J.dtype, device=J.device)
        for k, lk in enumerate(lam):
            if lk.imag < 0:
                self.partner[k] = int(np.argmin(np.abs(lam - lk.conjugate())))
                continue
            if lk.imag == 0:
                self.lus[k] = _factor(eye - (h * lk.real) * J)
            else:
                self.lus[k] = _factor(eye - (h * complex(lk)) * J.to(cdtype))
        self.real = J.dtype

    def solve(self, G: torch.Tensor) -> torch.Tensor:
        Gt = torch.einsum("ki,ibn->kbn", self.Tinv, G.to(self.T.dtype))
        out = torch.empty_like(Gt)
        for k, lu in self.lus.items():
            rhs = Gt[k].unsqueeze(-1)
            sol = _apply(lu, rhs.real if lu[1].dtype == self.real else rhs).squeeze(-1)
            out[k] = sol
        for k, j in self.partner.items():
            out[k] = out[j].conj()
        return torch.einsum("ik,kbn->ibn", self.T, out).real.to(self.real)


_EIGEN: dict[str, tuple[np.ndarray, torch.Tensor, torch.Tensor] | None] = {}
_EIGEN_MIN_SIZE = 32  # below s·n = 32 the dense factorisation is cheaper than the complex arithmetic


def eigen_solver(tab: ImplicitTableau, J: torch.Tensor, h: float) -> _EigenSolver | None:
    if tab.stages * J.shape[-1] < _EIGEN_MIN_SIZE:
        return None
    key = f"{tab.name}:{tab.a}"
    if key not in _EIGEN:
        lam, T = np.linalg.eig(tab.A)
        distinct = all(abs(a - b) > 1e-8 for i, a in enumerate(lam) for b in lam[i + 1 :])
        ok = distinct and np.linalg.cond(T) < 1e6 and tab.stages > 1
        Tt = torch.from_numpy(T.astype(np.complex128))
        _EIGEN[key] = (lam, Tt, torch.linalg.inv(Tt)) if ok else None
    entry = _EIGEN[key]
    return None if entry is None else _EigenSolver(*entry, J, h)


class Iteration:
    """The linear map of one Newton iteration, ``ΔZ = −M^{−1} G``, from a factorisation of ``M = I − h A ⊗ J``: one
    ``J`` ``(B, n, n)`` for all stages (simplified Newton), or one per stage ``(s, B, n, n)`` (``"full"``)."""

    def __init__(self, tab: ImplicitTableau, A: torch.Tensor, h: float):
        self.tab, self.A, self.h = tab, A, h
        self.eig: _EigenSolver | None = None
        self.lu: tuple | None = None

    def factor(self, J: torch.Tensor) -> Iteration:
        self.eig = eigen_solver(self.tab, J, self.h) if J.dim() == 3 else None
        self.lu = _factor(kron_matrix(self.A, J, self.h)) if self.eig is None else None
        return self

    def apply(self, G: torch.Tensor) -> torch.Tensor:
        if self.eig is not None:
            return self.eig.solve(G)
        assert self.lu is not None
        s, B, n = G.shape
        dZ = _apply(self.lu, G.permute(1, 0, 2).reshape(B, s * n, 1))
        return dZ.reshape(B, s, n).permute(1, 0, 2)


REUSE_MAX_RATE = 0.05  # a step contracting faster than this hands its matrix on to the next step of the chain


class Carry:
    """What a step hands on to the next step of a chain (a continuous solve, the layers of one pass) besides its
    stages. Simplified Newton's factored matrix: the next step reuses it (its Jacobian taken at an earlier step's
    start) when the step size, tableau, batch, dtype and device are the same and the last step that used it
    contracted at ``θ ≤`` :data:`REUSE_MAX_RATE`; a step that observes it contracting slower re-evaluates the
    Jacobian at its own start and goes on from its last iterate. So the Jacobian is re-evaluated only when the
    observed rate grows (Hairer & Wanner 1996, §IV.8); the stage equations and the stopping rule are the same,
    so a stale matrix costs iterations, never accuracy. And the iteration at which the last step's fixed point
    converged and its rate: the next step checks its first increment one iteration before it
    (:meth:`first_check`)."""

    def __init__(self) -> None:
        self.iteration: Iteration | None = None
        self.key: tuple | None = None
        self.rate = float("inf")
        self.converged_at: dict[str, int] = {}
        self.rates: dict[str, float] = {}

    @staticmethod
    def key_of(tab: ImplicitTableau, y: torch.Tensor, h: float) -> tuple:
        return (tab, h, tuple(y.shape), y.dtype, y.device)

    def reusable(self, tab: ImplicitTableau, y: torch.Tensor, h: float) -> Iteration | None:
        """The kept factorisation, if a step of size ``h`` from ``y`` may iterate with it."""
        ok = self.iteration is not None and self.rate <= REUSE_MAX_RATE and self.key == self.key_of(tab, y, h)
        return self.iteration if ok else None

    def keep(self, tab: ImplicitTableau, y: torch.Tensor, h: float, iteration: Iteration, rate: float) -> None:
        self.iteration, self.key, self.rate = iteration, self.key_of(tab, y, h), rate

    def first_check(self, kind: str) -> tuple[int, float]:
        """The first iteration of ``kind`` whose increment is worth checking, and the rate to judge it by: for the
        fixed point, the one before the last step converged, with that step's rate (Hairer & Wanner 1996, §IV.8,
        start the next step's stopping rule from the last step's rate); for Newton the first (its iteration count
        changes with the age of its matrix)."""
        if kind != "fixed_point" or kind not in self.converged_at:
            return 1, 0.0
        return max(1, self.converged_at[kind] - 1), self.rates.get(kind, 0.0)

    def converged(self, kind: str, k: int, rate: float) -> None:
        """Record that an iteration of ``kind`` converged at iteration ``k``, observed contracting at ``rate``."""
        self.converged_at[kind] = k
        if rate > 0.0:
            self.rates[kind] = rate

    def clear(self) -> None:
        self.iteration, self.key, self.rate = None, None, float("inf")
        self.converged_at.clear()
        self.rates.clear()
