"""Each scheme on each field is the paper's layer equation, written out by hand here (outputs 1e-12, gradients)."""

import math

import pytest
import torch

from cde_nets import discretize
from cde_nets.fields import MS1, MS2, MS3, NAIS, CubicFriction, Field, Hamiltonian, SecondOrder
from cde_nets.fields.pieces import Pieces

L, T = 5, 1.5
h = T / L


def randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.7)


def same_outputs_and_grads(net, by_hand, y0, params=None):
    y0a = y0.clone().requires_grad_(True)
    y0b = y0.clone().requires_grad_(True)
    out_net, out_hand = net(y0a), by_hand(y0b)
    assert torch.allclose(out_net, out_hand, atol=1e-12, rtol=0)
    params = [p for p in (params or net.parameters()) if p.requires_grad]
    c = torch.randn(out_net.shape, generator=torch.Generator().manual_seed(99))
    g1 = torch.autograd.grad((c * out_net).sum(), [y0a, *params], allow_unused=True)
    g2 = torch.autograd.grad((c * out_hand).sum(), [y0b, *params], allow_unused=True)
    for a, b in zip(g1, g2):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_H1_eq_H9(f64):
    f = Hamiltonian(4, layers=L, T=T, J="learned", init_std=1.0)
    randomise(f, 0)

    def by_hand(y):
        for j in range(L):
            K, b, J = f.K.data[j], f.b.data[j], f.S - f.S.T
            y = y + h * (J @ K.T @ torch.tanh(K @ y.T + b[:, None])).T
        return y

    same_outputs_and_grads(discretize(f, "euler"), by_hand, torch.randn(3, 4))


def test_H2_eqs_H12_13(f64):
    f = Hamiltonian(6, layers=L, T=T, K="blockdiag", J="structured")
    randomise(f, 1)

    def by_hand(y):
        p, q = y[:, :3], y[:, 3:]
        X = f.X
        for j in range(L):
            Kp, Kq, bp, bq = f.K_p.data[j], f.K_q.data[j], f.b_p.data[j], f.b_q.data[j]
            p = p - h * (X.T @ Kq.T @ torch.tanh(Kq @ q.T + bq[:, None])).T
            q = q + h * (X @ Kp.T @ torch.tanh(Kp @ p.T + bp[:, None])).T
        return torch.cat([p, q], 1)

    same_outputs_and_grads(discretize(f, "symplectic_euler"), by_hand, torch.randn(3, 6))


def test_MS1_MS2_MS3(f64):
    m1, m2, m3 = MS1(4, layers=L, T=T), MS2(4, layers=L, T=T), MS3(4, layers=L, T=T)
    for i, m in enumerate((m1, m2, m3)):
        randomise(m, 10 + i)

    def ms1(y):
        p, q = y[:, :2], y[:, 2:]
        for j in range(L):
            K0 = m1.K0.data[j]
            q = q - h * torch.tanh(p @ K0 + m1.b1.data[j])  # σ(K0ᵀ p + b1) as rows
            p = p + h * torch.tanh(q @ K0.T + m1.b2.data[j])
        return torch.cat([p, q], 1)

    def ms2(y):
        for j in range(L):
            K = m2.K_at(j)
            assert torch.allclose(K, -K.T)
            y = y + h * torch.tanh(y @ K.T + m2.b.data[j])
        return y

    def ms3(y):
        p, q = y[:, :2], y[:, 2:]
        for j in range(L):
            K1, K2 = m3.K1.data[j], m3.K2.data[j]
            p = p + h * torch.tanh(q @ K1.T + m3.b1.data[j]) @ K1
            q = q - h * torch.tanh(p @ K2.T + m3.b2.data[j]) @ K2
        return torch.cat([p, q], 1)

    y0 = torch.randn(3, 4)
    same_outputs_and_grads(discretize(m1, "symplectic_euler_qp"), ms1, y0)
    same_outputs_and_grads(discretize(m2, "euler"), ms2, y0)
    same_outputs_and_grads(discretize(m3, "symplectic_euler"), ms3, y0)
    n = lambda m: sum(p.numel() for p in m.parameters()) // L  # noqa: E731
    assert (n(m1), n(m2), n(m3)) == (8, 10, 12)  # Table H-I parameters per layer


def test_ruseckas_residual_eq_R109(f64):
    f = CubicFriction(3, layers=L, T=T, gamma=0.4, zero_init=False)
    randomise(f, 2)

    def by_hand(x):
        for j in range(L):
            wt, bt, gt = h * f.W.data[j], h * f.b.data[j], h * f.gamma
            x = x + x @ wt.T + bt - gt * x**3
        return x

    same_outputs_and_grads(discretize(f, "euler"), by_hand, torch.randn(4, 3))


class Tanh(Field):
    """σ^{(l)}(x) = tanh(W_l x + c_l): the per-layer activation of the Hauser and LM nets."""

    def __init__(self, d):
        super().__init__(T=T, layers=L)
        self.state_shape = (d,)
        self.W = Pieces(self.grid, (d, d), init=lambda w: w.normal_())
        self.c = Pieces(self.grid, (d,), init=lambda w: w.normal_())

    def evaluate(self, l, x):
        return torch.tanh(x @ self.W[l].T + self.c[l])


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ck_eq_S7(f64, k):
    f = Tanh(2)

    def by_hand(x):
        # δ⁺(δ⁻)^{k−1} x^{(l)} = Σ_i (−1)^i C(k, i) x^{(l+1−i)} = σ^{(l)}(x^{(l)}) h^k, lags before 0 equal x0
        xs = [x] * k
        for j in range(L):
            rhs = f.evaluate(j, xs[-1]) * h**k
            nxt = rhs - sum((-1) ** i * math.comb(k, i) * xs[-i] for i in range(1, k + 1))
            xs.append(nxt)
        return xs[-1]

    same_outputs_and_grads(discretize(f, "ck", k=k), by_hand, torch.randn(3, 2))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_dense_eq_S9_and_S22(f64, k):
    f = Tanh(2)

    def by_hand(x0):
        # eq. S9: x^{(l+1)} = Σ_{l'=0}^{k−1} σ^{(l−l')}(x^{(l−l')}) h + x^{(l+1−k)}, absent terms before layer 0
        xs = {0: x0}
        get = lambda i: xs[max(i, 0)]  # noqa: E731
        for l in range(L):
            s = sum(f.evaluate(l - i, get(l - i)) * h for i in range(k) if l - i >= 0)
            xs[l + 1] = s + get(l + 1 - k)
        return xs[L]

    same_outputs_and_grads(discretize(f, "dense", k=k), by_hand, torch.randn(3, 2))


def test_dense_matrix_is_S22_for_k3():
    from cde_nets.solvers.schemes import dense_matrix

    assert dense_matrix(3).tolist() == [[1, 0, 0], [1, -1, 0], [1, -2, 1]]
    assert torch.equal(dense_matrix(5) @ dense_matrix(5), torch.eye(5, dtype=torch.float64))  # binomial inversion


def test_lm_two_step_eq_R111(f64):
    f = Tanh(3)
    net = discretize(f, "lm2")
    with torch.no_grad():
        net.k_lm.normal_()

    def by_hand(x):
        prev = x
        for l in range(L):
            kl = net.k_lm[l] if l > 0 else 0.0
            x, prev = (1 - kl) * x + kl * prev + h * f.evaluate(l, x), x
        return x

    same_outputs_and_grads(net, by_hand, torch.randn(3, 3))


def test_momentum_block_of_the_blog(f64):
    """v_{l+1} = m_l v_l + η_l h F_l(x_l), x_{l+1} = x_l + v_{l+1}, v_0 = 0 (B §8)."""
    f = Tanh(3)
    net = discretize(f, "momentum")
    with torch.no_grad():
        net.a.normal_()
        net.b.normal_()

    def by_hand(x):
        v = torch.zeros_like(x)
        for l in range(L):
            v = torch.sigmoid(net.a[l]) * v + torch.nn.functional.softplus(net.b[l]) * h * f.evaluate(l, x)
            x = x + v
        return x

    same_outputs_and_grads(net, by_hand, torch.randn(3, 3))


def test_momentum_starts_as_a_resnet(f64):
    f = Tanh(3)
    x0 = torch.randn(4, 3)
    out = discretize(f, "momentum")(x0)
    assert torch.allclose(out, discretize(f, "euler")(x0), atol=1e-3)  # m = sigmoid(-10) = 4.5e-5, η = 1


def test_nais_block_eq_N3(f64):
    """x(k+1) = x(k) + h σ(A_k x(k) + B_k u + b_k), A_k = −R_kᵀR_k − εI, the same u at every layer (eq. N3)."""
    f = NAIS(3, 2, layers=L, T=T, eps=0.05)
    randomise(f, 3)
    u = torch.randn(4, 2)

    def by_hand(x):
        for j in range(L):
            R, B, b = f.R.data[j], f.B.data[j], f.b.data[j]
            A = -R.T @ R - 0.05 * torch.eye(3)
            x = x + h * torch.tanh(x @ A.T + u @ B.T + b)
        return x

    net = discretize(f, "euler")
    same_outputs_and_grads(lambda x: net(x, u=u), by_hand, torch.randn(4, 3), params=list(net.parameters()))
    assert net.architecture == ("NAIS-Net block", "eq. N3")


class Drive(Field):
    """The first-order field ``F_l(x) = f_l(x)`` of a second-order field's drive ``f`` (shared parameters)."""

    def __init__(self, f, d):
        super().__init__(T=T, layers=L)
        self.state_shape = (d,)
        self.f = f

    def evaluate(self, l, x):
        return self.f.evaluate(l, x)


def test_blog_second_order_block_is_momentum_on_a_second_order_field(f64):
    """B §8: u_l = f_l(LN(x_l)), v_{l+1} = m ⊙ v_l + η ⊙ u_l, x_{l+1} = x_l + v_{l+1}, v_0 = 0, with the field's
    m = 1 − hγ and η_B = h²η on the scaled velocity ṽ = h v (SecondOrder: x' = v, v' = −γ v + η f(x))."""
    f2 = SecondOrder(3, layers=L, T=T, gamma=0.8, eta=1.3, layer_norm=True)
    randomise(f2, 4)
    net = discretize(f2, "momentum")
    assert {id(p) for p in net.parameters()} == {id(p) for p in f2.parameters()}  # no m, η of its own

    def by_hand(y):
        x, vt = y[:, :3], h * y[:, 3:]
        m, eta_b = 1 - h * f2.gamma, h * h * f2.eta
        for j in range(L):
            W1, c1, W2, c2 = (f2.f.W1.data[j], f2.f.c1.data[j], f2.f.W2.data[j], f2.f.c2.data[j])
            u = torch.tanh(torch.nn.functional.layer_norm(x, (3,)) @ W1.T + c1) @ W2.T + c2
            vt = m * vt + eta_b * u
            x = x + vt
        return torch.cat([x, vt / h], 1)

    same_outputs_and_grads(net, by_hand, torch.randn(4, 6))
    assert net.architecture[0].startswith("second-order residual")
    y0 = torch.randn(4, 6)
    assert torch.equal(net(y0), discretize(f2, "symplectic_euler_qp")(y0))

    # the bridge: the momentum scheme on the first-order drive, m_l = 1 − hγ and η_l = hη, is the same network
    first = discretize(Drive(f2.f, 3), "momentum")
    with torch.no_grad():
        m = 1 - h * f2.gamma
        first.a.copy_(torch.log(m / (1 - m)).expand_as(first.a))
        first.b.copy_(torch.log(torch.expm1(h * f2.eta)).expand_as(first.b))
    x0 = torch.randn(4, 3)
    out2 = net(torch.cat([x0, torch.zeros_like(x0)], 1))
    assert torch.allclose(first(x0), out2[:, :3], atol=1e-12, rtol=0)


def test_the_map_names_each_network_of_this_file(f64):
    """the architecture map: every scheme has a row, and each (scheme, field) pair above resolves to its paper's
    architecture."""
    from cde_nets.solvers import ARCHITECTURES, SCHEMES, architecture

    assert {r.scheme for r in ARCHITECTURES} == set(SCHEMES)
    assert all(any(r.scheme == s and r.field_kind == "any" for r in ARCHITECTURES) for s in SCHEMES)
    cases = [
        (Hamiltonian(4), "euler", ("H1-DNN", "eq. H9")),
        (Hamiltonian(4, K="blockdiag"), "symplectic_euler", ("H2-DNN", "eqs. H12-13")),
        (MS1(4), "symplectic_euler_qp", ("MS1", "eq. 38")),
        (MS2(4), "euler", ("MS2", "eq. 39")),
        (MS3(4), "symplectic_euler", ("MS3", "eq. 40")),
        (MS1(4), "symplectic_euler", ("semi-implicit (symplectic) Euler net, p first", "H12-13")),
        (CubicFriction(3), "euler", ("Ruseckas residual", "eq. R109")),
        (SecondOrder(2), "momentum", ("second-order residual (B §8)", "B §8")),
        (Tanh(2), "ck", ("Hauser C^k network", "eq. S7")),
        (Tanh(2), "dense", ("DenseNet state space", "eq. S22")),
        (Tanh(2), "lm2", ("LM-ResNet", "eq. R111")),
    ]
    for field, scheme, (name, eq) in cases:
        got = discretize(field, scheme).architecture
        assert got[0].startswith(name) and got[1].endswith(eq), (scheme, got)
        assert architecture(scheme, field) == got == SCHEMES[scheme].architecture(field)
    with pytest.raises(ValueError, match="unknown scheme 'rk5'; valid schemes: euler, symplectic_euler"):
        architecture("rk5", "any")
