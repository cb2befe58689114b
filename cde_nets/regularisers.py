r"""Regularisers integrated along the trajectory, as part of the state, and the density law beside them.

For a field ``dz/dt = F(t, z)`` on ``[0, T]`` the state is augmented with, per sample,

- the log-density change (Ruseckas eq. R28, FFJORD eq. 4): ``dℓ/dt = Tr ∂F/∂z``, so that
  ``log p(z(0)) = log p(z(T)) + ℓ(T)``;
- ``"kinetic"``: ``∫₀ᵀ ‖F(t, z)‖² dt`` (RNODE, Finlay et al. 2020, eq. 4);
- ``"jacobian"``: ``∫₀ᵀ ‖∂F/∂z‖²_F dt`` (RNODE eq. 5), by Hutchinson's ``‖∂F/∂z‖²_F = E‖εᵀ ∂F/∂z‖²``
  (``E[εεᵀ] = I``) or exactly in ``trace="exact"`` mode (every row of the Jacobian is computed then anyway);
- ``"taylor2"``: ``∫₀ᵀ ‖d²z/dt²‖² dt`` with ``d²z/dt² = ∂F/∂t + (∂F/∂z) F`` (TayNODE, Kelly et al. 2020, eq. 3
  with ``K = 2``), by one extra Jacobian-vector product (two reverse passes, so it also holds for fields that
  differentiate internally, such as Hamiltonian ones).

Each quantity is an ODE integrand solved with ``z`` by the same adaptive solver, so it is differentiated by the
same gradient method (the adjoint sees the integrands as part of the dynamics), and Hutchinson's probe ``ε`` is
drawn once per solve (FFJORD §3.1) so the forward and backward solves see one estimator. Adaptive steps are
controlled on ``(z, ℓ)`` only: the regularisers feed nothing back, and their error would only add steps.

STEER (Ghosh et al. 2020) draws the end time from ``U(T − b, T + b)`` at every training forward pass.

:class:`~cde_nets.ODEBlock` (``regularisers=``) is the continuous block that integrates them with its state;
:class:`~cde_nets.flows.ContinuousFlow` is the density model. For the :class:`~cde_nets.train.trainer.Trainer`,
:func:`kinetic_energy`, :func:`jacobian_frobenius` and :func:`taylor` are :class:`Regulariser` terms that read
the values the step's forward pass integrated, reported into the step's :func:`~cde_nets.integrated_terms`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from cde_nets.blocks.collected_terms import current_terms
from cde_nets.functional import odeint
from cde_nets.train.trainer import Regulariser

from .solvers.dropin import ADAPTIVE
from .solvers.gradients import GradientMethod
from .solvers.norms import StateNorm

__all__ = [
    "REGULARISERS",
    "AugmentedField",
    "AugmentedCall",
    "check_regularisers",
    "kinetic_energy",
    "jacobian_frobenius",
    "taylor",
    "steer_time",
]

REGULARISERS = ("kinetic", "jacobian", "taylor2")
TRACES = ("exact", "hutchinson", None)
NOISES = ("gaussian", "rademacher")


def check_regularisers(regularisers: Iterable[str]) -> tuple[str, ...]:
    """The regulariser names, checked once at construction (order kept, duplicates refused)."""
    if isinstance(regularisers, str):
        regularisers = (regularisers,)
    names = tuple(regularisers)
    bad = [r for r in names if r not in REGULARISERS]
    if bad or len(set(names)) != len(names):
        raise ValueError(f"`regularisers` must hold distinct names from {REGULARISERS}, got {names!r}.")
    return names


def steer_time(T: float, b: float, training: bool, like: torch.Tensor) -> torch.Tensor:
    """The end time: ``T``, or ``T + U(−b, b)`` while training with ``b > 0`` (STEER, Ghosh et al. 2020, §3)."""
    end = torch.tensor(float(T), dtype=like.dtype, device=like.device)
    if training and b > 0:
        end = end + (2 * torch.rand((), dtype=like.dtype, device=like.device) - 1) * b
    return end


def draw_probe(like: torch.Tensor, noise: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Hutchinson's probe shaped like ``like``: standard Gaussian, or Rademacher (±1); both have ``E[εεᵀ] = I``."""
    if noise == "gaussian":
        return torch.randn(like.shape, dtype=like.dtype, device=like.device, generator=generator)
    signs = torch.randint(0, 2, like.shape, device=like.device, generator=generator)
    return (2 * signs - 1).to(like.dtype)


class AugmentedField(nn.Module):
    """``(z, ℓ, r_1, …) ↦ (F, Tr ∂F/∂z, integrand_1, …)``: a field with its log-density change and regularisers.

    ``trace`` is ``"exact"`` (``dim`` reverse passes, small dimensions), ``"hutchinson"`` (one pass with the probe
    ``probe``, drawn once per solve and passed with every evaluation: :class:`AugmentedCall`), or ``None`` (no
    density term: a regularised block). The state is a tuple ``(z (batch, dim), ℓ (batch,), r (batch,) per
    regulariser)``.
    """

    def __init__(self, field: nn.Module, trace: str | None, regularisers: Sequence[str] = ()):
        super().__init__()
        if trace not in TRACES:
            raise ValueError(f"`trace` must be one of {TRACES}, got {trace!r}.")
        self.field = field
        self.trace = trace
        self.regularisers = check_regularisers(regularisers)

    @property
    def needs_probe(self) -> bool:
        return self.trace == "hutchinson" or (self.trace is None and "jacobian" in self.regularisers)

    def bind(self, probe: torch.Tensor | None) -> AugmentedCall:
        """This field for one solve: the probe fixed, the evaluations counted."""
        return AugmentedCall(self, probe)

    def forward(
        self, t: torch.Tensor, state: tuple[torch.Tensor, ...], probe: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        z = state[0]
        differentiate = torch.is_grad_enabled()  # the gradient needs the graph of these derivatives
        with torch.enable_grad():
            # outside a graph (the no-grad forward solve of checkpoint and adjoint) z may still say it requires
            # grad — a view taken without grad of a state that does — yet derivatives would flow to its base
            if not differentiate or not z.requires_grad:
                z = z.detach().requires_grad_(True)
            taylor = "taylor2" in self.regularisers
            # a t already in the graph (backprop through adaptive steps) must stay there: its path cancels z's
            t_in = t.detach().requires_grad_(True) if taylor and (not differentiate or not t.requires_grad) else t
            F = self.field(t_in, z)
            if not isinstance(F, torch.Tensor) or F.shape != z.shape:
                got = tuple(F.shape) if isinstance(F, torch.Tensor) else type(F).__name__
                raise ValueError(f"the field must return a tensor shaped like z {tuple(z.shape)}, got {got}.")
            trace, frob = self._trace_and_frobenius(F, z, probe, differentiate or taylor)
            out: list[torch.Tensor] = [F]
            if self.trace is not None:
                out.append(trace)
            for name in self.regularisers:
                if name == "kinetic":
                    out.append(F.square().flatten(1).sum(1))
                elif name == "jacobian":
                    out.append(frob)
                else:
                    out.append(self._second_derivative(F, z, t_in, differentiate).square().flatten(1).sum(1))
        if not differentiate:
            out = [o.detach() for o in out]
        return tuple(out)

    def _trace_and_frobenius(
        self, F: torch.Tensor, z: torch.Tensor, probe: torch.Tensor | None, graph: bool
    ) -> tuple[Any, Any]:
        frobenius = "jacobian" in self.regularisers
        if self.trace == "exact":
            if z.dim() != 2:
                raise ValueError(f"trace='exact' needs a (batch, dim) state, got {tuple(z.shape)}; use 'hutchinson'.")
            trace = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
            frob = torch.zeros_like(trace)
            for i in range(z.shape[1]):
                # row i of every sample's Jacobian at once: samples do not interact through the field
                (row,) = torch.autograd.grad(F[:, i].sum(), z, create_graph=graph, retain_graph=True)
                trace = trace + row[:, i]
                if frobenius:
                    frob = frob + row.square().sum(1)
            return trace, frob
        if not self.needs_probe:
            return None, None
        if probe is None or probe.shape != z.shape:
            raise RuntimeError("a Hutchinson solve needs its probe shaped like z: `AugmentedField.bind(probe)`.")
        eps = probe.to(z.dtype)
        (vjp,) = torch.autograd.grad(F, z, eps, create_graph=graph, retain_graph=True)
        return (vjp * eps).flatten(1).sum(1), vjp.square().flatten(1).sum(1)

    @staticmethod
    def _second_derivative(F: torch.Tensor, z: torch.Tensor, t: torch.Tensor, graph: bool) -> torch.Tensor:
        """``∂F/∂t + (∂F/∂z) F`` by the double-VJP trick: ``u(v) = vᵀ(∂F/∂z, ∂F/∂t)`` is linear in ``v``, and
        ``∂/∂v [u_z · F + u_t] = (∂F/∂z) F + ∂F/∂t``."""
        v = torch.zeros_like(F, requires_grad=True)
        u_z, u_t = torch.autograd.grad(F, (z, t), v, create_graph=True, allow_unused=True, materialize_grads=True)
        (jvp,) = torch.autograd.grad((u_z * F).sum() + u_t.sum(), v, create_graph=graph)
        return jvp


class AugmentedCall:
    """An :class:`AugmentedField` for one solve: ``probe`` (or ``None``) passed with every evaluation, and
    :attr:`nfe` counting them — per call, so the module itself keeps nothing."""

    def __init__(self, aug: AugmentedField, probe: torch.Tensor | None):
        self.aug, self.probe, self.nfe = aug, probe, 0

    @property
    def regularisers(self) -> tuple[str, ...]:
        return self.aug.regularisers

    def __call__(self, t: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self.nfe += 1
        return self.aug(t, state, self.probe)


def integrate_augmented(
    aug: AugmentedCall,
    state: tuple[torch.Tensor, ...],
    t: torch.Tensor,
    *,
    method: str,
    rtol: float,
    atol: float,
    options: dict | None,
    gradient: str | GradientMethod,
    params: Sequence[torch.Tensor] | None,
) -> tuple[tuple[torch.Tensor, ...], int]:
    """The augmented state at ``t[-1]`` and the number of forward field evaluations.

    An adaptive method controls its steps on ``(z, ℓ)`` alone unless ``options`` names a ``norm``: the regularisers
    are quadratures that feed nothing back, and letting their error steer the steps would make a regularised
    solve take more steps than an unregularised one of the same field. The norm is the RMS over ``z`` and ``ℓ``
    together, not the largest of their two RMS norms (torchdiffeq's default for a tuple state, which
    :func:`~cde_nets.odeint` follows): the flows' recorded runs were made with it.
    """
    if method in ADAPTIVE and "norm" not in (options or {}):
        controlled = len(state) - len(aug.regularisers)
        norm = controlled_norm(controlled) if aug.regularisers else StateNorm()  # StateNorm(): the RMS over all
        options = {**(options or {}), "norm": norm}
    kw: dict[str, Any] = dict(rtol=rtol, atol=atol, method=method, options=options, gradient=gradient)
    if gradient not in ("backprop",):
        kw["adjoint_params"] = tuple(params or ())
    ys = odeint(aug, state, t, **kw)
    return tuple(y[-1] for y in ys), aug.nfe


def controlled_norm(k: int) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
    """The RMS norm over the first ``k`` parts of a tuple state's scaled error, concatenated."""

    def norm(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in parts[:k]]).square().mean().sqrt()

    return norm


def check_flow_settings(T: float, noise: str, steer: float) -> None:
    if not (isinstance(T, (int, float)) and math.isfinite(T) and T > 0):
        raise ValueError(f"`T` must be a positive finite end time, got {T!r}.")
    if noise not in NOISES:
        raise ValueError(f"`noise` must be one of {NOISES}, got {noise!r}.")
    if not (isinstance(steer, (int, float)) and 0 <= steer < T):
        raise ValueError(
            f"`steer` must be the half-width b of STEER's end time U(T−b, T+b), 0 <= b < T; got {steer!r}."
        )


def _integrated(name: str) -> Callable[[nn.Module], torch.Tensor]:
    def fn(model: nn.Module) -> torch.Tensor:
        terms = current_terms()
        if name not in terms:
            raise ValueError(
                f"no block of the model integrated {name!r} in this step's forward pass: build its continuous "
                f"blocks as ODEBlock/DiscreteNet/ContinuousFlow with regularisers=(..., {name!r})."
            )
        return terms[name]

    return fn


def kinetic_energy(weight: float) -> Regulariser:
    """``weight · ∫‖F‖² dt`` (RNODE eq. 4), batch mean, summed over the model's regularised blocks."""
    return Regulariser("kinetic", weight, _integrated("kinetic"))


def jacobian_frobenius(weight: float) -> Regulariser:
    """``weight · ∫‖∂F/∂z‖²_F dt`` (RNODE eq. 5), batch mean, summed over the model's regularised blocks."""
    return Regulariser("jacobian", weight, _integrated("jacobian"))


def taylor(weight: float) -> Regulariser:
    """``weight · ∫‖d²z/dt²‖² dt`` (TayNODE eq. 3, ``K = 2``), batch mean, summed over the regularised blocks."""
    return Regulariser("taylor2", weight, _integrated("taylor2"))
