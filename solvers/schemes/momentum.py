"""The heavy-ball (momentum) scheme: the blog's second-order residual block (B §8)."""

from __future__ import annotations

import math

import torch

from .base import Scheme
from .split import SymplecticEulerQP

__all__ = ["Momentum"]


# sigmoid(-10) = 4.5e-5: m ≈ 0, so the momentum net starts as a ResNet (B §8) to within 4.5e-5 per layer, while
# dm/da = m(1 − m) ≈ 4.5e-5 still lets training move m (at a = -20 it would be 2e-9, below float32 resolution of 1).
_RESNET_A = -10.0
_ETA_ONE = math.log(math.e - 1.0)  # softplus(log(e - 1)) = 1


class Momentum(Scheme):
    """Heavy ball (B §8): ``v_{l+1} = m_l v_l + η_l h F_l(x_l)``, ``x_{l+1} = x_l + v_{l+1}``, ``v_0 = 0``, with
    learnable ``m_l = sigmoid(a_l)``, ``η_l = softplus(b_l)`` per channel (``tie_eta``: ``η = 1 − m``, Momentum
    ResNets, Sander et al. 2021). ``momentum=(m, η)``: initial values; default ``m ≈ 0``, ``η = 1`` (a ResNet).

    On an order-2 field (state ``(x, v)``, ``x' = v``, ``v' = −γ v + η f(x)``) it uses the field's own velocity:
    with ``ṽ = h v`` the step ``v ← v + h(−γ v + η f(x))``, ``x ← x + h v`` is the update above with ``m = 1 − hγ``,
    ``η_B = hη`` from the field, so no coefficients are created (``variant = "field velocity"``)."""

    name, order, state, equation = "momentum", 1, "velocity", "B §8"
    invertible = True
    description = "heavy ball: v' = m v + η h F(x), x' = x + v' (m = sigmoid(a_l), η = softplus(b_l))"

    def __init__(self, momentum: tuple[float, float] | None = None, tie_eta: bool = False):
        if momentum is not None:
            if not (isinstance(momentum, tuple) and len(momentum) == 2):
                raise ValueError(f"`momentum` must be a pair (m, η), got {momentum!r}.")
            if not 0 < momentum[0] < 1:
                raise ValueError(f"`momentum` m must lie in (0, 1), got {momentum[0]}.")
            if not tie_eta and not momentum[1] > 0:
                raise ValueError(f"`momentum` η must be > 0, got {momentum[1]}.")
        self.momentum, self.tie_eta = momentum, bool(tie_eta)
        self.coefficients = ("a",) if tie_eta else ("a", "b")

    def options(self):
        return {k: v for k, v in (("momentum", self.momentum), ("tie_eta", self.tie_eta)) if v}

    def for_field(self, field, split=None):
        if getattr(field, "order", 1) != 2:
            return super().for_field(field, split)
        if self.momentum is not None or self.tie_eta:
            raise ValueError(
                f"on the order-2 field {type(field).__name__}, the momentum scheme's m = 1 − hγ and "
                "η = hη come from the field's γ, η; drop `momentum`, `tie_eta` and `memory_free` (or use "
                "a first-order field)."
            )
        if getattr(field, "split", None) is None:
            raise ValueError(
                f"scheme 'momentum' on an order-2 field uses its (x, v) halves, but "
                f"{type(field).__name__} declares no `split`; declare split = (dim, dim)."
            )
        s = SymplecticEulerQP().for_field(field, split)
        s.name, s.equation, s.description, s.variant = self.name, self.equation, self.description, "field velocity"
        return s

    def coefficient_init(self, L, channels):
        m0, eta0 = self.momentum if self.momentum is not None else (None, None)
        a0 = _RESNET_A if m0 is None else math.log(m0 / (1 - m0))
        out = {"a": torch.full((L, channels), a0)}
        if not self.tie_eta:
            out["b"] = torch.full((L, channels), _ETA_ONE if eta0 is None else math.log(math.expm1(eta0)))
        return out

    def coefficient_values(self, params, h, ndim):
        a = params["a"]
        shape = (a.shape[0], 1, a.shape[1]) + (1,) * (ndim - 2)
        m = torch.sigmoid(a)
        eta = (1 - m) if self.tie_eta else torch.nn.functional.softplus(params["b"])
        return {"m": m.reshape(shape), "eta_h": (eta * h).reshape(shape)}

    def init(self, y0):
        return (y0, torch.zeros_like(y0))

    def step(self, f, l, state, h, coef=None, t=None):
        x, v = state
        v = coef["m"][l] * v + coef["eta_h"][l] * f.evaluate(l, x, t=l * h if t is None else t)
        return (x + v, v)

    def check_invertible(self, field):
        if self.momentum is None:
            raise ValueError(
                "`memory_free=True` inverts v_l = (v_{l+1} − η h F) / m once per layer, so rounding "
                "grows like (1/m)^L; the default ResNet start m ≈ 4.5e-5 would destroy the gradients. "
                "Pass a moderate momentum, e.g. `momentum=(0.9, 1.0)`."
            )

    def inverse(self, f, l, state, h, coef=None, t=None):
        """``x_l = x_{l+1} − v_{l+1}``, ``v_l = (v_{l+1} − η_l h F_l(x_l)) / m_l`` (Sander et al. 2021, §3);
        the division amplifies rounding by ``1/m_l`` per layer."""
        x1, v1 = state
        x = x1 - v1
        v = (v1 - coef["eta_h"][l] * f.evaluate(l, x, t=l * h if t is None else t)) / coef["m"][l]
        return (x, v)
