"""Discrete symplectic layers: Yoshida's compositions on separable fields, Gauss-Legendre on any Hamiltonian field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cde_nets import discretize
from cde_nets.fields import Hamiltonian
from cde_nets.fields.hamiltonian import canonical_J
from cde_nets.solvers.schemes import ImplicitRungeKutta, get_scheme

D = torch.float64


def _constant(K: str, layers: int, T: float = 2.0, seed: int = 0) -> Hamiltonian:
    """An H-DNN field with the same parameters in all ``layers`` pieces (a time-invariant Hamiltonian)."""
    base = Hamiltonian(4, T=T, K=K, generator=torch.Generator().manual_seed(seed)).double()
    f = Hamiltonian(4, layers=layers, T=T, K=K).double()
    with torch.no_grad():
        for p, q in zip(f.parameters(), base.parameters()):
            p.copy_(q.expand_as(p))
    return f


@pytest.mark.parametrize(("scheme", "order"), [("yoshida4", 4), ("yoshida6", 6), ("gl4", 4), ("gl6", 6)])
def test_order_of_the_layers_on_a_separable_field(scheme, order):
    """H2 field (separable), ``T = 2``, against gl6 with 256 layers (error ~1e-19): fitted order within 0.1."""
    y0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = discretize(_constant("blockdiag", 256), "gl6")(y0)
        Ns = [8, 12, 16, 24, 32] if order == 4 else [4, 6, 8, 12, 16]
        errs = [float((discretize(_constant("blockdiag", N), scheme)(y0) - ref).abs().max()) for N in Ns]
    assert abs(-np.polyfit(np.log(Ns), np.log(errs), 1)[0] - order) < 0.1, errs


def test_labels_and_properties_follow_the_field():
    h2, h1 = _constant("blockdiag", 4), _constant("full", 4)
    net = discretize(h2, "yoshida4")
    assert net.architecture[0] == "H2-DNN of order 4 (Yoshida triple jump of Verlet)"
    assert net.properties == {"symplectic"} and net.order == 4
    ns = discretize(h1, "yoshida4", split=(2, 2))
    assert ns.properties == frozenset() and ns.order == 1 and "not symplectic" in ns.architecture[0]
    g = discretize(h1, "gl4")
    assert g.properties == {"symplectic"} and "order 4 by Gauss-Legendre" in g.architecture[0]

    class Plain(torch.nn.Module):
        def forward(self, t, y):
            return -(y**3)

    plain = discretize(Plain(), "gl4", T=1.0, steps=2)
    assert plain.properties == frozenset() and plain.architecture[0].startswith("Gauss-Legendre net")
    y = plain(torch.ones(1, 1, dtype=D))  # y' = −y³ from 1: y(1) = 1/√3
    assert abs(float(y) - 3**-0.5) < 1e-3


@pytest.mark.parametrize(("scheme", "K"), [("yoshida4", "blockdiag"), ("yoshida6", "blockdiag"), ("gl4", "full")])
def test_layer_map_is_symplectic(scheme, K):
    f = _constant(K, 1, T=0.5)
    net = discretize(f, scheme)
    y = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(2))
    Phi = torch.autograd.functional.jacobian(lambda x: net(x[None])[0], y)
    J = canonical_J(4, D)
    assert float((Phi.T @ J @ Phi - J).abs().max()) <= 1e-12


def test_yoshida4_keeps_the_energy_where_rk4_drifts():
    """H2, 2000 layers of h = 0.25 with constant parameters: Yoshida-4's energy error stays within 10× its
    first-period maximum and its fitted slope is below 1e-3 of rk4's."""
    N, h = 2000, 0.25
    y0 = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(3))
    f = _constant("blockdiag", N, T=N * h, seed=4)
    E0 = f.energy(0.0, y0)
    ts = h * np.arange(1, N + 1)
    errs = {}
    with torch.no_grad():
        for scheme in ("yoshida4", "rk4"):
            ys = discretize(f, scheme).layer_states(y0)[1:]
            errs[scheme] = np.array([float((f.energy(0.0, y) - E0).abs().max()) for y in ys])
    y4 = errs["yoshida4"]
    assert y4.max() <= 10 * y4[: int(2 * np.pi / h)].max()
    slope_rk4 = np.polyfit(ts, errs["rk4"], 1)[0]
    assert slope_rk4 > 0 and abs(np.polyfit(ts, y4, 1)[0]) < 1e-3 * slope_rk4


@pytest.mark.parametrize(("scheme", "K"), [("yoshida4", "blockdiag"), ("gl4", "full"), ("implicit_midpoint", "full")])
def test_memory_free_gradient_equals_backprop(scheme, K):
    f = Hamiltonian(4, layers=6, T=1.5, K=K, generator=torch.Generator().manual_seed(5)).double()
    y0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(6))
    grads = []
    for memory_free in (False, True):
        f.zero_grad()
        (discretize(f, scheme, memory_free=memory_free)(y0) ** 2).sum().backward()
        grads.append([p.grad.clone() for p in f.parameters()])
    for a, b in zip(*grads):
        assert float((a - b).abs().max()) <= 1e-10
    net = discretize(f, scheme)
    with torch.no_grad():
        s = net.scheme.init(y0)
        bound = net.bind(y0, None)
        back = net.scheme.inverse(bound, 2, net.scheme.step(bound, 2, s, net.h), net.h)
    assert max(float((a - b).abs().max()) for a, b in zip(back, s)) <= 1e-13


def test_non_symmetric_implicit_layers_refuse_memory_free():
    class Radau3(ImplicitRungeKutta):
        name, order, tableau_name = "radau3", 3, "radauIIA3"

    with pytest.raises(ValueError, match="symmetric method"):
        discretize(_constant("full", 2), Radau3(), memory_free=True)
    with pytest.raises(ValueError, match="separable field"):
        discretize(_constant("full", 2), "yoshida4", split=(2, 2), memory_free=True)
    assert get_scheme("gl4").invertible and not Radau3().invertible


@pytest.mark.parametrize("gradient", ["checkpoint", "reversible"])
def test_continuous_composition_matches_discrete_and_backprop(gradient):
    """ODEBlock(method="yoshida4") on a 3-piece H2 field: one step per piece is the discrete net to rounding; the
    stored and the rebuilt-by-inverse gradients equal backprop's to 1e-10."""
    from cde_nets import ODEBlock

    f = Hamiltonian(4, layers=3, T=1.5, K="blockdiag", generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(5, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((ODEBlock(f, method="yoshida4")(y0) - discretize(f, "yoshida4")(y0)).abs().max()) <= 1e-15
    grads = []
    for g in ("backprop", gradient):
        block = ODEBlock(f, method="yoshida4", gradient=g, step_size=0.05)
        f.zero_grad()
        sol = block.solve(y0)
        (sol.y**2).sum().backward()
        grads.append([p.grad.clone() for p in f.parameters()])
        assert sol.stats["nfe_forward"] == 30 * 7
    for a, b in zip(*grads):
        assert float((a - b).abs().max()) <= 1e-10
    with pytest.raises(ValueError, match="only on a separable field; Hamiltonian is not one"):
        ODEBlock(_constant("full", 1), method="yoshida4")(y0)
    with pytest.raises(ValueError, match="symplectic composition"):
        ODEBlock(f, method="yoshida6", gradient="symplectic")
