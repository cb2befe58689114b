"""The asynchronous leapfrog (ALF) scheme of MALI (Zhuang et al. 2021): one ALF step per layer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import Scheme

__all__ = ["ALF", "leapfrog_inverse", "leapfrog_step"]


def leapfrog_step(
    f_mid: Callable[[torch.Tensor], torch.Tensor], y: torch.Tensor, v: torch.Tensor, h: float, eta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ALF step (MALI, Alg. 1, damped as in §3.3): ``y_½ = y + (h/2) v``, ``u = f_mid(y_½)`` (the field at
    the step's midpoint time), ``v' = v + 2η (u − v)``, ``y' = y_½ + (h/2) v'``. Returns ``(y', v')``."""
    ym = y + (0.5 * h) * v
    u = f_mid(ym)
    v = v + (2.0 * eta) * (u - v)
    return ym + (0.5 * h) * v, v


def leapfrog_inverse(
    f_mid: Callable[[torch.Tensor], torch.Tensor], y1: torch.Tensor, v1: torch.Tensor, h: float, eta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's exact inverse (MALI, Alg. 2): ``y_½ = y' − (h/2) v'``, ``u = f_mid(y_½)``,
    ``v = (v' − 2η u) / (1 − 2η)`` (``2u − v'`` for ``η = 1``: no rounding amplified), ``y = y_½ − (h/2) v``."""
    ym = y1 - (0.5 * h) * v1
    u = f_mid(ym)
    v = 2.0 * u - v1 if eta == 1.0 else (v1 - (2.0 * eta) * u) / (1.0 - 2.0 * eta)
    return ym - (0.5 * h) * v, v


class ALF(Scheme):
    """Asynchronous leapfrog (Zhuang, Dvornek, Tatikonda & Duncan 2021, "MALI", Alg. 1, damped as in §3.3) on the
    state ``(y, v)``, ``v`` a carried estimate of ``F``. Layer ``l`` (piece ``l``, step ``h``, damping ``η``):

        ``y_½ = y_l + (h/2) v_l``,  ``u = F_l(y_½)``,
        ``v_{l+1} = v_l + 2η (u − v_l)``,  ``y_{l+1} = y_½ + (h/2) v_{l+1}``,

    with ``v_0 = F_0(y_0)`` read by the first layer (two evaluations there). Exactly invertible for ``η ≠ 1/2``
    (their Alg. 2): ``y_½ = y_{l+1} − (h/2) v_{l+1}``, ``u = F_l(y_½)``, ``v_l = (v_{l+1} − 2η u) / (1 − 2η)``,
    ``y_l = y_½ − (h/2) v_l``. For the default ``η = 1`` that is ``v_l = 2u − v_{l+1}``: no amplification of
    rounding; damping ``η < 1`` amplifies it by ``1/|1 − 2η|`` per layer.

    Unlike the continuous integrator (:mod:`solvers.steppers.alf`), which re-reads ``v`` at every parameter jump, the
    layers carry ``v`` across pieces: re-reading it every layer would turn each layer into explicit midpoint, which has
    no explicit inverse.
    """

    name, order, state, equation = "alf", 2, "velocity", "MALI Alg. 1"
    description = "asynchronous leapfrog: y½ = y + h/2 v, v' = v + 2η(F(y½) − v), y' = y½ + h/2 v'"
    invertible = True

    def __init__(self, eta: float = 1.0):
        eta = float(eta)
        if not 0.0 < eta <= 1.0 or eta == 0.5:
            raise ValueError(
                f"ALF damping `eta` must lie in (0, 1] and differ from 1/2 (where the step cannot be inverted), "
                f"got {eta!r}; 1 is undamped."
            )
        self.eta = eta

    def options(self):
        return {"eta": self.eta} if self.eta != 1.0 else {}

    def evaluations(self, l):
        return 2 if l == 0 else 1

    def init(self, y0):
        return (y0, torch.zeros_like(y0))  # the first layer reads v_0 = F_0(y_0)

    def step(self, f, l, state, h, coef=None, t=None):
        y, v = state
        t = l * h if t is None else t
        if t == 0:
            v = f.evaluate(l, y, t=t)
        tm = t + 0.5 * h
        return leapfrog_step(lambda ym: f.evaluate(l, ym, t=tm), y, v, h, self.eta)

    def inverse(self, f, l, state, h, coef=None, t=None):
        y1, v1 = state
        t = l * h if t is None else t
        tm = t + 0.5 * h
        y, v = leapfrog_inverse(lambda ym: f.evaluate(l, ym, t=tm), y1, v1, h, self.eta)
        return (y, torch.zeros_like(y) if t == 0 else v)
