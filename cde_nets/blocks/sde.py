r"""Stochastic continuous mode: a field as the drift of an SDE integrated by torchsde.

``dy = F(t, y) dt + g(y) ∘ dW`` (Stratonovich) or ``dy = F(t, y) dt + g(y) dW`` (Itô) on ``[0, T]``, with

- ``noise="diagonal"``: multiplicative diagonal noise ``g(y) = σ ⊙ y`` (each state entry driven by its own
  Brownian motion; Itô and Stratonovich differ by the drift correction ``½ σ² ⊙ y``);
- ``noise="additive"``: ``g = σ`` (state independent, so Itô and Stratonovich coincide);
- ``noise=None``: ``g = 0``, the drift ODE integrated by the method's deterministic limit.

``σ`` has one learnable entry per channel (the first state axis), kept positive as ``σ = softplus(ρ)``.
Trained with noise, the block acts as a regulariser in the manner of neural SDEs (Liu et al. 2019, "Neural
SDE: stabilizing neural ODE networks with stochastic noise"); at evaluation the noise can be switched off or
averaged over several paths.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as nnf
from torch import nn

from cde_nets.blocks.base import Block
from cde_nets.blocks.collected_terms import report
from cde_nets.blocks.compile_boundary import eager_under_compile
from cde_nets.blocks.nonfinite import check_result, nonfinite_parameter
from cde_nets.blocks.solution import Solution
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.counting import SolverStats, count_evaluation
from cde_nets.solvers.errors import check_positive, check_positive_int
from cde_nets.solvers.gradients import Adjoint, GradientMethod, as_gradient
from cde_nets.solvers.grids import aligned_grid
from cde_nets.solvers.transforms import under_vmap

__all__ = ["SDEBlock", "SDESettings", "SDE_METHODS", "NOISES"]

NOISES = ("diagonal", "additive", None)
_ALL_NOISE = ("additive", "diagonal", "general", "scalar")
_STRAT_ALL = (("stratonovich",), _ALL_NOISE)
#: torchsde's fixed-step solvers and what they accept: method -> (sde types, noise types); the first sde type is
#: the default. Read off the ``sde_type`` / ``noise_types`` class attributes in torchsde/_core/methods/*.py.
SDE_METHODS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "euler": (("ito",), _ALL_NOISE),
    "milstein": (("ito", "stratonovich"), ("additive", "diagonal", "scalar")),
    "srk": (("ito",), ("additive", "diagonal", "scalar")),
    "midpoint": _STRAT_ALL,
    "heun": _STRAT_ALL,
    "euler_heun": _STRAT_ALL,
    "log_ode": _STRAT_ALL,
    "reversible_heun": _STRAT_ALL,
}
#: Methods usable only for the adjoint's backward solve.
_ADJOINT_ONLY = {"adjoint_reversible_heun": _STRAT_ALL}
# Brownian Lévy-area information a method needs (torchsde's ``levy_area_approximations``).
_LEVY = {"srk": "space-time", "log_ode": "foster"}


def _valid_methods(sde_type: str, noise: str, table: dict) -> list[str]:
    return sorted(m for m, (types, noises) in table.items() if sde_type in types and noise in noises)


class _SDE(nn.Module):
    """torchsde's interface on flattened states ``(batch, n)``: drift ``f`` = the field on piece ``l``, ``g`` the
    diagonal diffusion. Counts its evaluations into ``stats``."""

    noise_type = "diagonal"

    def __init__(
        self,
        field: BoundField,
        shape: tuple[int, ...],
        rho: nn.Parameter | None,
        multiplicative: bool,
        sde_type: str,
        stats: SolverStats,
        count_vjp: bool,
        l: int = 0,
    ):
        super().__init__()
        self.field = field  # a BoundField (plain object): this call's field and input
        self.shape = shape
        self.rho = rho  # (C,) with σ = softplus(ρ), or None for g = 0
        self.reps = math.prod(shape[1:]) if len(shape) > 1 else 1
        self.multiplicative = multiplicative
        self.sde_type = sde_type
        self.stats = stats
        self.count_vjp = count_vjp
        self.l = l  # fixed per object: the adjoint's reverse solve of a step must see that step's piece
        self.backward_phase = False
        self.probe: set[str] = set()

    def arm_probe(self) -> None:
        """torchsde's ``sdeint`` first calls ``f`` and ``g`` once to check shapes; answer those with zeros."""
        self.probe = {"f", "g"}

    def _count(self, out: torch.Tensor) -> torch.Tensor:
        count_evaluation(self.stats, out, self.backward_phase, self.count_vjp)
        return out

    def f(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if "f" in self.probe:
            self.probe.discard("f")
            return torch.zeros_like(y)
        z = y.reshape(y.shape[0], *self.shape)
        out = self.field.evaluate(self.l, z) if hasattr(self.field, "grid") else self.field(t, z)
        return self._count(out.reshape(y.shape[0], -1))

    def g(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if "g" in self.probe:
            self.probe.discard("g")
            return torch.zeros_like(y)
        if self.rho is None:
            out = y * 0.0
        else:
            # σ is recomputed from ρ at each call so that the adjoint's vector-Jacobian products reach ρ.
            sigma = nnf.softplus(self.rho).to(y.dtype).repeat_interleave(self.reps)
            # `+ y * 0` keeps the additive g a (constant) function of y, which Milstein and the Itô adjoint
            # differentiate.
            out = sigma * y if self.multiplicative else sigma + y * 0.0
        return self._count(out)


@dataclass(frozen=True)
class SDESettings:
    """The rarely changed settings of an :class:`SDEBlock`: ``SDEBlock(field, settings=SDESettings(paths=4))``.

    Attributes:
        sde_type: ``"ito"`` or ``"stratonovich"`` (matters for diagonal noise only); default the method's own.
        adjoint_method: method of the adjoint's backward solve; default torchsde's choice (Itô diagonal:
            ``milstein``, Itô additive: ``euler``, Stratonovich: ``midpoint``, ``reversible_heun``:
            ``adjoint_reversible_heun``).
        noise_at_eval: keep the noise in ``eval()`` mode. When ``False`` (default) evaluation integrates the
            drift ODE with ``g = 0`` by the same torchsde method on the same grid (its deterministic limit:
            ``euler``/``milstein`` → Euler, ``midpoint`` → explicit midpoint, ``heun`` → Heun).
        paths: with noise on, integrate ``paths`` independent paths per sample and return their mean.
        channels: number of noise channels when the field declares no ``state_shape``.
    """

    sde_type: str | None = None
    adjoint_method: str | None = None
    noise_at_eval: bool = False
    paths: int = 1
    channels: int | None = None


class SDEBlock(Block):
    r"""``y(T)`` of ``dy = F(t, y) dt + g(y) dW`` for a :class:`~cde_nets.fields.base.Field` ``F`` (torchsde).

    Args:
        field: the drift (its parameters and ``σ`` are the block's parameters).
        noise: ``"diagonal"`` (``g = σ ⊙ y``), ``"additive"`` (``g = σ``) or ``None`` (``g = 0``: the drift ODE).
        sigma: initial noise scale ``> 0``: a number or one value per channel ``(C,)``; learnable, ``softplus(ρ)``.
        T: end time; defaults to ``field.T`` (must equal it when the field is time-varying).
        method: a torchsde fixed-step method, see :data:`SDE_METHODS` (``euler``, ``milstein``, ``srk`` are Itô;
            ``midpoint``, ``heun``, ``euler_heun``, ``log_ode``, ``reversible_heun`` Stratonovich; ``milstein``
            both). Each runs its own SDE type, so ``sde_type`` defaults to the method's.
        step_size: largest step; default one step per parameter piece (``field.grid.h``). Steps always end on
            every piece boundary, and each step uses the parameters of its piece.
        adaptive: subdivide each of those steps by torchsde's step-doubling error control (one full step against
            two half steps, ``rtol``/``atol``; the adjoint's backward solve too). Refused for ``reversible_heun``
            (torchsde does not record its adaptive steps) and for ``euler`` with diagonal noise (adaptive
            Euler-Maruyama need not converge with multiplicative noise).
        rtol, atol: tolerances of ``adaptive`` (default 1e-5 and 1e-4, torchsde's: strong orders ½-1 make
            ODE-like tolerances unaffordable); refused without ``adaptive``, where they would be ignored.
        gradient: ``"adjoint"`` (``sdeint_adjoint``: the adjoint SDE solved backwards on the same Brownian path)
            or ``"backprop"`` (differentiate through the steps).
        seed: seeds the Brownian paths: call ``k`` of the block uses ``BrownianInterval(entropy=...)`` derived
            from ``(seed, k)``, so two blocks with the same seed repeat each other exactly; :meth:`reseed`
            restarts the sequence. ``None``: entropy drawn from ``torch``'s generator (``torch.manual_seed``).
        settings: the rarely changed settings, one :class:`SDESettings` (SDE type, the adjoint's method,
            noise in evaluation, paths per sample, noise channels).

    Calling the block returns ``y(T)``; :meth:`solve` returns a :class:`~cde_nets.blocks.solution.Solution` with the
    states at requested grid times too. After each call, :attr:`stats` holds ``nfe_forward`` (drift plus
    diffusion evaluations), ``nfe_backward``
    (evaluations of the adjoint solve, or vector-Jacobian products through recorded evaluations for
    ``backprop``; filled in by ``backward()``) and ``steps_forward`` / ``steps_backward`` (the steps of the fixed
    grid; with ``adaptive`` their subdivisions show only in the evaluation counts).
    """

    _grid: torch.Tensor  # buffer: the step grid (float64)
    rho: nn.Parameter | None

    def __init__(
        self,
        field: nn.Module,
        noise: str | None = "diagonal",
        sigma: float | torch.Tensor = 0.1,
        T: float | None = None,
        method: str = "euler",
        step_size: float | None = None,
        adaptive: bool = False,
        rtol: float | None = None,
        atol: float | None = None,
        gradient: str | GradientMethod = "adjoint",
        seed: int | None = None,
        *,
        settings: SDESettings | None = None,
    ):
        super().__init__(field, T)
        if settings is None:
            settings = SDESettings()
        elif not isinstance(settings, SDESettings):
            raise TypeError(
                f"`settings` must be an SDESettings, e.g. SDESettings(paths=4); got {type(settings).__name__}."
            )
        sde_type, adjoint_method = settings.sde_type, settings.adjoint_method
        noise_at_eval, paths, channels = settings.noise_at_eval, settings.paths, settings.channels
        if noise not in NOISES:
            raise ValueError(f"`noise` must be one of {NOISES} (g = σ ⊙ y, g = σ, g = 0), got {noise!r}.")
        self.noise = noise
        self.method, self.sde_type = self._check_method(method, sde_type, noise)
        self.gradient = as_gradient(gradient, sde=True)
        self.adjoint_method = self._check_adjoint_method(adjoint_method)
        levy = {_LEVY[m] for m in (method, self.adjoint_method) if m in _LEVY}
        self._levy = "foster" if "foster" in levy else (levy.pop() if levy else "none")
        if step_size is not None:
            check_positive("step_size", step_size, "It is the largest step of the fixed-step SDE solver.")
        self.step_size = step_size
        self.adaptive = bool(adaptive)
        self.rtol, self.atol = self._check_tolerances(rtol, atol)
        # a field of one piece (or none) spans the block's own T, which may differ from the field's
        grid = getattr(field, "grid", None)
        bounds = grid.boundaries.tolist() if grid is not None and grid.L > 1 else [0.0, self.T]
        self.register_buffer("_grid", aligned_grid(bounds, step_size), persistent=False)
        self._steps_per_piece = (len(self._grid) - 1) // max(len(bounds) - 1, 1)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ValueError(f"`seed` must be a non-negative integer or None, got {seed!r}.")
        self.seed = seed
        self._calls = 0
        self.noise_at_eval = bool(noise_at_eval)
        self.paths = check_positive_int("paths", paths, "Brownian paths averaged per sample")
        self._shape_hint = tuple(getattr(field, "state_shape", ()) or ())
        self.rho = self._diffusion(field, noise, sigma, channels)

    # -- construction helpers --------------------------------------------------------------------------
    @staticmethod
    def _check_method(method: str, sde_type: str | None, noise: str | None) -> tuple[str, str]:
        if method not in SDE_METHODS:
            hint = " (it serves only as `adjoint_method`)" if method in _ADJOINT_ONLY else ""
            raise ValueError(f"`method` {method!r} is unknown{hint}; valid: {sorted(SDE_METHODS)}.")
        if sde_type is None:
            sde_type = SDE_METHODS[method][0][0]
        if sde_type not in ("ito", "stratonovich"):
            raise ValueError(f"`sde_type` must be 'ito' or 'stratonovich', got {sde_type!r}.")
        # Additive and zero noise run as torchsde's diagonal type (O(n) memory rather than an n × n matrix).
        types, noises = SDE_METHODS[method]
        if sde_type not in types or "diagonal" not in noises:
            raise ValueError(
                f"`method`={method!r} does not integrate {sde_type} SDEs with {noise} noise; valid methods: "
                f"{_valid_methods(sde_type, 'diagonal', SDE_METHODS)}, or change `sde_type`."
            )
        return method, sde_type

    def _check_tolerances(self, rtol: float | None, atol: float | None) -> tuple[float, float]:
        if not self.adaptive and (rtol is not None or atol is not None):
            raise ValueError(
                "`rtol`/`atol` control adaptive stepping; with adaptive=False they would be ignored. "
                "Drop them, or pass adaptive=True."
            )
        rtol = 1e-5 if rtol is None else rtol
        atol = 1e-4 if atol is None else atol
        if self.adaptive:
            if self.method == "reversible_heun":
                raise ValueError(
                    "`adaptive=True` is not supported with method='reversible_heun' (torchsde does not "
                    "record its adaptive steps); use a fixed `dt` or another method."
                )
            if self.method == "euler" and self.noise == "diagonal":
                raise ValueError(
                    "`adaptive=True` with method='euler' and diagonal (multiplicative) noise need not "
                    "converge; use method='milstein' or 'srk', or a fixed `dt`."
                )
            check_positive("rtol", rtol, "It is the relative tolerance of adaptive stepping.")
            check_positive("atol", atol, "It is the absolute tolerance of adaptive stepping.")
        return float(rtol), float(atol)

    def _diffusion(
        self, field: nn.Module, noise: str | None, sigma: float | torch.Tensor, channels: int | None
    ) -> nn.Parameter | None:
        """``ρ`` with ``σ = softplus(ρ)`` per noise channel, or ``None`` without noise."""
        if channels is None:
            channels = self._shape_hint[0] if self._shape_hint else None
        if channels is not None:
            check_positive_int("channels", channels, "noise channels")
        if noise is None:
            return None
        if channels is None:
            raise ValueError(f"{type(field).__name__} declares no `state_shape`; pass `channels=` (noise channels).")
        return nn.Parameter(self._inverse_softplus(sigma, int(channels)))

    def _check_adjoint_method(self, adjoint_method: str | None) -> str | None:
        """The method of the adjoint's backward solve (``gradient="adjoint"`` only). The adjoint SDE of additive
        noise has general noise (torchsde/_core/adjoint_sde.py); additive noise runs as torchsde's diagonal
        type, whose adjoint stays diagonal."""
        gradient = self.gradient
        if not isinstance(gradient, Adjoint):
            if adjoint_method is not None:
                raise ValueError(
                    "`adjoint_method` applies to gradient='adjoint' only; drop it or set gradient='adjoint'."
                )
            return None
        if gradient != Adjoint():
            raise ValueError(
                f"the SDE block's adjoint takes no settings of the ODE adjoint ({gradient!r}); use "
                "gradient='adjoint' and set the backward method with `adjoint_method`."
            )
        if adjoint_method is None:
            if self.method == "reversible_heun":
                return "adjoint_reversible_heun"
            return "milstein" if self.sde_type == "ito" else "midpoint"
        table = {**SDE_METHODS, **_ADJOINT_ONLY}
        valid = _valid_methods(self.sde_type, "diagonal", table)
        if self.method != "reversible_heun" and "adjoint_reversible_heun" in valid:
            valid.remove("adjoint_reversible_heun")
        if adjoint_method not in valid:
            raise ValueError(
                f"`adjoint_method`={adjoint_method!r} cannot solve the adjoint of this {self.sde_type} SDE with "
                f"method={self.method!r}; valid adjoint methods: {valid} (or leave it None)."
            )
        return adjoint_method

    @staticmethod
    def _inverse_softplus(sigma: float | torch.Tensor, channels: int) -> torch.Tensor:
        s = torch.as_tensor(sigma, dtype=torch.get_default_dtype()).detach().clone()
        if s.dim() == 0:
            s = s.expand(channels).clone()
        if s.shape != (channels,):
            raise ValueError(
                f"`sigma` must be a number or have shape ({channels},) (one per channel), got {tuple(s.shape)}."
            )
        if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
            raise ValueError(
                f"`sigma` must be finite and > 0 (it is softplus of a parameter), got {sigma!r}; "
                "use noise=None for the noise-free block."
            )
        return torch.where(s > 20, s, torch.log(torch.expm1(s)))

    # -- public ---------------------------------------------------------------------------------------
    @property
    def sigma(self) -> torch.Tensor | None:
        """The per-channel noise scale ``softplus(ρ)``, shape ``(C,)`` (``None`` without noise)."""
        return None if self.rho is None else nnf.softplus(self.rho)

    @property
    def times(self) -> torch.Tensor:
        """The step grid (float64): the times at which :meth:`solve` can save the state."""
        return self._grid.clone()

    @property
    def stochastic(self) -> bool:
        """Whether the next call integrates with noise."""
        return self.noise is not None and (self.training or self.noise_at_eval)

    def reseed(self, seed: int | None = None) -> None:
        """Restart the sequence of Brownian paths (optionally with a new ``seed``)."""
        if seed is not None:
            self.seed = seed
        self._calls = 0

    def forward(self, y0: torch.Tensor, u: torch.Tensor | None = None, bm=None) -> torch.Tensor:
        """``y(T)`` for ``y(0) = y0`` (``(batch, *state_shape)``); averaged over ``paths`` when stochastic.

        ``bm``: a torchsde Brownian motion on ``[0, T]`` of shape ``(paths · batch, numel per sample)`` (path
        ``k`` of sample ``i`` is row ``k · batch + i``) to use instead of the block's seeded one, with the Lévy-area
        approximation that ``method`` needs (``srk``: space-time, ``log_ode``: foster); ignored without noise.
        """
        return self.solve(y0, u, bm=bm).y

    # torchdiffeq's and torchsde's step loops are data-dependent control flow with host synchronisation on every
    # step: under torch.compile the solve runs eagerly and everything around it is compiled (under inductor
    # the adaptive loop failed outright with a view+inplace error).
    @eager_under_compile
    def solve(self, y0: torch.Tensor, u: torch.Tensor | None = None, t=None, bm=None) -> Solution:
        """As calling the block, and the (path-averaged) states at times ``t``, which must be points of the step
        grid :attr:`times` (the block never interpolates a Brownian path). Its ``stats`` hold the call's counts
        (``nfe_backward`` and ``steps_backward`` are filled in by its backward)."""
        return report(self._solve_call(y0, u, t, bm, SolverStats()))

    def _solve_call(self, y0: torch.Tensor, u: torch.Tensor | None, t, bm, stats: SolverStats) -> Solution:
        if under_vmap():
            raise ValueError(
                "SDEBlock under torch.vmap: torchsde's solvers read their Brownian paths and steps on the host, "
                "which torch.func refuses. Pass the instances as one batch (each sample draws its own path)."
            )
        bound = self.bind(y0, u)
        if self.rho is not None and (y0.dim() < 2 or y0.shape[1] != self.rho.shape[0]):
            raise ValueError(
                f"`y0` has {y0.shape[1] if y0.dim() > 1 else 0} channels but `sigma` has {self.rho.shape[0]}; "
                "build the block with matching `channels`."
            )
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "SDEBlock does not differentiate its output times `t` (points of its step grid, where the "
                "Brownian path is sampled): pass `t.detach()`, or use ODEBlock for gradients in t."
            )
        save = None if t is None else self._save_indices(t)
        if y0.shape[0] == 0:  # an empty shard (data-parallel): nothing to integrate, every parameter in the graph
            y = y0 + 0 * bound(torch.zeros((), dtype=torch.float64), y0)
            if self.rho is not None:
                y = y + 0 * self.rho.sum()
            ys = None if save is None else y.unsqueeze(0).expand(len(save), *y.shape)
            return Solution(y=y, ts=None if save is None else self._grid[save].clone(), ys=ys, stats=stats)
        stochastic = self.stochastic
        paths = self.paths if stochastic else 1
        shape = tuple(y0.shape[1:])
        batch = y0.shape[0]
        y = y0.reshape(batch, -1)
        if paths > 1:
            y = y.repeat(paths, 1)
            if u is not None:
                bound = BoundField(self.field, u.repeat(paths, *([1] * (u.dim() - 1))))
        rho = self.rho if stochastic else None
        pieces = getattr(getattr(self.field, "grid", None), "L", 1)
        sdes = [
            _SDE(
                bound,
                shape,
                rho,
                self.noise == "diagonal",
                self.sde_type,
                stats,
                count_vjp=self.gradient.counts_vjp,
                l=l,
            )
            for l in range(pieces)
        ]
        grid = self._grid.to(device=y.device, dtype=y.dtype)
        bm = self._brownian(bm, y, grid, stochastic)
        extra = [u] if u is not None and u.requires_grad else []
        states = self._integrate(sdes, y, grid, bm, extra)
        check_result(states[-1], lambda: self._nonfinite(states, grid))
        stats.steps_forward = len(grid) - 1
        for sde in sdes:
            sde.backward_phase = True
        y = states[-1]
        if y.requires_grad:
            steps = len(grid) - 1
            y.register_hook(lambda g: setattr(stats, "steps_backward", steps))

        def average(z: torch.Tensor) -> torch.Tensor:
            z = z.reshape(paths, batch, *shape)
            return z[0] if paths == 1 else z.mean(0)

        ys = ts = None
        if save is not None:
            ys = torch.stack([average(states[i]) for i in save])
            ts = self._grid[save].clone()
        return Solution(y=average(y), ts=ts, ys=ys, stats=stats)

    def _brownian(self, bm, y: torch.Tensor, grid: torch.Tensor, stochastic: bool):
        """The caller's Brownian motion ``bm`` (checked against the state's shape), or a fresh
        ``BrownianInterval`` over the grid from this call's entropy (:meth:`_entropy`)."""
        import torchsde  # imported by the first solve, not by `import cde_nets`

        if bm is None or not stochastic:
            return torchsde.BrownianInterval(
                t0=float(grid[0]),
                t1=float(grid[-1]),
                size=tuple(y.shape),
                dtype=y.dtype,
                device=y.device,
                entropy=self._entropy(),
                levy_area_approximation=self._levy,
            )
        if tuple(getattr(bm, "shape", ())) != tuple(y.shape):
            raise ValueError(
                f"`bm` must have shape {tuple(y.shape)} (paths · batch, numel per sample), got "
                f"{tuple(getattr(bm, 'shape', ()))}."
            )
        return bm

    def _nonfinite(self, states: list[torch.Tensor], grid: torch.Tensor) -> str:
        name = nonfinite_parameter(self)
        if name is not None:
            return (
                f"parameter `{name}` holds NaN/inf, so the solve is non-finite; restore the last good checkpoint "
                "or re-initialise it."
            )
        k = next(i for i, y in enumerate(states) if not bool(torch.isfinite(y).all()))
        return (
            f"the state became non-finite (NaN/inf) in step {k} of {len(states) - 1} (t = {float(grid[k - 1]):.6g}"
            f" to {float(grid[k]):.6g}); use a smaller `step_size`, a smaller noise scale, or float64."
        )

    def _save_indices(self, t) -> list[int]:
        tt = self.check_times(t, self.T)
        grid = self._grid
        idx = []
        for ti in tt.tolist():
            j = int(torch.argmin((grid - ti).abs()))
            if abs(float(grid[j]) - ti) > 1e-12 * max(1.0, self.T):
                raise ValueError(
                    f"`t`={ti} is not a point of the step grid; an SDE block saves states only at "
                    "its grid times (`block.times`). Choose those, or a `step_size` that divides them."
                )
            idx.append(j)
        return idx

    # -- internals ------------------------------------------------------------------------------------
    def _entropy(self) -> int:
        k = self._calls
        self._calls += 1
        if self.seed is None:
            return int(torch.randint(0, 2**31 - 1, ()))
        return int(np.random.SeedSequence([self.seed, k]).generate_state(1)[0])

    def _integrate(
        self, sdes: list[_SDE], y: torch.Tensor, grid: torch.Tensor, bm, extra_params: list
    ) -> list[torch.Tensor]:
        import torchsde

        # One torchsde call per step with dt >= the step: torchsde clamps the step to the end of `ts`, so every
        # step (forward and the adjoint's reverse) lands exactly on the grid and each piece keeps its parameters.
        # The solver's extra state (reversible_heun's stored f, g) is carried across the steps of one piece and
        # restarted at each piece boundary, where the parameters jump.
        # the call's input u is differentiated too (the adjoint's vector-Jacobian products reach it)
        params = [p for p in self.parameters() if p.requires_grad] + list(extra_params)
        extra = None
        states = [y]
        big = float(self.T)
        tol = dict(adaptive=self.adaptive, rtol=self.rtol, atol=self.atol)
        for i in range(len(grid) - 1):
            sde = sdes[min(i // self._steps_per_piece, len(sdes) - 1)]
            if i % self._steps_per_piece == 0:
                extra = None
            ts = grid[i : i + 2]
            # Adaptive stepping starts each grid step with the whole step and subdivides it from there.
            dt = float(ts[1] - ts[0]) if self.adaptive else big
            sde.arm_probe()
            with warnings.catch_warnings():
                # reversible_heun's warning about `ts` spacing vs `dt` does not apply: each call is one whole step.
                warnings.filterwarnings("ignore", message="The spacing between time points")
                # Additive and zero noise run as torchsde's diagonal type, but they are additive: adaptive Euler
                # converges (diagonal noise with euler is refused at construction).
                warnings.filterwarnings("ignore", message="Numerical solution is not guaranteed to converge")
                if isinstance(self.gradient, Adjoint):
                    ys, extra = torchsde.sdeint_adjoint(
                        sde,
                        y,
                        ts,
                        bm=bm,
                        method=self.method,
                        dt=dt,
                        adjoint_method=self.adjoint_method,
                        adjoint_params=params,
                        extra_solver_state=extra,
                        extra=True,
                        adjoint_adaptive=self.adaptive,
                        adjoint_rtol=self.rtol,
                        adjoint_atol=self.atol,
                        **tol,
                    )
                else:
                    ys, extra = torchsde.sdeint(
                        sde, y, ts, bm=bm, method=self.method, dt=dt, extra_solver_state=extra, extra=True, **tol
                    )
            y = ys[-1]
            states.append(y)
        return states

    def extra_repr(self) -> str:
        return (
            f"noise={self.noise!r}, T={self.T}, method={self.method!r}, sde_type={self.sde_type!r}, "
            f"gradient={self.gradient!r}, step_size={self.step_size}, adaptive={self.adaptive}, paths={self.paths}"
        )
