"""Discrete mode: one scheme step per parameter piece, ``h = T / L`` — the choice of scheme is the layer
architecture (forward Euler on a Hamiltonian field is H1-DNN, Galimberti et al. 2023, eq. 9; semi-implicit Euler
on a separable one H2-DNN, eqs. 12-13; the heavy ball on any field the blog's second-order residual, B §8; ...).

The net holds the field itself, so it shares every parameter with an :class:`~cde_nets.ODEBlock` on the same
field: a model trained in discrete mode evaluates in continuous mode and the other way round. Any ``nn.Module``
with ``forward(t, y)`` runs too: ``discretize(module, scheme, T=..., steps=N)`` takes ``N`` steps of ``T / N``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from cde_nets.blocks.base import Block
from cde_nets.blocks.collected_terms import report
from cde_nets.blocks.compile_boundary import eager_under_compile
from cde_nets.blocks.gathering import gathered
from cde_nets.blocks.nonfinite import check_result, nonfinite_parameter
from cde_nets.blocks.regularisers import DiscreteIntegrands, TrajectoryRegularisers
from cde_nets.blocks.solution import Solution
from cde_nets.blocks.stop import Stop, as_stop
from cde_nets.fields.base import Field
from cde_nets.fields.bound import BoundField, as_field
from cde_nets.solvers.counting import SolverStats
from cde_nets.solvers.schemes import Euler, RungeKutta, Scheme, get_scheme
from cde_nets.solvers.stopping import unroll

# Per-sample stopping and events shrink the batch as samples finish and branch on the data every layer: under
# torch.compile each layer would be a graph of its own, recompiled for every layer index and batch size (70 s of CPU
# for a 30-layer NAIS net). The loop runs eagerly inside a compiled model, as the continuous solvers' loops do.
_unroll = eager_under_compile(unroll)

__all__ = ["discretize", "DiscreteNet"]

_NET_STOP: Any = object()  # solve(stop=...) left unset: the net's own stopping rule


class DiscreteNet(Block):
    """``L`` layers of ``scheme`` on ``field`` (one per parameter piece, ``h = T / L``); see :func:`discretize`,
    which takes the same arguments. Everything is validated here, however the net is built.

    ``net(y0, u=None)`` returns the last layer's state (each sample's state where it stopped, with ``stop``);
    ``net.solve(y0, u=None, t=None)`` returns a :class:`~cde_nets.blocks.solution.Solution` with the layer states at the
    boundaries ``t`` (a subset of :attr:`times`), the counts (``nfe_forward``: field evaluations, ``steps_forward``:
    layers) and, with ``stop``, each sample's ``depths`` and ``stop_times = depths · h``.
    """

    field: Field  # a plain module arrives wrapped as a ModuleField

    def __init__(
        self,
        field: nn.Module,
        scheme: str | Scheme = "euler",
        *,
        T: float | None = None,
        steps: int | None = None,
        k: int | None = None,
        split: tuple[int, int] | None = None,
        momentum: tuple[float, float] | None = None,
        tie_eta: bool = False,
        memory_free: bool = False,
        stop: Stop | dict | None = None,
        regularisers: Sequence[str] = (),
        noise: str | None = None,
    ):
        field = as_field(field, T, steps)
        super().__init__(field, T)
        sch = get_scheme(scheme, k=k, momentum=momentum, tie_eta=tie_eta)
        self.scheme = sch.for_field(field, split)
        self.split = split
        self.memory_free = bool(memory_free)
        L = field.grid.L
        self.h = self.T / L
        if memory_free:
            self.scheme.check_invertible(field)
        self.stop = self._check_stop(as_stop(stop, "discrete"))
        self.regularisers = self._check_regularisers(TrajectoryRegularisers(regularisers, noise))
        shape = tuple(getattr(field, "state_shape", ()) or ())
        channels = shape[0] if shape and isinstance(shape[0], int) else 1  # plain modules: one value per layer
        dtype = next((p.dtype for p in field.parameters() if p.is_floating_point()), torch.get_default_dtype())
        for name, init in self.scheme.coefficient_init(L, channels).items():
            self.register_parameter(name, nn.Parameter(init.to(dtype)))

    def _check_regularisers(self, regs: TrajectoryRegularisers) -> TrajectoryRegularisers:
        """The discrete analogues exist for explicit Runge-Kutta layers (forward Euler: the Riemann sums), whose
        increment is ``h Σ b_i F(Y_i)``; kinetic and Jacobian terms only."""
        if not regs:
            return regs
        if not isinstance(self.scheme, (Euler, RungeKutta)) or self.memory_free or self.stop is not None:
            raise ValueError(
                "`regularisers` in discrete mode are the Runge-Kutta sums of the continuous integrals, defined for "
                "the explicit Runge-Kutta schemes (euler, midpoint, rk4, rk4_classical) run over "
                f"the whole batch; got scheme={self.scheme.name!r}"
                + (", memory_free=True" if self.memory_free else "")
                + (", stop" if self.stop is not None else "")
                + ". See the flows guide for which architectures have them."
            )
        if "taylor2" in regs.names:
            raise ValueError(
                "`regularisers`: 'taylor2' has no discrete analogue here (a layer's field is constant in time on "
                "its piece); use 'kinetic' and 'jacobian', or an ODEBlock."
            )
        return regs

    def _check_stop(self, stop: Stop | None) -> Stop | None:
        if stop is not None and self.memory_free:
            raise ValueError(
                "`stop` compacts the batch as samples finish; it does not combine with `memory_free`. Drop one of them."
            )
        return stop

    # -- what the net is ---------------------------------------------------------------------------------
    @property
    def architecture(self) -> tuple[str, str]:
        """``(name, paper equation)`` this scheme realises on this field, for the parameters actually used."""
        return self.scheme.architecture(self.field.kind)

    @property
    def order(self) -> int:
        """The convergence order that holds on this field (e.g. ``verlet``: 2 when separable, else 1)."""
        return self.scheme.order

    @property
    def properties(self) -> frozenset[str]:
        """Structural properties of the layer map on this field, e.g. ``{"symplectic"}``."""
        return self.scheme.properties

    @property
    def times(self) -> torch.Tensor:
        """The ``L + 1`` layer boundaries ``l h`` (float64); layer ``l`` maps the state at ``l h`` to ``(l + 1) h``."""
        L = self.field.grid.L
        ts = torch.arange(L + 1, dtype=torch.float64) * self.h
        ts[-1] = self.T
        return ts

    def coefficients(self, ndim: int = 2) -> dict[str, torch.Tensor]:
        """The scheme's per-layer coefficients ``(L, ...)`` (momentum ``m`` and ``eta_h = η h`` shaped
        ``(L, 1, C, 1, ...)`` for a state of ``ndim`` dimensions; two-step ``k``), from its learnable tensors."""
        params = {name: getattr(self, name) for name in self.scheme.coefficients}
        return self.scheme.coefficient_values(params, self.h, ndim)

    def _coef_views(self, ndim: int) -> dict[str, tuple[torch.Tensor, ...]]:
        # one unbind node per call, as for the field's pieces (a slice per layer makes backward O(L²))
        return {k: c.unbind(0) for k, c in self.coefficients(ndim).items()}

    def init_state(self, y0: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The scheme state for ``y0``."""
        return self.scheme.init(y0)

    def step(
        self, l: int, state: tuple[torch.Tensor, ...], coef: dict | None = None, u: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """One layer: scheme state at layer ``l`` → layer ``l + 1`` (``u``: the block input of a NAIS field)."""
        if coef is None:
            coef = self._coef_views(state[0].dim())
        try:
            return self.scheme.step(BoundField(self.field, u), l, state, self.h, coef, l * self.h)
        finally:
            self.scheme.end_pass()

    def layer_states(self, y0: torch.Tensor, u: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``[y_0, y_1, ..., y_L]`` as separate tensors of one graph, so that a loss on ``y_L`` can be
        differentiated with respect to every intermediate state (depth profiles, backward sensitivity matrices).
        ``solve(y0, t=net.times).ys`` holds the same values stacked, which ``autograd.grad`` cannot reach per layer."""
        f = self.bind(y0, u)
        with gathered(self.field):
            coef = self._coef_views(y0.dim())
            state = self.scheme.init(y0)
            states = []
            try:
                for l in range(self.field.grid.L + 1):
                    if l:
                        state = self.scheme.step(f, l - 1, state, self.h, coef, (l - 1) * self.h)
                    states.append(self.scheme.readout(state))
                    state = self.scheme.with_readout(state, states[-1])
            finally:
                self.scheme.end_pass()
        return states

    # -- solving -------------------------------------------------------------------------------------------
    def solve(
        self,
        y0: torch.Tensor,
        u: torch.Tensor | None = None,
        t: Sequence[float] | torch.Tensor | None = None,
        *,
        stop: Stop | dict | None = _NET_STOP,
        event: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> Solution:
        """Run the layers from ``y0``. ``t``: layer boundaries at which to save the state (increasing, each
        ``l h``; see :attr:`times`). ``stop``: this call's stopping rule instead of the net's (``None``: run all
        ``L`` layers), e.g. a tighter ``eps`` for evaluation.

        ``event``: a per-sample event on the layer index, ``g(l, y_l) -> (batch,)``, evaluated on ``y_0`` and after
        every layer: each sample stops after the first layer ``l`` at which ``g`` changes sign (or reaches 0) and
        leaves the batch; ``depths``/``stop_times`` say where, ``fired`` whether it happened within ``L`` layers.

        The result's ``stats`` count the call's layers and field evaluations, its ``regularisation`` the
        integrated terms of a net built with ``regularisers=``; the net keeps nothing between calls."""
        return report(self._solve_call(y0, u, t, stop, event))

    def _solve_call(self, y0: torch.Tensor, u: torch.Tensor | None, t, stop, event) -> Solution:
        try:
            return self._solve_pass(y0, u, t, stop, event)
        finally:
            self.scheme.end_pass()  # the net keeps nothing between calls

    def _solve_pass(self, y0: torch.Tensor, u: torch.Tensor | None, t, stop, event) -> Solution:
        f = self.bind(y0, u)
        if self.regularisers and (event is not None or stop not in (_NET_STOP, None)):
            raise ValueError(
                "a net with `regularisers` sums them over every layer of the whole batch: drop `event`/`stop` "
                "from this call, or solve with a net built without regularisers."
            )
        if event is not None:
            if stop is not _NET_STOP or t is not None or self.memory_free or self.stop is not None:
                raise ValueError(
                    "`event` stops each sample on its own; it does not combine with `stop`, `t` or "
                    "`memory_free` (nor a net built with `stop`). Drop one of them."
                )
            if not callable(event):
                raise TypeError(f"`event` must be a callable g(l, y) -> (batch,), got {type(event).__name__}.")
            with gathered(self.field):
                return self._finite(self._solve_event(f, y0, event), f, y0)
        stop = self.stop if stop is _NET_STOP else self._check_stop(as_stop(stop, "discrete"))
        ts, save = (None, None) if t is None else self._layer_indices(t, y0.device)
        if save is not None and (stop is not None or self.memory_free):
            raise ValueError(
                "`t` saves every sample's state at the same layers; it does not combine with "
                f"`{'stop' if stop is not None else 'memory_free'}`. Drop `t`."
            )
        with gathered(self.field):
            if self.memory_free:
                from cde_nets.blocks.invertible import memory_free

                y = memory_free(self, f, y0)
                return self._finite(Solution(y=y, stats=self._stats(self.field.grid.L)), f, y0)
            coef = self._coef_views(y0.dim())
            state = self.scheme.init(y0)
            if stop is not None:
                return self._finite(self._solve_stopping(f, state, coef, stop), f, y0)
            scheme, h = self.scheme, self.h
            g = f if not self.regularisers else DiscreteIntegrands(f, self.regularisers, self._weights(), h, y0)
            ys = [y0] if save is not None and save[0] == 0 else []
            for l in range(self.field.grid.L):
                state = scheme.step(g, l, state, h, coef, l * h)
                if save is not None and l + 1 in save:
                    ys.append(scheme.readout(state))
            y = scheme.readout(state)
            self._check_condition_n1(y, f.u)
        sol = Solution(y=y, ts=ts, ys=None if save is None else torch.stack(ys), stats=self._stats(self.field.grid.L))
        if isinstance(g, DiscreteIntegrands):
            sol.regularisation = g.means()
        return self._finite(sol, f, y0)

    def _check_condition_n1(self, y: torch.Tensor, u: torch.Tensor | None) -> None:
        """A net of Euler layers without stopping on a field with a stability condition (NAIS): where the weights
        do not bound it everywhere (``contracts_everywhere``), measure it where the layers ended, and warn once if
        it fails (the stopping net warns where its samples ran out of layers)."""
        bound = getattr(self.field, "contracts_everywhere", None)
        if bound is None or u is None or self in _WARNED or not isinstance(self.scheme, Euler):
            return
        if torch.compiler.is_compiling() or bound(self.h):
            return
        _warn_if_unstable(self, self.field, y.detach(), u, self.field.grid.L - 1, self.h, False)

    def _weights(self) -> tuple[float, ...]:
        """The layer's stage weights ``b_i`` (forward Euler: one stage of weight 1)."""
        return tuple(self.scheme.tableau.b) if isinstance(self.scheme, RungeKutta) else (1.0,)

    def _finite(self, sol: Solution, f: BoundField, y0: torch.Tensor) -> Solution:
        """One fused finiteness check of the result (skipped while torch.compile traces, to keep one graph)."""
        if not torch.compiler.is_compiling():
            check_result(sol.y, lambda: self._nonfinite(f, y0))
        return sol

    def _nonfinite(self, f: BoundField, y0: torch.Tensor) -> str:
        """Why the layers went non-finite: a parameter holding NaN/inf, or the first layer whose output is."""
        name = nonfinite_parameter(self)
        if name is not None:
            return (
                f"parameter `{name}` holds NaN/inf, so the net's output is non-finite; restore the last good "
                "checkpoint (a diverged optimiser step?) or re-initialise it."
            )
        L = self.field.grid.L
        with torch.no_grad(), gathered(self.field):
            coef = self._coef_views(y0.dim())
            state = self.scheme.init(y0.detach())
            for l in range(L):
                state = self.scheme.step(f, l, state, self.h, coef, l * self.h)
                if not bool(torch.isfinite(self.scheme.readout(state)).all()):
                    name, _ = self.architecture
                    return (
                        f"the state became non-finite (NaN/inf) at layer {l} of {L} ({name}, h = {self.h:.4g}): "
                        "the layers blow up there; use more layers (a smaller h), shrink the weights or inputs, "
                        "or use float64."
                    )
        return "the net returned NaN/inf."

    def _solve_stopping(self, f: BoundField, state: tuple, coef: dict, stop: Stop) -> Solution:
        """Pattern-dependent depth (Ciccone et al. 2018, §5.3): a sample stops after layer ``i`` once
        ``‖y_i − y_{i−1}‖ < eps``; step ``i`` uses piece ``min(i, L − 1)``; finished rows leave the batch."""
        scheme, L, h = self.scheme, self.field.grid.L, self.h
        rows: dict[str, Any] = {}

        def step(i: int, st: tuple, idx: torch.Tensor) -> tuple:
            if rows.get("idx") is not idx:  # the same idx until the batch shrinks: gather the input once
                rows["idx"], rows["f"] = idx, f.rows(idx)
            return scheme.step(rows["f"], min(i, L - 1), st, h, coef, i * h)

        max_depth = stop.max_depth or L
        converged = torch.ones(state[0].shape[0], dtype=torch.bool, device=state[0].device)
        final, depths = _unroll(
            step, state, eps=stop.eps, max_depth=max_depth, readout=scheme.readout, converged=converged
        )
        taken = int(depths.max()) if depths.numel() else 0
        y = scheme.readout(final)
        unconverged = int((~converged).sum())
        if unconverged:
            u = None if f.u is None else f.u[~converged]
            _warn_if_unstable(self, self.field, y[~converged].detach(), u, min(max_depth, L) - 1, h, True)
        return Solution(
            y=y,
            stats=self._stats(taken),
            depths=depths,
            stop_times=depths.to(torch.float64) * h,
            unconverged=unconverged,
        )

    def _solve_event(self, f: BoundField, y0: torch.Tensor, event: Callable) -> Solution:
        scheme, L, h = self.scheme, self.field.grid.L, self.h
        coef = self._coef_views(y0.dim())
        with torch.no_grad():
            g0 = event(0, y0)
        if not isinstance(g0, torch.Tensor) or tuple(g0.shape) != (y0.shape[0],):
            raise ValueError(
                f"`event` must return one value per sample, shape ({y0.shape[0]},); got "
                f"{tuple(getattr(g0, 'shape', ()))}."
            )
        sign0 = torch.sign(g0)
        fired = torch.zeros(y0.shape[0], dtype=torch.bool, device=y0.device)
        rows: dict[str, Any] = {}

        def step(i: int, st: tuple, idx: torch.Tensor) -> tuple:
            if rows.get("idx") is not idx:
                rows["idx"], rows["f"] = idx, f.rows(idx)
            return scheme.step(rows["f"], i, st, h, coef, i * h)

        def crossed(i: int, prev: torch.Tensor, nxt: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            g = event(i + 1, nxt)
            hit = (torch.sign(g) != sign0[idx]) | (g == 0)
            fired[idx[hit]] = True
            return hit

        final, depths = _unroll(step, scheme.init(y0), eps=1.0, max_depth=L, readout=scheme.readout, done=crossed)
        taken = int(depths.max()) if depths.numel() else 0
        return Solution(
            y=scheme.readout(final),
            stats=self._stats(taken),
            depths=depths,
            stop_times=depths.to(torch.float64) * h,
            fired=fired,
        )

    def _stats(self, steps: int) -> SolverStats:
        L = self.field.grid.L
        stats = SolverStats(nfe_forward=sum(self.scheme.evaluations(min(i, L - 1)) for i in range(steps)))
        stats.steps_forward = steps
        return stats

    def _layer_indices(self, t: Sequence[float] | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, list]:
        tt = self.check_times(t, self.T)
        idx = torch.round(tt / self.h)
        off = (idx * self.h - tt).abs()
        if bool((off > 1e-9 * self.h).any()):
            bad = float(tt[int(off.argmax())])
            raise ValueError(
                f"`t` must be layer boundaries l·h (h = {self.h:.6g}); {bad:.6g} is not one. "
                "Use times from `net.times`."
            )
        return tt.to(device), [int(i) for i in idx.tolist()]

    def extra_repr(self) -> str:
        name, eq = self.architecture
        return f"scheme={self.scheme!r}, layers={self.field.grid.L}, h={self.h:.4g} ({name}, {eq})"


# the nets that have warned that their weights break the field's stability condition: each warns once
_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _warn_if_unstable(
    net: nn.Module, field: nn.Module, x: torch.Tensor, u: torch.Tensor | None, l: int, h: float, stopping: bool
) -> None:
    """If the field has a stability condition (NAIS, Condition N1: the Euler block contracts where
    ``stability_margin < 1``) and it fails at the states ``x`` (where a stopping net's samples ran out of layers,
    or where a net without stopping ended), say so, once per net."""
    margin = getattr(field, "stability_margin", None)
    if net in _WARNED or margin is None or u is None or x.dim() != 2 or torch.compiler.is_compiling():
        return
    with torch.no_grad():
        value = margin(x, u.detach(), h=h, l=l)
    if value < 1:
        return
    _WARNED.add(net)
    name = type(field).__name__
    where = (
        "a stopping net ran samples to `max_depth` without converging, and its weights break the stability condition: "
        if stopping
        else "the weights of this net break the stability condition: "
    )
    warnings.warn(
        f"{where}`{name}.stability_margin(x, u)` = {value:.4g} >= 1 where they "
        f"{'stopped' if stopping else 'ended'} (it must be < 1, Condition N1, for the Euler block to contract). "
        "Call `field.project_()` after every optimiser step (Alg. N1)"
        + ("; `Solution.unconverged` counts the samples." if stopping else "."),
        UserWarning,
        stacklevel=5,
    )


def discretize(
    field: nn.Module,
    scheme: str | Scheme = "euler",
    *,
    T: float | None = None,
    steps: int | None = None,
    k: int | None = None,
    split: tuple[int, int] | None = None,
    momentum: tuple[float, float] | None = None,
    tie_eta: bool = False,
    memory_free: bool = False,
    stop: Stop | dict | None = None,
    regularisers: Sequence[str] = (),
    noise: str | None = None,
) -> DiscreteNet:
    """A discrete network: one step of ``scheme`` per parameter piece of ``field`` (``h = T / L``).

    Args:
        field: a cde_nets field, or any ``nn.Module`` with ``forward(t, y)`` (then ``T=`` and ``steps=`` are
            required: ``steps`` layers of ``T / steps``; each stage sees its time, e.g. ``t_l + h/2``).
        scheme: a name of :data:`solvers.schemes.SCHEMES` or a :class:`~solvers.schemes.Scheme` object.
        k: lags of ``ck`` (C^k, default 2) and ``dense`` (default 3).
        split: ``(n_p, n_q)`` for a split scheme on a field that declares no split (or a plain module): the whole
            field is evaluated per half step and its halves taken. Such a net is the explicit semi-implicit
            variant: first order, not symplectic (see :attr:`DiscreteNet.properties`).
        momentum: initial ``(m, η)`` of the momentum scheme; default ``m ≈ 0, η = 1`` (starts as a ResNet).
        tie_eta: momentum with ``η = 1 − m`` (Momentum ResNets, Sander et al. 2021).
        memory_free: backward by exact inversion of the layers (:mod:`cde_nets.blocks.invertible`), memory constant in
            depth: ``symplectic_euler``, ``symplectic_euler_qp``, ``verlet`` on separable fields, ``momentum``
            (needs ``momentum=(m, η)`` with a moderate ``m``: rounding grows like ``(1/m)^L``), ``lm2`` with
            ``k_l ≠ 0`` (e.g. ``LM2(k0=1.0)``), ``alf``.
        stop: :class:`~cde_nets.Stop` (or a dict of its fields): each sample stops when
            ``‖y_i − y_{i−1}‖ < eps`` (at most ``max_depth`` steps, default ``L``; step ``i`` uses piece
            ``min(i, L − 1)``); the batch is compacted as samples finish. ``net(y0)`` still returns a tensor;
            ``net.solve(y0).depths`` holds the depths.
        regularisers: ``"kinetic"`` and/or ``"jacobian"`` for the explicit Runge-Kutta schemes: the layer's own
            quadrature of ``∫‖F‖²`` and ``∫‖∂F/∂y‖²_F`` (Hutchinson, one probe per call drawn from ``noise``) —
            for forward Euler the Riemann sums ``Σ_l h ‖F(y_l)‖²``, ``Σ_l h ‖∂F/∂y(y_l)‖²_F``
            (:mod:`~cde_nets.blocks.regularisers`); each call's ``Solution.regularisation`` maps them to their
            batch means, which reach the Trainer's ``kinetic_energy(λ)``, ... terms through
            :func:`~cde_nets.integrated_terms`.

    On an order-2 field (state ``(x, v)``, e.g. ``SecondOrder``) the momentum scheme uses the field's own velocity
    (:class:`solvers.schemes.Momentum`): ``m = 1 − hγ`` and ``η = hη`` come from the field, and the output keeps
    the field's state ``(x, v)``.
    """
    return DiscreteNet(
        field,
        scheme,
        T=T,
        steps=steps,
        k=k,
        split=split,
        momentum=momentum,
        tie_eta=tie_eta,
        memory_free=memory_free,
        stop=stop,
        regularisers=regularisers,
        noise=noise,
    )
