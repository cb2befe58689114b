"""Implicit Runge-Kutta methods: tableaux, convergence orders, symplecticity, and IFT gradients (float64)."""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest
import torch
from scipy.linalg import expm

from cde_nets import ODEBlock
from cde_nets.fields import Hamiltonian
from cde_nets.fields.hamiltonian import canonical_J
from cde_nets.solvers.errors import Reason
from cde_nets.solvers.gradients import Adjoint
from cde_nets.solvers.steppers.implicit import ImplicitSolveError, Newton, get_tableau, implicit_step
from cde_nets.solvers.steppers.implicit_tableaux import IMPLICIT_TABLEAUX, ImplicitTableau

D = torch.float64
METHODS = list(IMPLICIT_TABLEAUX)


def _slope(hs, errs) -> float:
    return float(np.polyfit(np.log(hs), np.log(errs), 1)[0])


def _solve(fun, y0, T, N, tab):
    y, h = y0, T / N
    for k in range(N):
        y, _ = implicit_step(fun, k * h, y, h, tab)
    return y


def _steps(order: int) -> list[int]:
    # asymptotic range above the rounding floor of float64
    return {1: [64, 128, 256, 512, 1024], 2: [16, 32, 64, 128, 256], 3: [8, 16, 32, 64, 128]}.get(
        order, [4, 6, 8, 12, 16] if order <= 4 else [2, 3, 4, 6, 8]
    )


def test_tableaux_check_their_conditions_and_properties():
    gl4 = IMPLICIT_TABLEAUX["gl4"]
    with pytest.raises(ValueError, match="row 0 of a sums"):
        ImplicitTableau("bad", 2, a=((0.4,),), b=(1.0,), c=(0.5,))
    with pytest.raises(ValueError, match="order condition"):
        ImplicitTableau("bad", 5, a=gl4.a, b=gl4.b, c=gl4.c)
    radau = IMPLICIT_TABLEAUX["radauIIA3"]
    with pytest.raises(ValueError, match="declared 'symplectic'"):
        ImplicitTableau("bad", 3, a=radau.a, b=radau.b, c=radau.c, properties=frozenset({"symplectic"}))
    mid = IMPLICIT_TABLEAUX["implicit_midpoint"]
    with pytest.raises(ValueError, match="declared 'L-stable'"):  # R(−∞) = −1
        ImplicitTableau("bad", 2, a=mid.a, b=mid.b, c=mid.c, properties=frozenset({"L-stable"}))
    assert abs(mid.stability(-1e9) + 1) < 1e-8 and abs(radau.stability(-1e9)) < 1e-8


@pytest.mark.parametrize("method", METHODS)
def test_order_on_linear_field_against_expm(method):
    """``y' = Ay`` (a rotation with damping) against ``expm(A)``: fitted order within 0.1 of the declared one."""
    tab = get_tableau(method)
    g = torch.Generator().manual_seed(0)
    M = torch.randn(4, 4, dtype=D, generator=g)
    A = 0.5 * (M - M.T) - 0.2 * torch.eye(4, dtype=D)
    y0 = torch.randn(3, 4, dtype=D, generator=g)
    exact = y0 @ torch.from_numpy(expm(A.numpy())).T
    Ns = _steps(tab.order)
    errs = [float((_solve(lambda t, y: y @ A.T, y0, 1.0, N, tab) - exact).abs().max()) for N in Ns]
    assert abs(_slope([1 / N for N in Ns], errs) - tab.order) < 0.1, errs


def _h1(seed=0) -> Hamiltonian:
    return Hamiltonian(4, T=1.0, K="full", generator=torch.Generator().manual_seed(seed)).double()


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_order_on_nonlinear_hamiltonian_field(method):
    """The H1 field ``y' = J Kᵀ tanh(K y + b)`` against gl6 at 256 steps (error < 1e-15): fitted order within 0.1."""
    tab, f = get_tableau(method), _h1()
    y0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    fun = lambda t, y: f(t, y)  # noqa: E731
    with torch.no_grad():
        ref = _solve(fun, y0, 2.0, 256, get_tableau("gl6"))
        Ns = {1: _steps(1), 5: [12, 16, 24, 32, 48], 6: [12, 16, 24, 32, 48]}.get(
            tab.order, [2 * N for N in _steps(tab.order)]
        )
        errs = [float((_solve(fun, y0, 2.0, N, tab) - ref).abs().max()) for N in Ns]
    assert abs(_slope([1 / N for N in Ns], errs) - tab.order) < 0.1, errs


def _step_jacobian(method, f, y, h):
    tab = get_tableau(method) if method != "rk4" else None

    def step(x):
        if tab is None:
            k1 = f(0, x)
            k2 = f(0, x + h / 2 * k1)
            k3 = f(0, x + h / 2 * k2)
            k4 = f(0, x + h * k3)
            return x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return implicit_step(f, 0.0, x, h, tab)[0]

    return torch.autograd.functional.jacobian(lambda x: step(x[None])[0], y)


@pytest.mark.parametrize("method", ["implicit_midpoint", "gl4", "gl6"])
def test_step_map_is_symplectic_on_the_non_separable_field(method):
    """``‖ΦᵀJΦ − J‖ ≤ 1e-12`` for the step map of the Gauss methods on H1; rk4's defect is orders larger."""
    f, J = _h1(), canonical_J(4, D)
    y = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(2))
    for h in (0.1, 0.5):
        Phi = _step_jacobian(method, f, y, h)
        assert float((Phi.T @ J @ Phi - J).abs().max()) <= 1e-12
    Phi = _step_jacobian("rk4", f, y, 0.5)
    assert float((Phi.T @ J @ Phi - J).abs().max()) > 1e-6


@pytest.mark.parametrize("method", ["implicit_midpoint", "gl4", "gl6"])
def test_quadratic_invariant_of_a_linear_field_is_conserved(method):
    """``y' = J P y`` (``P`` symmetric positive definite) keeps ``yᵀPy``; Gauss methods conserve it to 1e-13."""
    g = torch.Generator().manual_seed(3)
    M = torch.randn(4, 4, dtype=D, generator=g)
    P = M @ M.T + torch.eye(4, dtype=D)
    S = canonical_J(4, D) @ P
    y0 = torch.randn(5, 4, dtype=D, generator=g)
    y = _solve(lambda t, y: y @ S.T, y0, 20.0, 200, get_tableau(method))
    q0, q1 = ((y0 @ P) * y0).sum(1), ((y @ P) * y).sum(1)
    assert float(((q1 - q0) / q0).abs().max()) <= 1e-13


def _energy_errors(method, N, h):
    f = _h1(4)
    y = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(5))
    E0 = f.energy(0.0, y)
    errs = []
    tab = None if method == "rk4" else get_tableau(method)
    with torch.no_grad():
        for _ in range(N):
            if tab is None:
                k1 = f(0, y)
                k2 = f(0, y + h / 2 * k1)
                k3 = f(0, y + h / 2 * k2)
                k4 = f(0, y + h * k3)
                y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            else:
                y = implicit_step(f, 0.0, y, h, tab)[0]
            errs.append(float((f.energy(0.0, y) - E0).abs().max()))
    return np.array(errs)


@pytest.mark.slow
def test_gauss_methods_show_no_secular_energy_drift_where_rk4_drifts():
    """gl4 on H1 over 1000 steps of h = 0.25: the energy error stays within 10× its first-period maximum and its
    fitted slope is below 1e-3 of rk4's at the same step (measured 3.1× and 5e-4; with a gl4 coefficient off by
    1e-3, 41× and 34: the 10⁵-step study is in experiments/)."""
    N, h = 1000, 0.25
    ts = h * np.arange(1, N + 1)
    rk4 = _energy_errors("rk4", N, h)
    gl4 = _energy_errors("gl4", N, h)
    first = gl4[: int(2 * math.pi / h)].max()
    assert gl4.max() <= 10 * first
    slope_rk4 = np.polyfit(ts, rk4, 1)[0]
    slope_gl4 = abs(np.polyfit(ts, gl4, 1)[0])
    assert slope_rk4 > 0 and slope_gl4 < 1e-3 * slope_rk4, (slope_gl4, slope_rk4)


def _field_with_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(4, 4, dtype=D, generator=g).requires_grad_(True)
    b = torch.randn(4, dtype=D, generator=g).requires_grad_(True)
    return (lambda t, x: torch.tanh(x @ W.T + b) * (1 + 0.3 * t)), W, b


@pytest.mark.parametrize("method", ["gl4", "radauIIA5", "trbdf2", "implicit_euler"])
def test_ift_gradient_equals_finite_differences_and_backprop_through_converged_iterations(method):
    tab = get_tableau(method)
    fun, W, b = _field_with_params()
    y0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(6)).requires_grad_(True)

    def loss(y0):
        return (_solve(fun, y0, 0.6, 3, tab) ** 2).sum()

    assert torch.autograd.gradcheck(lambda y, W_, b_: loss(y), (y0, W, b), atol=1e-7, rtol=1e-7)
    A, bw = torch.tensor(tab.a, dtype=D), torch.tensor(tab.b, dtype=D)

    def unrolled(y0):  # fixed-point iteration Z ← h A F(y + Z), run to convergence and differentiated through
        y, h = y0, 0.2
        for k in range(3):
            Z = torch.zeros(tab.stages, *y.shape, dtype=D)
            for _ in range(100):
                Z = h * torch.einsum(
                    "ij,jbn->ibn", A, torch.stack([fun(k * h + c * h, y + Zi) for c, Zi in zip(tab.c, Z)])
                )
            F = torch.stack([fun(k * h + c * h, y + Zi) for c, Zi in zip(tab.c, Z)])
            y = y + h * torch.einsum("i,ibn->bn", bw, F)
        return (y**2).sum()

    g_ift = torch.autograd.grad(loss(y0), (y0, W, b))
    g_ref = torch.autograd.grad(unrolled(y0), (y0, W, b))
    for a, r in zip(g_ift, g_ref):
        assert float((a - r).abs().max()) <= 1e-10


class _Saved:
    __slots__ = ("x", "__weakref__")


def test_memory_saved_per_step_does_not_depend_on_newton_iterations():
    """Bytes the step's graph keeps for backward (tensors packed by autograd and still referenced after the step):
    the same whether Newton took 18, 5 or 5 iterations (simplified to rounding, full, simplified to 1e-4)."""
    fun, W, b = _field_with_params()
    y0 = torch.randn(8, 4, dtype=D, generator=torch.Generator().manual_seed(7)).requires_grad_(True)
    saved, iters = [], []
    for newton in (Newton("simplified"), Newton("full"), Newton("simplified", tol=1e-4)):
        live: dict[int, int] = {}

        def pack(x, live=live):
            tok = _Saved()
            tok.x = x
            live[id(tok)] = x.numel() * x.element_size()
            weakref.finalize(tok, live.pop, id(tok), None)
            return tok

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tok: tok.x):
            y, k = implicit_step(fun, 0.0, y0, 0.4, get_tableau("gl4"), newton)
        saved.append(sum(live.values()))
        iters.append(k)
        torch.autograd.grad(y.sum(), y0)  # the graph is usable
    assert len(set(iters)) >= 2 and len(set(saved)) == 1 and saved[0] > 0, (iters, saved)


@pytest.mark.parametrize("gradient", ["checkpoint", "reversible"])
def test_block_gradient_modes_agree_with_backprop(gradient):
    """ODEBlock with gl4 on a 3-piece H1 field: checkpoint and reversible (states rebuilt by the step with −h, exact
    for a symmetric method) give backprop's gradient to 1e-10; the counts add up."""
    f = Hamiltonian(4, layers=3, T=1.0, generator=torch.Generator().manual_seed(8)).double()
    y0 = torch.randn(5, 4, dtype=D, generator=torch.Generator().manual_seed(9))
    grads = {}
    for g in ("backprop", gradient):
        blk = ODEBlock(f, method="gl4", gradient=g, step_size=0.1)
        f.zero_grad()
        sol = blk.solve(y0)
        (sol.y**2).sum().backward()
        grads[g] = [p.grad.clone() for p in f.parameters()]
        assert sol.stats["steps_forward"] == 12 and sol.stats["nfe_backward"] > 0
    for a, r in zip(grads[gradient], grads["backprop"]):
        assert float((a - r).abs().max()) <= 1e-10
    with torch.no_grad():
        ref = ODEBlock(f, method="dopri5", rtol=1e-12, atol=1e-12)(y0)
        assert float((ODEBlock(f, method="gl6", step_size=0.1)(y0) - ref).abs().max()) < 1e-8


def test_errors_name_the_argument_and_the_fix():
    f = _h1()
    with pytest.raises(
        ValueError, match="symmetric implicit method .* \\(not 'radauIIA3'\\); use gradient='checkpoint'"
    ):
        ODEBlock(f, method="radauIIA3", gradient="reversible")
    with pytest.raises(ValueError, match="has no backward ODE solve to set"):
        ODEBlock(f, method="gl4", gradient=Adjoint(rtol=1e-9))
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['foo'\]"):
        ODEBlock(f, method="gl4", options={"foo": 1})
    with pytest.raises(ValueError, match="Newton\\(kind"):
        Newton("quasi")
    y0 = torch.ones(2, 1, dtype=D)
    with pytest.raises(ImplicitSolveError, match="did not converge in 2 iterations") as info:
        implicit_step(lambda t, y: -50 * y**3, 0.0, y0, 1.0, get_tableau("gl4"), Newton(max_iters=2))
    assert info.value.reason is Reason.NEWTON_MAX_ITERS and info.value.iterations == 2

    class Boom(RuntimeError):
        pass

    def bad(t, y):
        raise Boom("mine")

    with pytest.raises(Boom, match="mine"):
        implicit_step(bad, 0.0, y0, 0.1, get_tableau("gl4"))


def test_follows_the_input_dtype():
    f = Hamiltonian(4, T=1.0, generator=torch.Generator().manual_seed(0))
    y = ODEBlock(f, method="radauIIA3", step_size=0.25)(torch.randn(2, 4))
    assert y.dtype == torch.float32 and bool(torch.isfinite(y).all())


def test_fixed_point_kind_gives_the_newton_step_and_gradient_without_jacobians():
    """Newton('fixed_point') iterates Z ← h A F(y + Z) forward and the transposed system with vector-Jacobian
    products backward: same step and gradients as the direct solves (float64, non-stiff field, h = 0.2)."""
    fun, W, b = _field_with_params()
    y0 = torch.randn(6, 4, dtype=D, generator=torch.Generator().manual_seed(10)).requires_grad_(True)
    out = {}
    for kind in ("simplified", "fixed_point"):
        y1, _ = implicit_step(fun, 0.0, y0, 0.2, get_tableau("gl4"), Newton(kind))
        out[kind] = (y1, *torch.autograd.grad((y1**2).sum(), (y0, W, b)))
    for a, r in zip(out["fixed_point"], out["simplified"]):
        assert float((a - r).detach().abs().max()) <= 1e-12
    with pytest.raises(ImplicitSolveError, match="did not converge"):  # h ‖A‖ ‖J‖ > 1: the iteration diverges
        implicit_step(lambda t, y: -30 * y, 0.0, y0.detach(), 1.0, get_tableau("gl4"), Newton("fixed_point"))


@pytest.mark.parametrize("method", ["gl4", "gl6", "radauIIA3", "radauIIA5", "sdirk2"])
def test_eigenbasis_newton_gives_the_dense_newton_step(method, monkeypatch):
    """From s·n = 32 the simplified Newton matrix is factored in the eigenbasis of A (one complex n × n system per
    conjugate pair); the converged step is the dense factorisation's to rounding. SDIRK's A is defective: dense."""
    import cde_nets.solvers.steppers.implicit_linear as implicit

    g = torch.Generator().manual_seed(11)
    W = torch.randn(16, 16, dtype=D, generator=g) / 4
    y0 = torch.randn(5, 16, dtype=D, generator=g)

    def fun(t, x):
        return torch.tanh(x @ W.T) - 0.5 * x

    tab = get_tableau(method)
    assert (implicit.eigen_solver(tab, torch.zeros(1, 16, 16, dtype=D), 0.1) is None) == (method == "sdirk2")
    eig, k_eig = implicit_step(fun, 0.0, y0, 0.3, tab, Newton("simplified"))
    monkeypatch.setattr(implicit, "_EIGEN_MIN_SIZE", 10**9)
    dense, k_dense = implicit_step(fun, 0.0, y0, 0.3, tab, Newton("simplified"))
    assert float((eig - dense).abs().max()) <= 1e-14 and abs(k_eig - k_dense) <= 1


def _stability_exact(tab, z: int) -> float:
    """``R(z) = 1 + z bᵀ(I − zA)^{−1} 1`` in exact rational arithmetic on the tableau's doubles."""
    from fractions import Fraction

    s = tab.stages
    M = [[Fraction(int(i == j)) - z * Fraction(tab.a[i][j]) for j in range(s)] + [Fraction(1)] for i in range(s)]
    for i in range(s):  # Gauss-Jordan elimination
        p = next(r for r in range(i, s) if M[r][i] != 0)
        M[i], M[p] = M[p], M[i]
        M[i] = [v / M[i][i] for v in M[i]]
        for r in range(s):
            if r != i and M[r][i] != 0:
                M[r] = [vr - M[r][i] * vi for vr, vi in zip(M[r], M[i])]
    return float(1 + z * sum(Fraction(bi) * M[i][s] for i, bi in enumerate(tab.b)))


@pytest.mark.parametrize("method", METHODS)
def test_stiff_decay_follows_the_declared_stability(method):
    """One step of ``y' = −10⁸ y`` with ``h = 1`` multiplies ``y`` by ``R(−10⁸)`` to rounding: ≈ 0 for the L-stable
    methods, |R| ≤ 1 for the A-stable ones (Gauss and the trapezoid keep |R| ≈ 1). The output comes from the stages
    (``y_0 + Σ d_i Z_i``): through ``h Σ b_i F(Y_i)`` the stages' rounding would be multiplied by 10⁸."""
    tab = get_tableau(method)
    y1, _ = implicit_step(lambda t, y: -1e8 * y, 0.0, torch.ones(1, 1, dtype=D), 1.0, tab)
    R = _stability_exact(tab, -(10**8))
    assert abs(float(y1) - R) <= 1e-13
    assert abs(R) <= (1e-7 if "L-stable" in tab.properties else 1.0)


def test_auto_newton_takes_the_fixed_point_where_it_contracts_and_newton_where_it_does_not():
    """Newton("auto"): on a non-stiff field (h = 0.05) the fixed point converges, with the step and IFT gradient of
    simplified Newton to 1e-12; on a stiff field (y′ = −30 y + …, h = 1) it diverges, and the step restarts with
    simplified Newton, which then gives that kind's step and gradient exactly."""
    from cde_nets.solvers.steppers.implicit import solve_stages

    fun, W, b = _field_with_params()
    tab = get_tableau("gl4")
    for scale, h, expected in ((1.0, 0.05, "fixed_point"), (-30.0, 1.0, "simplified")):

        def f(t, x, scale=scale):
            return fun(t, x) if scale == 1.0 else scale * x + 0.1 * fun(t, x)

        y0 = torch.randn(6, 4, dtype=D, generator=torch.Generator().manual_seed(12)).requires_grad_(True)
        with torch.no_grad():
            times = [c * h for c in tab.c]
            assert solve_stages(f, 0.0, times, y0.detach(), h, tab, Newton("auto"))[2] == expected
        out = {}
        for kind in ("auto", expected):
            y1, _ = implicit_step(f, 0.0, y0, h, tab, Newton(kind))
            out[kind] = (y1, *torch.autograd.grad((y1**2).sum(), (y0, W, b)))
        for a, r in zip(out["auto"], out[expected]):
            assert float((a - r).detach().abs().max()) <= 1e-12 * max(1.0, float(r.detach().abs().max()))


def test_stages_in_one_call_give_the_same_step_gradient_and_count():
    """batched=True evaluates the s stages as one call on s·B rows: same step (1e-15), gradient (1e-13) and
    evaluation count as s calls, for every kind of iteration."""
    fun, W, b = _field_with_params()
    autonomous = lambda t, x: fun(0.0, x)  # noqa: E731
    y0 = torch.randn(5, 4, dtype=D, generator=torch.Generator().manual_seed(13)).requires_grad_(True)

    class Counting:
        def __init__(self):
            self.n = 0

        def __call__(self, t, x):
            self.n += 1
            return autonomous(t, x)

        def count(self, k):
            self.n += k

    for kind in ("fixed_point", "simplified", "full"):
        res = {}
        for batched in (False, True):
            f = Counting()
            y1, _ = implicit_step(f, 0.0, y0, 0.3, get_tableau("gl6"), Newton(kind), batched=batched)
            g = torch.autograd.grad((y1**2).sum(), (y0, W, b))
            res[batched] = (y1.detach(), g, f.n)
        assert float((res[True][0] - res[False][0]).abs().max()) <= 1e-15
        for a, r in zip(res[True][1], res[False][1]):
            assert float((a - r).abs().max()) <= 1e-13
        assert res[True][2] == res[False][2], (kind, res[True][2], res[False][2])


def test_a_time_dependent_module_keeps_each_stage_time():
    """A plain module may read t, so its stages are never merged into one call: y' = t y over [0, 1] with gl4 and
    h = 0.1 matches exp(t²/2) to gl4's 5.4e-7 (stages all at the step's start err by 4.7e-2)."""

    class TimeScaled(torch.nn.Module):
        def forward(self, t, y):
            return t * y

    y0 = torch.ones(2, 1, dtype=D)
    y1 = ODEBlock(TimeScaled(), T=1.0, method="gl4", step_size=0.1)(y0)
    assert float((y1 - math.exp(0.5)).abs().max()) < 1e-6


def test_auto_newton_pays_its_probe_once_per_stiff_solve():
    """Van der Pol with μ = 1000 over [0, 20] in 20 steps of radauIIA5: the fixed point diverges at the first step,
    and the later steps start with Newton, so 'auto' costs at most one probe (≤ 10 evaluations) more than
    'simplified', for the same solution."""
    from cde_nets.benchmarks.implicit_methods import VanDerPol

    y0 = torch.tensor([[2.0, 0.0]], dtype=D)
    out = {}
    for kind in ("auto", "simplified"):
        blk = ODEBlock(VanDerPol(1000.0), T=20.0, method="radauIIA5", step_size=1.0, options={"newton": kind})
        with torch.no_grad():
            sol = blk.solve(y0)
            out[kind] = (sol.y, sol.stats["nfe_forward"])
    assert float((out["auto"][0] - out["simplified"][0]).abs().max()) <= 1e-12
    assert out["simplified"][1] < out["auto"][1] <= out["simplified"][1] + 10, out
