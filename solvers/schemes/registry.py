"""Schemes by name: :data:`SCHEMES` (one default instance each) and :func:`get_scheme` (a name and its options)."""

from __future__ import annotations

from typing import Any

from .. import architectures
from .base import Scheme
from .composition import Yoshida4, Yoshida6
from .implicit import GL4, GL6, ImplicitMidpoint
from .lags import CK, LM2, Dense
from .leapfrog import ALF
from .momentum import Momentum
from .nystrom import DPRKN6, DPRKN8, Nystrom4
from .runge_kutta import RK4, Euler, Midpoint, RK4Classical
from .split import SymplecticEuler, SymplecticEulerQP, Verlet
from .splitting import SPLITTING_SCHEMES

__all__ = ["SCHEME_CLASSES", "SCHEMES", "architecture", "get_scheme"]

_CLASSES: tuple[type[Scheme], ...] = (
    Euler,
    Midpoint,
    RK4,
    RK4Classical,
    SymplecticEuler,
    SymplecticEulerQP,
    Verlet,
    Momentum,
    CK,
    Dense,
    LM2,
    ALF,
    Yoshida4,
    Yoshida6,
    ImplicitMidpoint,
    GL4,
    GL6,
    Nystrom4,
    DPRKN6,
    DPRKN8,
    *SPLITTING_SCHEMES.values(),
)
SCHEME_CLASSES: dict[str, type[Scheme]] = {c.name: c for c in _CLASSES}
SCHEMES: dict[str, Scheme] = {name: cls() for name, cls in SCHEME_CLASSES.items()}


def get_scheme(
    scheme: str | Scheme, *, k: int | None = None, momentum: tuple[float, float] | None = None, tie_eta: bool = False
) -> Scheme:
    """The scheme for a name, built with its options (``k``: lags of ``ck``/``dense``; ``momentum``, ``tie_eta``:
    the momentum scheme's), or a :class:`Scheme` object itself. An option a scheme does not take is refused."""
    if isinstance(scheme, Scheme):
        if k is not None or momentum is not None or tie_eta:
            raise ValueError(
                f"the options `k`, `momentum`, `tie_eta` configure a scheme given by name; "
                f"{scheme!r} is already built: pass them to its constructor."
            )
        return scheme
    if scheme not in SCHEME_CLASSES:
        raise ValueError(f"unknown scheme {scheme!r}; valid schemes: {', '.join(SCHEME_CLASSES)}.")
    if k is not None and scheme not in ("ck", "dense"):
        raise ValueError(f"`k` applies to the 'ck' and 'dense' schemes, not {scheme!r}.")
    if momentum is not None and scheme != "momentum":
        raise ValueError(f"`momentum` sets the momentum scheme's (m, η), not {scheme!r}'s.")
    if tie_eta and scheme != "momentum":
        raise ValueError(f"`tie_eta` ties the momentum scheme's η = 1 − m; it does not apply to {scheme!r}.")
    if scheme in ("ck", "dense"):
        return CK(k) if scheme == "ck" else Dense(k)
    if scheme == "momentum":
        return Momentum(momentum, tie_eta)
    return SCHEMES[scheme]


def architecture(scheme: str | Scheme, field_kind: Any = "any", variant: str | None = None) -> tuple[str, str]:
    """:func:`~solvers.architectures.architecture`, a scheme name resolved to its scheme first, so that on a field
    the row is the variant the scheme has there (e.g. ``"non-separable"`` for ``symplectic_euler`` on
    ``Hamiltonian(K="full")``)."""
    if isinstance(scheme, str) and not isinstance(field_kind, str) and variant is None and scheme in SCHEME_CLASSES:
        scheme = get_scheme(scheme)
    return architectures.architecture(scheme, field_kind, variant)
