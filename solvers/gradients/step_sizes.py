r"""What a gradient through adaptive steps differentiates: the step sizes as functions of the state, or not.

An adaptive solver's output is ``y_N = Φ(y_0; h_0, h_1, …)`` with every step size a function of the states
before it: the initial step ``h_0 = H(y_0)`` (Hairer, Nørsett & Wanner, "Solving Ordinary Differential Equations
I", §II.4) and each next step ``h_{n+1} = h_n · min(ifactor, max(safety · r_n^(−1/p), dfactor))`` of the error
ratio ``r_n = ‖err_n / (atol + rtol max(|y_n|, |y_{n+1}|))‖_RMS`` (their eq. 4.13). The derivative of what was
computed carries those dependences (torchode differentiates through its controller; so does JAX's diffrax);
holding the sizes fixed gives the derivative of another map, the same method on a frozen mesh. The two differ by
``O(tol)`` where the steps are limited by accuracy, but where they sit at the explicit method's stability edge
(a stiff sample, e.g. Van der Pol at ``μ = 20.88`` under dopri5 at ``rtol = 1e-5``) the frozen-mesh derivative
explodes while the computed solution's does not: −101 506 against the true 4.83 there.

``steps`` of the gradient methods that differentiate the steps taken (``Backprop``, ``Checkpoint``,
``Symplectic``):

- ``"differentiated"`` (the default): every step size is a function of the state, through the error estimate and
  the controller, and of the time where a step is clipped at a jump or an end;
- ``"fixed"``: every step size a constant (the frozen mesh);
- ``"torchdiffeq"``: torchdiffeq 0.2.5's backprop: the initial step size differentiated, every later one held
  fixed (its ``_optimal_step_size`` runs under ``torch.no_grad``). Bit for bit its gradients on the shared step.

Wherever a size is clamped (``ifactor``, ``dfactor``, ``min_step``/``max_step``, the end time) its derivative is
that of the clamp: the constant's.
"""

from __future__ import annotations

import warnings

import torch
import torch.autograd.forward_ad as fwAD

__all__ = ["STEPS", "attach", "carries", "check_steps", "warn_held_fixed"]

STEPS = ("differentiated", "fixed", "torchdiffeq")


def check_steps(steps: object) -> str:
    """``steps`` if it names a setting, else a ``ValueError`` naming them."""
    if steps not in STEPS:
        raise ValueError(
            f"`steps` must be 'differentiated' (the step sizes as functions of the state: the derivative of what "
            f"was computed), 'fixed' (sizes held constant) or 'torchdiffeq' (only the first size differentiated, as "
            f"torchdiffeq's backprop); got {steps!r}."
        )
    return str(steps)


def carries(x: torch.Tensor) -> bool:
    """Whether ``x`` carries a derivative: a reverse-mode graph, or a forward-mode tangent (the forward
    sensitivity, :mod:`solvers.gradients.forward`, differentiates the same formulas in tangent mode)."""
    return x.requires_grad or fwAD.unpack_dual(x).tangent is not None


def attach(value: float | torch.Tensor, graph: torch.Tensor | float) -> torch.Tensor | float:
    """``value`` exactly, with the derivative of ``graph`` (which equals ``value`` up to rounding): the solver's
    own numbers stay its own bits, the gradient is that of the formula that made them."""
    if not isinstance(graph, torch.Tensor) or not carries(graph):
        return value
    return (graph - graph.detach()) + value


def warn_held_fixed(method: str, why: str) -> None:
    """Say that this solve's backprop runs inside torchdiffeq, whose gradient holds every step size after the
    first fixed (the setting ``steps="differentiated"`` asks for cannot be honoured there)."""
    warnings.warn(
        f"method={method!r} runs on torchdiffeq's own solver here ({why}); its backprop holds every step size "
        "after the first fixed, so the gradient is that of those steps, not the derivative of the computed "
        "solution (steps='differentiated', which can differ by orders of magnitude on stiff problems). The "
        "library's own stepper (every adaptive method, on float32/float64 states, with torchdiffeq's step options) "
        "differentiates every step; pass gradient=Backprop(steps='torchdiffeq') to accept torchdiffeq's gradient "
        "without this warning.",
        stacklevel=4,
    )
