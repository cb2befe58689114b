"""Discrete mode: ``discretize(field, scheme)`` — one scheme step per parameter piece, ``h = T / L`` (SPEC §6).

The returned module holds the field itself, so it shares every parameter with an :class:`~cde_nets.ODEBlock`
on the same field: a model trained in discrete mode evaluates in continuous mode and the other way round.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cde_nets.solvers.architectures import architecture
from cde_nets.solvers.errors import check_positive
from cde_nets.solvers.schemes import Scheme, get_scheme
from cde_nets.solvers.stopping import unroll

from .fields.base import Field
from .pieces import gathered

__all__ = ["discretize", "DiscreteNet"]

# sigmoid(-10) = 4.5e-5: m ≈ 0, so the momentum net starts as a ResNet (B §8) to within 4.5e-5 per layer, while
# dm/da = m(1 − m) ≈ 4.5e-5 still lets training move m (at a = -20 it would be 2e-9, below float32 resolution of 1).
_RESNET_A = -10.0
_ETA_ONE = math.log(math.e - 1.0)  # softplus(log(e - 1)) = 1


class DiscreteNet(nn.Module):
    """``L`` layers of ``scheme`` on ``field``; see :func:`discretize`."""

    def __init__(self, field: Field, scheme: Scheme, k: int | None, split: tuple[int, int] | None,
                 return_all: bool, momentum: tuple[float, float] | None, tie_eta: bool, memory_free: bool,
                 stop: dict | None = None):
        super().__init__()
        self.stop = stop
        self.field = field
        self.scheme = scheme
        self.k = k or scheme.lags
        self.split = split
        self.return_all = return_all
        self.memory_free = memory_free
        L = field.grid.L
        self.tie_eta = tie_eta
        if "m" in scheme.params:
            channels = field.state_shape[0]
            m0, eta0 = momentum if momentum is not None else (None, None)
            a0 = _RESNET_A if m0 is None else math.log(m0 / (1 - m0))
            self.a = nn.Parameter(torch.full((L, channels), a0))
            if not tie_eta:
                b0 = _ETA_ONE if eta0 is None else math.log(math.expm1(eta0))
                self.b = nn.Parameter(torch.full((L, channels), b0))
        if scheme.name == "lm2":
            self.k_lm = nn.Parameter(torch.zeros(L))

    @property
    def architecture(self) -> tuple[str, str]:
        """``(name, paper equation)`` this scheme realises on this field (SPEC §6)."""
        return architecture(self.scheme.name, getattr(self.field, "kind", "generic"))

    def coefficients(self, ndim: int = 2) -> dict:
        """Per-layer scheme coefficients, gathered once per call and shaped to broadcast over a state of ``ndim``
        dimensions: momentum ``m`` and ``eta_h = η h`` of shape ``(L, 1, C, 1, ...)``, two-step ``k``."""
        if "m" in self.scheme.params:
            shape = (self.a.shape[0], 1, self.a.shape[1]) + (1,) * (ndim - 2)
            m = torch.sigmoid(self.a)
            eta = (1 - m) if self.tie_eta else F.softplus(self.b)
            return {"m": m.reshape(shape), "eta_h": (eta * self.field.grid.h).reshape(shape)}
        if self.scheme.name == "lm2":
            return {"k": self.k_lm}
        return {}

    def init_state(self, y0: torch.Tensor) -> tuple:
        return self.scheme.init_state(y0, self.k, (self.split or self.field.split or (None,))[0])

    def step(self, l: int, state: tuple, coef: dict | None = None) -> tuple:
        """One layer: scheme state (a tuple, see :mod:`solvers.schemes`) at layer ``l`` → layer ``l + 1``."""
        if coef is None:
            coef = self.coefficients(state[0].dim())
        return self.scheme.step(self.field, l, state, self.field.grid.h, coef, self.k, self.split)

    def forward(self, y0: torch.Tensor, u: torch.Tensor | None = None):
        """``y_L`` (or the list ``[y_0, ..., y_L]`` with ``return_all``); ``u`` binds a NAIS block input."""
        self.field.check_state(y0, "y0")
        if u is not None:
            self.field.bind(u)
        with gathered(self.field):
            return self._forward(y0)

    def _forward(self, y0: torch.Tensor):
        if self.memory_free:
            from .momentum_inverse import momentum_memory_free

            return momentum_memory_free(self, y0)
        coef = {k: c.unbind(0) for k, c in self.coefficients(y0.dim()).items()}  # one node per call, as pieces
        n_p = (self.split or self.field.split or (None,))[0]
        state = self.scheme.init_state(y0, self.k, n_p)
        if self.stop is not None:
            return self._forward_stopping(state, coef)
        states = [y0] if self.return_all else None
        field, scheme, h, k, split = self.field, self.scheme, self.field.grid.h, self.k, self.split  # hoisted
        for l in range(field.grid.L):
            state = scheme.step(field, l, state, h, coef, k, split)
            if states is not None:
                states.append(scheme.readout(state))
        return states if states is not None else scheme.readout(state)

    def _forward_stopping(self, state: tuple, coef: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample stopping (SPEC §4, N §5.3): step ``i`` uses piece ``min(i, L − 1)``; returns ``(y, depths)``."""
        f, L, h = self.field, self.field.grid.L, self.field.grid.h

        def step(i, st, idx):
            with f.rows(idx):
                return self.scheme.step(f, min(i, L - 1), st, h, coef, self.k, self.split)

        final, depths = unroll(step, state, eps=self.stop["eps"], max_depth=self.stop["max_depth"],
                               readout=self.scheme.readout)
        return self.scheme.readout(final), depths

    def extra_repr(self) -> str:
        name, eq = self.architecture
        return f"scheme={self.scheme.name!r}, layers={self.field.grid.L}, h={self.field.grid.h:.4g} ({name}, {eq})"


def discretize(field: Field, scheme: str | Scheme = "euler", *, k: int | None = None,
               split: tuple[int, int] | None = None, return_all: bool = False,
               momentum: tuple[float, float] | None = None, tie_eta: bool = False,
               memory_free: bool = False, stop: dict | None = None) -> DiscreteNet:
    """A discrete network: one step of ``scheme`` per parameter piece of ``field`` (``h = T / L``).

    Args:
        scheme: a name of :data:`solvers.schemes.SCHEMES` or a :class:`~solvers.schemes.Scheme`.
        k: lags of ``ck`` (C^k, default 2) and ``dense`` (default 3) schemes.
        split: ``(n_p, n_q)`` for split schemes on a field that declares no split (evaluates the whole field
            per half step); fields with a declared split use it.
        return_all: return every layer's state ``[y_0, ..., y_L]``.
        momentum: initial ``(m, η)`` of the momentum scheme; default ``m ≈ 0, η = 1`` (starts as a ResNet).
        tie_eta: momentum with ``η = 1 − m`` (Momentum ResNets).
        memory_free: momentum only — backward by exact inversion of the update, O(1) memory in depth; needs
            ``momentum=(m, η)`` with a moderate ``m`` (rounding grows like ``(1/m)^L``).

    On an order-2 field (``field.order == 2``, state ``(x, v)``, e.g. ``SecondOrder``) the momentum scheme uses the
    field's own velocity (see :meth:`solvers.schemes.Scheme.for_field`): ``m = 1 − hγ`` and ``η = hη`` come from
    the field, the step equals ``symplectic_euler_qp``, and the output keeps the field's state ``(x, v)``.
        stop: ``dict(eps=..., max_depth=...)``: pattern-dependent depth — each sample stops when
            ``‖y_i − y_{i−1}‖ < eps`` (up to ``max_depth`` steps; step ``i`` uses piece ``min(i, L − 1)``); the batch
            is compacted as samples finish, and the net returns ``(y, depths)``.
    """
    if not isinstance(field, Field):
        raise TypeError(f"`field` must be a cde_nets Field (with evaluate(l, y)), got {type(field).__name__}.")
    sch = get_scheme(scheme)
    native = sch.needs == "velocity" and field.order == 2
    if native and field.split is None:
        raise ValueError(f"scheme {sch.name!r} on an order-2 field uses its (x, v) halves, but "
                         f"{type(field).__name__} declares no `split`; declare split = (dim, dim).")
    if native and (momentum is not None or tie_eta or memory_free):
        raise ValueError(f"on the order-2 field {type(field).__name__}, the momentum scheme's m = 1 − hγ and "
                         "η = hη come from the field's γ, η; drop `momentum`, `tie_eta` and `memory_free` (or use a "
                         "first-order field).")
    sch = sch.for_field(field.order)
    if sch.needs == "split":
        if split is None and field.split is None:
            n = field.state_shape[0] if len(field.state_shape) == 1 else None
            raise ValueError(
                f"scheme {sch.name!r} needs a (p, q) split, but {type(field).__name__} declares none; use a split "
                "field (Hamiltonian(K='blockdiag'), MS1, MS3) or pass `split=(n_p, n_q)`"
                + (f" (n = {n} is odd: pad the state with a zero feature)." if n is not None and n % 2 else ".")
            )
        if split is not None:
            n = field.state_shape[0]
            if n % 2 or split[0] + split[1] != n:
                raise ValueError(f"`split`={split} must add up to the state size {n}"
                                 + (" (odd: pad the state with a zero feature)." if n % 2 else "."))
    if k is not None and (sch.needs != "lags" or sch.name == "lm2"):
        raise ValueError(f"`k` applies to the 'ck' and 'dense' schemes, not {sch.name!r}.")
    if k is not None and (not isinstance(k, int) or k < 1):
        raise ValueError(f"`k` must be a positive integer, got {k!r}.")
    if memory_free and sch.needs != "velocity":
        raise ValueError(f"`memory_free=True` needs the 'momentum' scheme (exact inversion), not {sch.name!r}.")
    if memory_free and momentum is None:
        raise ValueError("`memory_free=True` inverts v_l = (v_{l+1} − η h F) / m once per layer, so rounding "
                         "grows like (1/m)^L; the default ResNet start m ≈ 4.5e-5 would destroy the gradients. "
                         "Pass a moderate momentum, e.g. `momentum=(0.9, 1.0)`.")
    if memory_free and return_all:
        raise ValueError("`memory_free=True` keeps no layer states; drop `return_all`.")
    if momentum is not None and sch.name != "momentum":
        raise ValueError(f"`momentum` sets the momentum scheme's (m, η), not {sch.name!r}'s.")
    if tie_eta and sch.name != "momentum":
        raise ValueError(f"`tie_eta` ties the momentum scheme's η = 1 − m; it does not apply to {sch.name!r}.")
    if momentum is not None and not 0 < momentum[0] < 1:
        raise ValueError(f"`momentum` m must lie in (0, 1), got {momentum[0]}.")
    if stop is not None:
        stop = _check_stop(stop, ("eps", "max_depth"))
        if return_all or memory_free:
            raise ValueError("`stop` returns (y, depths); it combines with neither `return_all` nor `memory_free`.")
    return DiscreteNet(field, sch, k, split, return_all, momentum, tie_eta, memory_free, stop)


def _check_stop(stop: dict, keys: tuple[str, ...]) -> dict:
    if not isinstance(stop, dict) or set(stop) - set(keys) or "eps" not in stop:
        raise ValueError(f"`stop` must be a dict with keys {keys} (eps required), got {stop!r}.")
    check_positive("eps", stop["eps"], "It is the per-sample convergence threshold, e.g. 1e-4.")
    for key in ("max_depth",):
        if key in keys:
            v = stop.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"`max_depth` must be a positive integer, got {v!r}.")
    return dict(stop)
