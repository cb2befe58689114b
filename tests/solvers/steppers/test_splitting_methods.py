"""The explicit symplectic splitting methods (solvers/steppers/splitting_tableaux.py): their tables, orders, layers and
maps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.fields import MS1, Hamiltonian, canonical_J
from cde_nets.fields.bound import BoundField
from cde_nets.solvers import ARCHITECTURES
from cde_nets.solvers.schemes import SPLITTING_SCHEMES, Splitting, get_scheme
from cde_nets.solvers.steppers.order_conditions import splitting_defects
from cde_nets.solvers.steppers.splitting_tableaux import (
    SPLITTING_SPECS,
    SplittingTableau,
    kick_drift_kick,
    splitting_tableau,
)

D = torch.float64
NAMES = list(SPLITTING_SPECS)


def _run(scheme, field, y0: torch.Tensor, h: float, steps: int) -> torch.Tensor:
    """``steps`` steps of ``scheme`` on the one-piece ``field``, without a graph."""
    sch, f = scheme.for_field(field), BoundField(field)
    state = sch.init(y0)
    with torch.no_grad():
        for n in range(steps):
            state = sch.step(f, 0, state, h, None, n * h)
    return sch.readout(state)


@pytest.mark.parametrize("name", NAMES)
def test_each_table_has_exactly_its_declared_order(name):
    """The declared order conditions hold to 1e-12 (the constructor's check, asserted here); those of the next
    order miss by more than 1e-7, so the declared order is the method's, not a lower bound. Likewise for the
    Nyström order (drift linear in p) of McAte4, McAte5 and CalvoSanz4, which are third order otherwise."""
    tab = splitting_tableau(name)
    for order, linear in ((tab.order, False), (tab.nystrom_order, True)):
        if linear and not order:
            continue
        kept = splitting_defects(tab.sequence, order, linear)
        assert max(abs(d[0]) for d in kept) <= 1e-12
        nxt = [d for d in splitting_defects(tab.sequence, order + 1, linear) if sum(1 for _ in _vertices(d[2])) > order]
        assert max(abs(d[0]) for d in nxt) > 1e-7, (name, order)


def _vertices(tree):
    yield tree
    for sub in tree:
        yield from _vertices(sub)


def test_a_wrong_digit_is_refused_with_the_condition_it_misses():
    a, b = kick_drift_kick((1.3512071919596578, -1.7024143839193153, 1.3512071919596578))
    SplittingTableau("yoshida4", 4, a, b, "Yoshida 1990")  # the triple jump to 17 digits: accepted
    bad = (a[0], a[1] + 1e-9, a[2] - 1e-9, a[3])
    with pytest.raises(ValueError, match="yoshida4: misses an order-3 condition"):
        SplittingTableau("yoshida4", 4, bad, b, "Yoshida 1990")
    with pytest.raises(ValueError, match="weights `a` must sum to 1"):
        SplittingTableau("x", 1, (0.5,), (1.0,), "—")
    with pytest.raises(ValueError, match="unknown splitting method 'mcate7'; valid: pseudo_verlet"):
        splitting_tableau("mcate7")


def _quadratic_separable() -> Hamiltonian:
    """``H = ½|K_p p|² + ½|K_q q|²`` (identity activation): separable, quadratic, ``y' = A y`` with frequencies
    0.94 and 2.75."""
    f = Hamiltonian(4, K="blockdiag", activation="identity").double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        f.K_p.data[0] = torch.eye(2, dtype=D) + 0.3 * torch.randn(2, 2, generator=g, dtype=D)
        f.K_q.data[0] = torch.diag(torch.tensor([1.0, 2.0], dtype=D)) + 0.3 * torch.randn(2, 2, generator=g, dtype=D)
    return f


# steps over T = 5 where each method's error lies between ~1e-3 and ~1e-11 (the asymptotic range)
_STEPS = {2: (45, 64, 90, 128), 3: (64, 90, 128, 181), 8: (32, 45, 64, 90), 10: (8, 11, 16, 23)}


@pytest.mark.parametrize("name", NAMES)
def test_fitted_order_on_a_separable_quadratic_hamiltonian(name):
    """``y' = A y`` against ``expm(A T)``, T = 5, float64: the least-squares slope of log error against log steps
    is within 0.1 of the declared order (the Nyström order where one is declared: the drift is linear here)."""
    f = _quadratic_separable()
    A = f(0.0, torch.eye(4, dtype=D)).T.detach()
    y0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    T = 5.0
    exact = y0 @ torch.linalg.matrix_exp(A * T).T
    tab = splitting_tableau(name)
    order = tab.nystrom_order or tab.order
    Ns = _STEPS.get(order, (45, 64, 90, 128))
    errs = [float((_run(get_scheme(name), f, y0, T / N, N) - exact).abs().max()) for N in Ns]
    fitted = -np.polyfit(np.log(Ns), np.log(errs), 1)[0]
    assert abs(fitted - order) < 0.1, (fitted, errs)
    assert errs[-1] > 1e-13  # above rounding: the slope is the method's


def _h2(layers: int, seed: int, T: float = 1.5, J: str = "structured") -> Hamiltonian:
    f = Hamiltonian(6, layers=layers, T=T, K="blockdiag", J=J).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in f.parameters():
            p.copy_(0.7 * torch.randn(p.shape, generator=g, dtype=D))
    return f


@pytest.mark.parametrize("name", NAMES)
def test_each_layer_is_the_hand_written_h2_splitting(name):
    """Discrete mode, five pieces of an H2 field with a learned ``X`` (eqs. H12-13): the network equals the loop
    ``p ← p − b_i h Xᵀ K_qᵀ tanh(K_q q + b_q)``, ``q ← q + a_i h X K_pᵀ tanh(K_p p + b_p)`` written out here, outputs
    and gradients (input and parameters) to 1e-12."""
    L, T = 5, 1.5
    h = T / L
    f = _h2(L, seed=3, T=T)
    tab = splitting_tableau(name)

    def by_hand(y):
        p, q = y[:, :3], y[:, 3:]
        X = f.X
        for j in range(L):
            Kp, Kq, bp, bq = f.K_p.data[j], f.K_q.data[j], f.b_p.data[j], f.b_q.data[j]
            for ai, bi in zip(tab.a, tab.b):
                p = p - bi * h * (X.T @ Kq.T @ torch.tanh(Kq @ q.T + bq[:, None])).T
                q = q + ai * h * (X @ Kp.T @ torch.tanh(Kp @ p.T + bp[:, None])).T
        return torch.cat([p, q], 1)

    net = discretize(f, name)
    assert net.architecture == (f"H2-DNN of order {tab.order} ({name} splitting)", f"eqs. H12-13; {tab.source}")
    assert net.properties == {"symplectic"} and net.order == tab.order
    y0 = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(4))
    ya, yb = y0.clone().requires_grad_(True), y0.clone().requires_grad_(True)
    out_net, out_hand = net(ya), by_hand(yb)
    assert float((out_net - out_hand).detach().abs().max()) <= 1e-12
    c = torch.randn(out_net.shape, dtype=D, generator=torch.Generator().manual_seed(5))
    params = [p for p in f.parameters()]
    g1 = torch.autograd.grad((c * out_net).sum(), [ya, *params], allow_unused=True)
    g2 = torch.autograd.grad((c * out_hand).sum(), [yb, *params], allow_unused=True)
    for u, v in zip(g1, g2):
        assert (u is None) == (v is None)
        if u is not None:
            assert float((u - v).abs().max()) <= 1e-12


@pytest.mark.parametrize("name", NAMES)
def test_step_map_is_symplectic_and_inverted_exactly(name):
    """One step of h = 0.5 on a tanh H2 field (canonical J): ``‖ΦᵀJΦ − J‖_max`` at rounding (≤ 1e-13, the
    Jacobian by autograd); :meth:`inverse` undoes the step to 1e-13; on a non-separable field the method is
    labelled first order and not symplectic."""
    f = _h2(1, seed=6, T=0.5, J="canonical")
    sch, bound = get_scheme(name).for_field(f), BoundField(f)
    y = torch.randn(6, dtype=D, generator=torch.Generator().manual_seed(7))
    Phi = torch.autograd.functional.jacobian(lambda x: sch.readout(sch.step(bound, 0, sch.init(x[None]), 0.5))[0], y)
    J = canonical_J(6, D)
    assert float((Phi.T @ J @ Phi - J).abs().max()) <= 1e-13
    with torch.no_grad():
        s = sch.init(y[None])
        back = sch.inverse(bound, 0, sch.step(bound, 0, s, 0.5), 0.5)
    assert max(float((u - v).abs().max()) for u, v in zip(back, s)) <= 1e-13
    ns = discretize(Hamiltonian(4, K="full").double(), name, split=(2, 2))
    assert ns.order == 1 and ns.properties == frozenset() and "not symplectic" in ns.architecture[0]


class _Custom(Splitting):
    name = "custom"
    tableau = SplittingTableau("custom", 1, (1.0,), (1.0,), "H12-13")  # type: ignore[assignment]


def test_existing_split_schemes_are_rows_of_the_family():
    """Semi-implicit Euler (a = b = (1): the H2-DNN layer) and kick-drift-kick Verlet (a = (1, 0), b = (½, ½)) run
    by the table stepper are the hand-written ``symplectic_euler`` and ``verlet`` layers bit for bit, and the
    kick-drift-kick triple jump is ``yoshida4`` to rounding."""
    f = _h2(4, seed=8)
    y0 = torch.randn(3, 6, dtype=D, generator=torch.Generator().manual_seed(9))
    g = 1.0 / (2.0 - 2.0 ** (1.0 / 3.0))
    cases = [
        ("symplectic_euler", ((1.0,), (1.0,)), 1, 0.0),
        ("verlet", ((1.0, 0.0), (0.5, 0.5)), 2, 0.0),
        ("yoshida4", kick_drift_kick((g, 1.0 - 2.0 * g, g)), 4, 1e-14),
    ]
    for existing, (a, b), order, tol in cases:

        class Table(_Custom):
            tableau = SplittingTableau(existing, order, a, b, "—")  # type: ignore[assignment]

        with torch.no_grad():
            mine, theirs = discretize(f, Table())(y0), discretize(f, existing)(y0)
        assert float((mine - theirs).abs().max()) <= tol, existing


@pytest.mark.parametrize("name", ["mcate5", "sofspa10"])
def test_continuous_mode_gradients(name):
    """ODEBlock(method=name) on a 3-piece H2 field: one step per piece is the discrete net; the stored
    (``checkpoint``) and rebuilt-by-inverse (``reversible``) gradients equal backprop's to 1e-10, and backprop's
    input gradient equals central differences (float64, 1e-6 steps) to 1e-8; ``symplectic`` is refused."""
    f = Hamiltonian(4, layers=3, T=1.5, K="blockdiag", generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((ODEBlock(f, method=name)(y0) - discretize(f, name)(y0)).abs().max()) <= 1e-14
    grads = []
    for gradient in ("backprop", "checkpoint", "reversible"):
        f.zero_grad()
        sol = ODEBlock(f, method=name, gradient=gradient, step_size=0.5).solve(y0)
        (sol.y**2).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in f.parameters()]))
        assert sol.stats["nfe_forward"] == 3 * splitting_tableau(name).evaluations
    assert float((grads[1] - grads[0]).abs().max()) <= 1e-10 and float((grads[2] - grads[0]).abs().max()) <= 1e-10
    block = ODEBlock(f, method=name, step_size=0.5)
    x = y0.clone().requires_grad_(True)
    (g,) = torch.autograd.grad((block(x) ** 2).sum(), x)
    eps = 1e-6
    for i in (0, 3):
        e = torch.zeros_like(y0)
        e[0, i] = eps
        with torch.no_grad():
            fd = ((block(y0 + e) ** 2).sum() - (block(y0 - e) ** 2).sum()) / (2 * eps)
        assert abs(float(fd) - float(g[0, i])) <= 1e-8
    with pytest.raises(ValueError, match="symplectic composition"):
        ODEBlock(f, method=name, gradient="symplectic")
    with pytest.raises(ValueError, match="only on a separable field"):
        ODEBlock(Hamiltonian(4, K="full").double(), method=name)(y0)


def test_every_method_has_its_rows_and_runs_on_ms1():
    """Each method has an ``any`` row with its source, an H2 row and a non-separable row; on MS1 (separable, q
    first in the paper) the layer is symplectic with respect to its layer's ``J`` too."""
    for name in NAMES:
        rows = {(r.field_kind, r.variant): r for r in ARCHITECTURES if r.scheme == name}
        assert rows[("any", "")].equation == SPLITTING_SPECS[name].source
        assert ("hamiltonian", "") in rows and ("any", "non-separable") in rows
        assert name in SPLITTING_SCHEMES
    m = MS1(4, T=0.5, generator=torch.Generator().manual_seed(2)).double()
    net = discretize(m, "mcate42")
    y = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(3))
    Phi = torch.autograd.functional.jacobian(lambda x: net(x[None])[0], y)
    J = m.J_at(0).detach()
    assert float((Phi.T @ J @ Phi - J).abs().max()) <= 1e-13
    assert math.isclose(sum(splitting_tableau("sofspa10").a), 1.0, abs_tol=1e-14)


@pytest.mark.slow
def test_no_secular_energy_drift_where_rk4_drifts():
    """A tanh H2 field (one piece), 300 steps of h = 0.5 from two states: the drift study's tapered per-sample
    slope of the energy error (:func:`~cde_nets.diagnostics.energy_error_fit`) is below 1e-4 of rk4's for a
    Nyström-order method, McLachlan's S_B3A and an eighth-order composition, and their error ends within 10× its
    first-1% maximum (rk4's grows 100×). The work-precision reproduction fits every method's drift over 3000
    steps on five fields."""
    from cde_nets.diagnostics import long_run_energy

    f = Hamiltonian(4, K="blockdiag", generator=torch.Generator().manual_seed(4)).double()
    y0 = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(3))
    rk4 = long_run_energy(f, "rk4", y0, 0.5, 300)["fit"]
    assert rk4["ratio"] > 30
    for name in ("mcate4", "mcate42", "kahan_li8"):
        fit = long_run_energy(f, name, y0, 0.5, 300)["fit"]
        assert abs(fit["slope"]) < 1e-4 * abs(rk4["slope"]) and fit["ratio"] < 10, (name, fit)
