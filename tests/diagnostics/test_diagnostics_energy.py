"""Energy diagnostics (Galimberti et al.): H conserved for constant parameters, the extended energy (proof of Lemma H4)
conserved for piecewise-constant ones, and the discrete bookkeeping E_{l+1} − E_l = H_l(y_{l+1}) − H_l(y_l)."""

import json

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.diagnostics import discrete_energy, energy_trajectory, to_jsonable
from cde_nets.fields import CubicFriction, Hamiltonian


def field(layers, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = Hamiltonian(4, layers=layers, T=2.0, init_std=1.0, generator=g)
    with torch.no_grad():
        f.b.data.normal_(0, 0.5, generator=g)
    return f, torch.randn(6, 4, generator=g)


def test_energy_constant_for_constant_parameters(f64):
    f, y0 = field(1)
    r = energy_trajectory(ODEBlock(f, rtol=1e-10, atol=1e-10), y0, torch.linspace(0, 2, 9))
    assert r["drift"] < 1e-6 and r["jumps"] == []
    json.dumps(to_jsonable(r))


def test_extended_energy_constant_for_time_varying_parameters(f64):
    f, y0 = field(4)
    r = energy_trajectory(ODEBlock(f, rtol=1e-10, atol=1e-10), y0, torch.linspace(0, 2, 9))
    assert r["drift"] > 1e-2  # the parameter jumps do change H ...
    assert r["extended_drift"] < 1e-6  # ... by exactly the jumps the extended energy accounts for
    assert len(r["jumps"]) == 3
    assert torch.allclose(r["extended"][0], f.energy_at(0, y0))


def test_discrete_extended_energy_is_the_sum_of_step_errors(f64):
    f, y0 = field(4)
    h = f.grid.h
    states = [y0]
    for l in range(4):
        states.append(states[-1] + h * f.evaluate(l, states[-1]))
    r = discrete_energy(f, states)
    E_last = (
        f.energy_at(3, states[-1])
        + sum(f.energy_at(l, states[l]) - f.energy_at(l - 1, states[l]) for l in range(1, 4)) * -1
    )
    assert torch.allclose(r["extended"][-1], E_last, atol=1e-12)
    assert r["step_error"].abs().max() > 1e-3  # forward Euler does not conserve energy


def test_energy_needs_a_hamiltonian_field(f64):
    block = ODEBlock(CubicFriction(2))
    with pytest.raises(TypeError, match="declares no energy"):
        energy_trajectory(block, torch.zeros(1, 2), [0.0, 1.0])
    with pytest.raises(ValueError, match="start at 0"):
        energy_trajectory(ODEBlock(field(1)[0]), torch.zeros(1, 4), [0.5, 1.0])
