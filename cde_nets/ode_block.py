"""Continuous mode: a field integrated over ``[0, T]`` by torchdiffeq (SPEC §5)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from cde_nets.solvers.adapter import (
    ADAPTIVE_METHODS,
    FIXED_METHODS,
    GRADIENTS,
    SolverStats,
    aligned_grid,
    check_method,
    check_options,
    integrate,
    validate_tolerances,
)
from cde_nets.solvers.errors import check_positive
from cde_nets.solvers.stopping import integrate_until_converged

from .fields.base import Field
from .pieces import gathered

__all__ = ["ODEBlock"]


class _Rows(nn.Module):
    """The field restricted to batch rows ``idx`` on every call — also in the adjoint's backward solve, which
    runs long after the forward window (a ``with field.rows(idx)`` around the solve would have exited)."""

    def __init__(self, field: nn.Module, idx: torch.Tensor):
        super().__init__()
        self.field, self.idx = field, idx

    def forward(self, t, y):
        with self.field.rows(self.idx):
            return self.field(t, y)


class ODEBlock(nn.Module):
    r"""``y(T) = y(0) + ∫_0^T F(t, y) dt`` for a :class:`~cde_nets.fields.base.Field` ``F``.

    Args:
        field: the vector field (its parameters are the block's parameters).
        T: end time; defaults to ``field.T`` (must equal it when the field is time-varying).
        method: a torchdiffeq method — adaptive (``dopri5``, ``dopri8``, ``bosh3``, ``fehlberg2``,
            ``adaptive_heun``) or fixed-step (``euler``, ``midpoint``, ``heun2``, ``heun3``, ``rk4``).
        rtol, atol: tolerances of adaptive methods (> 0).
        gradient: ``"adjoint"`` (``odeint_adjoint``: O(1) memory, continuous adjoint; seminorm by default) or
            ``"backprop"`` (differentiate through the solver's steps: the discrete adjoint of the solver).
        step_size: fixed-step methods only; default one step per parameter piece (the discrete-mode grid). The
            grid always contains every piece boundary.
        jumps: tell adaptive solvers where time-varying parameters jump (torchdiffeq's ``jump_t``).
        max_steps: steps allowed per solve before :class:`~solvers.errors.SolverError` (with the NFE so far).
        options: further torchdiffeq options (unknown keys raise).
        adjoint_method, adjoint_rtol, adjoint_atol, seminorm: settings of the adjoint's backward solve.
        stop: ``dict(eps=..., window=T/20)``: pattern-dependent stopping time — each sample stops once
            ``‖F(t, y)‖ < eps`` (checked every ``window``); the batch is compacted as samples finish, and the block
            returns ``(y, stopping_times)``.

    After each call, :attr:`stats` holds ``nfe_forward``, ``nfe_backward`` (filled in by ``backward()``),
    accepted (``steps_*``) and rejected (``rejected_*``) steps of the forward and backward solves.
    """

    def __init__(
        self,
        field: Field,
        T: float | None = None,
        method: str = "dopri5",
        rtol: float = 1e-6,
        atol: float = 1e-8,
        gradient: str = "adjoint",
        step_size: float | None = None,
        jumps: bool = True,
        max_steps: int = 100_000,
        options: dict | None = None,
        adjoint_method: str | None = None,
        adjoint_rtol: float | None = None,
        adjoint_atol: float | None = None,
        seminorm: bool = True,
        stop: dict | None = None,
    ):
        super().__init__()
        if not isinstance(field, nn.Module) or not callable(getattr(field, "forward", None)):
            raise TypeError(f"`field` must be an nn.Module with forward(t, y), got {type(field).__name__}.")
        self.field = field
        grid = getattr(field, "grid", None)
        if T is None:
            if grid is None:
                raise ValueError("`T` is required for a field without a time grid.")
            T = grid.T
        self.T = check_positive("T", T, "T is the end time of the integration over [0, T].")
        if grid is not None and grid.L > 1 and abs(self.T - grid.T) > 1e-12 * grid.T:
            raise ValueError(
                f"`T`={self.T} differs from the field's T={grid.T}, over which its {grid.L} parameter pieces "
                "are laid out; leave `T` unset or build the field with this T."
            )
        self.method = check_method(method)
        self.options = check_options(method, options)
        self.rtol, self.atol = validate_tolerances(rtol, atol)
        if gradient not in GRADIENTS:
            raise ValueError(f"`gradient` must be one of {GRADIENTS}, got {gradient!r}.")
        self.gradient = gradient
        if step_size is not None:
            if method in ADAPTIVE_METHODS:
                raise ValueError(
                    f"`step_size` applies to fixed-step methods {sorted(FIXED_METHODS)}, not {method!r}; "
                    "use `rtol`/`atol` (or options={'first_step': ...}) for adaptive methods."
                )
            check_positive("step_size", step_size, "It is the largest fixed step; it must be > 0.")
        self.step_size = step_size
        self.jumps = bool(jumps)
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"`max_steps` must be a positive integer, got {max_steps!r}.")
        self.max_steps = max_steps
        if adjoint_method is not None:
            check_method(adjoint_method)
        self.adjoint_method = adjoint_method
        self.adjoint_rtol = None if adjoint_rtol is None else check_positive("adjoint_rtol", adjoint_rtol)
        self.adjoint_atol = None if adjoint_atol is None else check_positive("adjoint_atol", adjoint_atol)
        self.seminorm = bool(seminorm)
        if stop is not None:
            if not isinstance(stop, dict) or set(stop) - {"eps", "window"} or "eps" not in stop:
                raise ValueError(f"`stop` must be dict(eps=..., window=...) (eps required), got {stop!r}.")
            check_positive("eps", stop["eps"], "It is the per-sample threshold on ‖F(t, y)‖.")
            stop = {"eps": float(stop["eps"]), "window": check_positive("window", stop.get("window", self.T / 20))}
        self.stop = stop
        self._stats = SolverStats()

    @property
    def stats(self) -> dict[str, int]:
        """Counts of the last call (``nfe_backward`` is filled in when its backward pass runs)."""
        return self._stats.as_dict()

    def _grids(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        grid = getattr(self.field, "grid", None)
        bounds = grid.boundaries.tolist() if grid is not None else [0.0, self.T]
        if self.method in FIXED_METHODS:
            return None, aligned_grid(bounds, self.step_size)
        jump_t = grid.jumps if (grid is not None and self.jumps) else None
        return jump_t, None

    def trajectory(self, y0: torch.Tensor, t: torch.Tensor | list[float], u: torch.Tensor | None = None):
        """The solution at times ``t`` (increasing, within ``[0, T]``, starting at 0): ``(len(t), *y0.shape)``.

        Fixed-step methods step *through* every requested time (each is added to the step grid, so the values are
        the scheme's own, not interpolated): times finer than ``step_size`` mean more, shorter steps. To see the
        ``n``-step solution, ask for times on its grid.
        """
        t = torch.as_tensor(t, dtype=torch.float64)
        if t.dim() != 1 or len(t) < 2 or not bool((t[1:] > t[:-1]).all()):
            raise ValueError("`t` must be a 1-D strictly increasing sequence of at least two times.")
        if float(t[0]) != 0.0 or float(t[-1]) > self.T * (1 + 1e-12):
            raise ValueError(f"`t` must start at 0 and end at or before T={self.T}, got [{float(t[0])}, {float(t[-1])}].")
        return self._solve(y0, t.to(y0.device), u)

    def forward(self, y0: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        """``y(T)`` for ``y(0) = y0``; ``u`` binds the block input of non-autonomous fields (NAIS)."""
        if self.stop is not None:
            with self._gathered():
                return self._solve_stopping(y0, u)
        t = torch.tensor([0.0, self.T], dtype=torch.float64, device=y0.device)
        return self._solve(y0, t, u)[-1]

    def _gathered(self):
        """Backprop differentiates through every field call: pieces gathered once per call, as in discrete mode.
        The adjoint's backward solve runs after the call returns, so it must not see the call's views."""
        return gathered(self.field) if self.gradient == "backprop" else nullcontext()

    def _solve_stopping(self, y0: torch.Tensor, u: torch.Tensor | None):
        self._prepare(y0, u)
        self._stats = SolverStats()
        jump_t, grid = self._grids()
        params = [p for p in self.field.parameters() if p.requires_grad]

        def solve(y, t0, t1, idx):
            t = torch.tensor([t0, t1], dtype=torch.float64, device=y.device)
            g = None if grid is None else grid[(grid >= t0) & (grid <= t1)]
            ys, _ = integrate(
                _Rows(self.field, idx), y, t, method=self.method, rtol=self.rtol, atol=self.atol,
                gradient=self.gradient, params=params, jump_t=jump_t, grid=g, options=self.options,
                max_steps=self.max_steps, seminorm=self.seminorm, adjoint_method=self.adjoint_method,
                adjoint_rtol=self.adjoint_rtol, adjoint_atol=self.adjoint_atol, stats=self._stats)
            return ys[-1]

        def field(t, y, idx):
            with self.field.rows(idx):
                return self.field(t, y)

        return integrate_until_converged(solve, field, y0, t_max=self.T, window=self.stop["window"],
                                         eps=self.stop["eps"])

    def _solve(self, y0: torch.Tensor, t: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        self._prepare(y0, u)
        jump_t, grid = self._grids()
        self._stats = SolverStats()
        params = [p for p in self.field.parameters() if p.requires_grad]
        with self._gathered():
            ys, _ = integrate(
                self.field, y0, t, method=self.method, rtol=self.rtol, atol=self.atol, gradient=self.gradient,
                params=params, jump_t=jump_t, grid=grid, options=self.options, max_steps=self.max_steps,
                seminorm=self.seminorm, adjoint_method=self.adjoint_method, adjoint_rtol=self.adjoint_rtol,
                adjoint_atol=self.adjoint_atol, stats=self._stats,
            )
        return ys

    def _prepare(self, y0: torch.Tensor, u: torch.Tensor | None) -> None:
        if hasattr(self.field, "check_state"):
            self.field.check_state(y0, "y0")
        if u is not None:
            if not hasattr(self.field, "bind"):
                raise TypeError(f"`u` was given but {type(self.field).__name__} takes no input; drop `u`.")
            self.field.bind(u)
        elif getattr(self.field, "needs_input", False) and getattr(self.field, "u", None) is None:
            raise ValueError(f"{type(self.field).__name__} needs a block input: pass `u=` or call `field.bind(u)`.")

    def extra_repr(self) -> str:
        return f"T={self.T}, method={self.method!r}, rtol={self.rtol}, atol={self.atol}, gradient={self.gradient!r}"
