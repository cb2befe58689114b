"""Both doors on one engine: every method the library steps itself x every gradient method x both step-size
controllers x every output (states at times, the whole state at its first event, each sample at its own event, a
dense output), through ``ODEBlock`` and through ``cde_nets.odeint``, either served by both with the same values and
gradients or refused by both with the same message (:func:`cde_nets.solvers.engine.solve`,
:func:`~cde_nets.solvers.engine.check_events`). The explicit adaptive methods' event and dense cells are in
test_engine_matrix_adaptive.py; the cases and the checks both files share, in engine_cases.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_cases import (
    F64,
    METHODS,
    OUTPUTS,
    SPLIT_CASES,
    T_OUT,
    _block,
    _block_output,
    _field,
    _first_event,
    _odeint,
    _odeint_output,
    _outcome,
    _same,
    _settings,
    _weighted_outcome,
    check_event_and_dense_cells,
)

from cde_nets import ODEBlock, odeint
from cde_nets.solvers.capabilities import markdown, served
from cde_nets.solvers.gradients import GRADIENTS
from cde_nets.solvers.options import ADAPTIVE_METHODS, PER_SAMPLE_METHODS, SPLIT_METHODS


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_both_doors_serve_or_refuse_the_same_cells(method: str) -> None:
    n_served = 0
    for gradient in GRADIENTS:
        a = _outcome(_block(method, gradient), _field())
        b = _outcome(_odeint(method, gradient), _field())
        _same(a, b)
        assert isinstance(a, str) != served(method, gradient)  # the docs' table says what the doors do
        n_served += not isinstance(a, str)
    assert n_served >= 2  # backprop and at least one low-memory gradient


@pytest.mark.slow
@pytest.mark.parametrize("method", PER_SAMPLE_METHODS)
def test_both_doors_serve_the_same_per_sample_cells(method: str) -> None:
    for gradient in GRADIENTS:
        a = _outcome(_block(method, gradient, "per_sample"), _field())
        b = _outcome(_odeint(method, gradient, "per_sample"), _field())
        _same(a, b)
        assert isinstance(a, str) != served(method, gradient, "per_sample")


# the explicit adaptive methods' event and dense cells (their backward solves cost most of this matrix) are in
# test_engine_matrix_adaptive.py, so that xdist, which hands out whole files, can run the two halves side by side
@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in METHODS if m not in ADAPTIVE_METHODS])
def test_both_doors_serve_or_refuse_the_same_event_and_dense_cells(method: str) -> None:
    check_event_and_dense_cells(method)


@pytest.mark.slow
@pytest.mark.parametrize("method", PER_SAMPLE_METHODS)
def test_per_sample_steps_refuse_events_and_dense_output_in_both_doors(method: str) -> None:
    for gradient in GRADIENTS:
        for output in OUTPUTS:
            a = _weighted_outcome(_block_output(method, gradient, output, "per_sample"), _field())
            b = _weighted_outcome(_odeint_output(method, gradient, output, "per_sample"), _field())
            _same(a, b)
            assert isinstance(a, str) and not served(method, gradient, "per_sample", output)


def test_the_split_cases_are_split_methods() -> None:
    """A name that left SPLIT_METHODS would be refused by both doors and by the table alike, and pass unseen."""
    assert set(SPLIT_CASES) < set(SPLIT_METHODS)


def test_the_capability_page_is_generated_from_the_classes() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "guides" / "capabilities.md"
    assert page.read_text(encoding="utf-8") == markdown(), "run `python -m cde_nets.solvers.capabilities`"


@pytest.mark.parametrize("method", ["alf", "yoshida4"])
def test_first_events_on_the_library_s_own_methods_name_the_per_sample_semantics(method: str) -> None:
    y0 = torch.tensor([[0.3, -0.2]], dtype=F64)
    block_kw, kw = _settings(method)
    match = f"event_mode='first' .* not on method='{method}': use event_mode='per_sample'"
    with pytest.raises(ValueError, match=match):
        odeint(_field(), y0, T_OUT[:2], method=method, event_fn=lambda t, y: y[..., 1].sum(), **kw)
    with pytest.raises(ValueError, match=match):
        ODEBlock(_field(), 1.0, method=method, **block_kw).solve(y0, event=_first_event, event_mode="first")


class _VanDerPol(torch.nn.Module):
    def __init__(self, mu: float):
        super().__init__()
        self.mu = torch.nn.Parameter(torch.tensor(mu, dtype=F64))

    def forward(self, t, y):
        x, v = y[..., 0], y[..., 1]
        return torch.stack((v, self.mu * (1 - x * x) * v - x), -1)


def test_odeint_symplectic_on_an_implicit_method_is_the_gradient_of_its_steps():
    """odeint's state is one sample (its Newton Jacobian couples every component, as torchdiffeq's): the symplectic
    adjoint of gl4 on stiff Van der Pol (mu = 20) equals backprop through the same steps, and both the central
    difference of the solve."""
    f, t = _VanDerPol(20.0), torch.tensor([0.0, 0.3], dtype=F64)
    x0 = torch.tensor([2.0, 0.0], dtype=F64, requires_grad=True)

    def loss(x, gradient="backprop"):
        return odeint(f, x, t, method="gl4", options={"step_size": 0.01}, gradient=gradient)[-1].square().sum()

    grads = {g: torch.autograd.grad(loss(x0, g), (x0, f.mu)) for g in ("backprop", "symplectic")}
    for a, b in zip(grads["symplectic"], grads["backprop"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        e = torch.tensor([1e-6, 0.0], dtype=F64)
        central = (loss(x0 + e) - loss(x0 - e)) / 2e-6
    assert abs(float(grads["symplectic"][0][0] - central)) < 1e-7 * abs(float(central))
