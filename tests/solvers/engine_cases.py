"""The engine matrix's cases and checks (tests/solvers/test_engine_matrix.py and
test_engine_matrix_adaptive.py): one Hamiltonian field, the same solve through ``ODEBlock`` and ``cde_nets.odeint``,
and the outcome of each, values and gradients or the refusal's message."""

from __future__ import annotations

import torch

from cde_nets import ODEBlock, odeint, odeint_dense
from cde_nets.fields import Hamiltonian
from cde_nets.solvers.capabilities import served
from cde_nets.solvers.gradients import GRADIENTS
from cde_nets.solvers.options import (
    ADAPTIVE_METHODS,
    FIXED_METHODS,
    IMPLICIT_METHODS,
    REVERSIBLE_METHODS,
    is_adaptive,
)

F64 = torch.float64
# The splitting family enters as four of its sixteen: the engine and the capability checks decide by family
# (`method in SPLIT_METHODS`: solvers/engine.py, solvers/gradients/base.py) and the tables differ only in their
# coefficients, each table's order, layers and exact inverse tested in steppers/test_splitting_methods.py. The four:
# the composition schemes (yoshida4, and yoshida6 composed of it), a table with a skipped substep (pseudo_verlet:
# drift-kick-drift) and the longest (sofspa10, 35 stages).
SPLIT_CASES = ("yoshida4", "yoshida6", "pseudo_verlet", "sofspa10")
METHODS = (*ADAPTIVE_METHODS, *FIXED_METHODS, *REVERSIBLE_METHODS, *IMPLICIT_METHODS, *SPLIT_CASES)
T_OUT = torch.tensor([0.0, 0.5, 1.0], dtype=F64)  # on the fixed steps' grid: nothing read by interpolation
STEP = 0.25


def _field() -> Hamiltonian:
    torch.manual_seed(0)
    return Hamiltonian(2, K="blockdiag").double()  # separable: the compositions take it too


def _settings(method: str) -> tuple[dict, dict]:
    """The same solve as the block's keywords and as odeint's."""
    if method in ADAPTIVE_METHODS or (method in REVERSIBLE_METHODS and is_adaptive(method)):
        return dict(rtol=1e-4, atol=1e-6), dict(rtol=1e-4, atol=1e-6)
    return dict(step_size=STEP), dict(options={"step_size": STEP})


def _outcome(door, field: Hamiltonian):
    """``(values, gradients)`` of the door's solve, or the refusal's message."""
    y0 = torch.tensor([[0.3, -0.2], [0.1, 0.4]], dtype=F64, requires_grad=True)
    w = torch.linspace(-1.0, 1.0, 12, dtype=F64).reshape(3, 2, 2)
    try:
        ys = door(field, y0)
    except ValueError as exc:
        return str(exc)
    grads = torch.autograd.grad((ys * w).sum(), [y0, *field.parameters()])
    return ys.detach(), grads


def _block(method: str, gradient: str, controller: str = "batch"):
    block_kw, _ = _settings(method)
    return lambda f, y0: (
        ODEBlock(f, 1.0, method=method, gradient=gradient, controller=controller, **block_kw).solve(y0, t=T_OUT).ys
    )


def _odeint(method: str, gradient: str, controller: str = "batch"):
    _, kw = _settings(method)
    return lambda f, y0: odeint(f, y0, T_OUT, method=method, gradient=gradient, controller=controller, **kw)


def _same(a, b) -> None:
    if isinstance(a, str) or isinstance(b, str):
        assert a == b, f"ODEBlock: {a!r}\nodeint: {b!r}"
        return
    (ya, ga), (yb, gb) = a, b
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-13)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


# the event cells end early and the dense ones span a quarter of the block's time, to keep the loops short
def _first_event(t, y):
    """One value for the whole batch: the two momenta's sum reaches 0.29 near t = 0.2."""
    return y[..., 1].sum() - 0.29


def _own_event(t, y):
    """One value per row: sample 0's momentum reaches -0.15 near t = 0.07, sample 1's 0.43 near t = 0.13."""
    return (y[:, 1] + 0.15) * (y[:, 1] - 0.43)


T_DENSE = torch.tensor([0.1, 0.2], dtype=F64)  # between the steps: read off the interpolant
SPAN = {"first": 1.0, "per_sample": 1.0, "dense": 0.25}


def _block_output(method: str, gradient: str, output: str, controller: str = "batch"):
    block_kw, _ = _settings(method)

    def door(f, y0):
        block = ODEBlock(f, SPAN[output], method=method, gradient=gradient, controller=controller, **block_kw)
        if output == "dense":
            return block.solve(y0, dense=True).evaluate(T_DENSE)
        event = _first_event if output == "first" else _own_event
        sol = block.solve(y0, event=event, event_mode=output)
        times = sol.stop_times[:1] if output == "first" else sol.stop_times
        return torch.cat([times, sol.y.reshape(-1)])

    return door


def _odeint_output(method: str, gradient: str, output: str, controller: str = "batch"):
    _, kw = _settings(method)
    span = torch.tensor([0.0, SPAN[output]], dtype=F64)

    def door(f, y0):
        if output == "dense":
            dense = odeint_dense(f, y0, span, method=method, gradient=gradient, controller=controller, **kw)
            return dense.evaluate(T_DENSE)
        event = _first_event if output == "first" else _own_event
        kw_all = dict(method=method, gradient=gradient, controller=controller, event_fn=event, event_mode=output)
        t, sol = odeint(f, y0, span, **kw_all, **kw)
        return torch.cat([t.reshape(-1), sol[-1].reshape(-1)])

    return door


def _weighted_outcome(door, field: Hamiltonian):
    """``_outcome`` for an output of any shape (a flat vector, or states at ``T_DENSE``)."""
    y0 = torch.tensor([[0.3, -0.2], [0.1, 0.4]], dtype=F64, requires_grad=True)
    try:
        out = door(field, y0)
    except ValueError as exc:
        return str(exc)
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=F64).reshape(out.shape)
    return out.detach(), torch.autograd.grad((out * w).sum(), [y0, *field.parameters()])


OUTPUTS = ("first", "per_sample", "dense")


def check_event_and_dense_cells(method: str) -> None:
    """Every gradient method x every output on ``method``: served by both doors with the same values and gradients,
    or refused by both with the same message, as the capability table says."""
    counts = dict.fromkeys(OUTPUTS, 0)
    for gradient in GRADIENTS:
        for output in OUTPUTS:
            a = _weighted_outcome(_block_output(method, gradient, output), _field())
            b = _weighted_outcome(_odeint_output(method, gradient, output), _field())
            _same(a, b)
            assert isinstance(a, str) != served(method, gradient, output=output), (gradient, output, a)
            counts[output] += not isinstance(a, str)
    assert counts["per_sample"] == counts["dense"] >= 2  # backprop and at least one low-memory gradient
    assert counts["first"] in (0, counts["per_sample"])
