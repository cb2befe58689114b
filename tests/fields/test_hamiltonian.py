"""Hamiltonian field (Galimberti et al.): energy conservation, symplectic flow, ‖Φ‖ >= 1, H2 structure, locality."""

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.fields import Hamiltonian, canonical_J
from cde_nets.fields.locality import LocalityError, block_mask, check_locality, locality_violations


def flow_jacobians(block, y0):
    """``Φ = ∂y(T)/∂y0`` of every row of ``y0``, ``(batch, dim, dim)``, from one batched solve: the rows do not
    interact, so output ``i`` summed over the batch has row ``i`` of each sample's ``Φ`` as its gradient (the
    shared adaptive steps couple them only through the step sizes, at the tolerance's size)."""
    y0 = y0.clone().requires_grad_(True)
    out = block(y0)
    rows = [torch.autograd.grad(out[:, i].sum(), y0, retain_graph=True)[0] for i in range(out.shape[1])]
    return torch.stack(rows, 1)


def test_energy_is_conserved_by_the_flow(f64):
    field = Hamiltonian(4, T=10.0, init_std=1.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        field.b.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    y0 = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    # the drift is the solver's error, 1.2e-8 at this tolerance (1.2e-7 at rtol 1e-9); a field off J∇H drifts O(1)
    ys = ODEBlock(field, rtol=1e-10, atol=1e-11).solve(y0, t=torch.linspace(0, 10, 21)).ys
    H = torch.stack([field.energy(0.0, y) for y in ys])
    drift = ((H - H[0]).abs().max(0).values / H[0].abs()).max()
    assert drift < 1e-7


def test_field_is_J_times_energy_gradient(f64):
    field = Hamiltonian(6, layers=3, J="learned", width=5, init_std=1.0)
    y = torch.randn(4, 6, requires_grad=True)
    for l in range(3):
        (gH,) = torch.autograd.grad(field.energy_at(l, y).sum(), y)
        assert torch.allclose(field.evaluate(l, y), gH @ field.J.T, atol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize("layers", [1, 6])
def test_flow_is_symplectic_and_expanding(f64, layers):
    """Φᵀ J Φ = J (Lemma H2) and hence ‖Φ‖₂ >= 1 (Theorem H1), time-varying K, b included."""
    g = torch.Generator().manual_seed(layers)
    field = Hamiltonian(4, layers=layers, T=2.0, init_std=1.0, generator=g)
    with torch.no_grad():
        field.b.data.normal_(0, 1.0, generator=g)
    block = ODEBlock(field, rtol=1e-12, atol=1e-13, gradient="backprop")
    J = canonical_J(4)
    for Phi in flow_jacobians(block, torch.randn(3, 4, generator=g)):
        assert torch.allclose(Phi.T @ J @ Phi, J, atol=1e-8)
        assert torch.linalg.matrix_norm(Phi, ord=2) >= 1 - 1e-12


@pytest.mark.parametrize("masked", [False, True])
def test_h2_field_equals_the_dense_form(f64, masked):
    """blockdiag K with J = [[0, −Xᵀ], [X, 0]]: the separable halves equal J Kᵀσ(Ky + b) assembled densely,
    also with per-piece K masks and a J mask (the distributed H2-DNN)."""
    masks = {}
    if masked:
        g = torch.Generator().manual_seed(9)
        masks["K_mask"] = (torch.rand(2, 3, 3, generator=g) > 0.4).double()
        Mx = (torch.rand(3, 3, generator=g) > 0.3).double()
        masks["J_mask"] = torch.cat([torch.cat([torch.zeros(3, 3), Mx.T], 1), torch.cat([Mx, torch.zeros(3, 3)], 1)])
    field = Hamiltonian(6, layers=2, K="blockdiag", J="structured", init_std=1.0, **masks)
    with torch.no_grad():
        field.X.normal_()
        field.b_p.data.normal_()
        field.b_q.data.normal_()
    assert field.split == (3, 3)
    y = torch.randn(5, 6)
    for l in range(2):
        K, b = field.K_at(l), field.b_at(l)
        dense = torch.tanh(y @ K.T + b) @ K @ field.J.T
        assert torch.allclose(field.evaluate(l, y), dense, atol=1e-13)
        assert torch.allclose(field.evaluate_part(l, y, 0), dense[:, :3], atol=1e-13)
        assert torch.allclose(field.evaluate_part(l, y, 1), dense[:, 3:], atol=1e-13)


def test_parameter_counts_match_table_H_I():
    """Per layer in R⁴: H1 20, H2 12 (Table H-I)."""
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(Hamiltonian(4, layers=8)) == 8 * 20
    assert n(Hamiltonian(4, layers=8, K="blockdiag")) == 8 * 12


def test_energy_antiderivatives(f64):
    y = torch.randn(3, 4, requires_grad=True)
    for act in ("tanh", "sigmoid", "relu", "identity"):
        field = Hamiltonian(4, activation=act, init_std=1.0)
        (gH,) = torch.autograd.grad(field.energy(0.0, y).sum(), y)
        assert torch.allclose(gH, field.grad_H(0, y), atol=1e-12), act
    big = Hamiltonian(2, init_std=1.0)
    with torch.no_grad():
        big.K.data[0] = 1e3 * torch.eye(2)
    assert torch.isfinite(big.energy(0.0, torch.ones(1, 2))).all()  # log cosh of 1000 without overflow


def test_masks_zero_the_blocks(f64):
    R = torch.tensor([[1, 1, 0], [0, 1, 0], [0, 0, 1]])
    Km = block_mask(R, [2, 2, 2])
    Jm = block_mask(torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1]]), [2, 2, 2])
    field = Hamiltonian(6, J="learned", K_mask=Km, J_mask=Jm, init_std=1.0)
    assert torch.equal(field.K_at(0)[Km == 0], torch.zeros(int((Km == 0).sum())))
    assert torch.equal(field.J[Jm == 0], torch.zeros(int((Jm == 0).sum())))
    assert torch.allclose(field.J, -field.J.T)


# Example 1 of the H-DNN seed (M = 4): R, T on [0, T/3), [T/3, 2T/3), [2T/3, T]; node 2 and node 4 never talk.
S_EX1 = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 1, 1]]
I4 = torch.eye(4, dtype=torch.int64).tolist()
EX1 = [
    (I4, S_EX1),
    ([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1], [0, 0, 1, 1]], I4),
    (
        [[1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],
        [[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]],
    ),
]


def test_locality_example_1_passes():
    for R, T in EX1:
        assert locality_violations(R, T, S_EX1) == []
        check_locality(R, T, S_EX1)


def test_locality_violation_is_refused_and_named():
    R = [[1, 1, 0, 1], [1, 1, 0, 0], [1, 0, 1, 1], [0, 0, 1, 1]]  # column 2 and 4 now share row 1
    assert locality_violations(R, I4, S_EX1) == [(2, 4)]
    with pytest.raises(LocalityError, match=r"nodes \(2, 4\) \(1-based\) would have to exchange"):
        check_locality(R, I4, S_EX1)
    with pytest.raises(ValueError, match="`T` and `S` must be symmetric"):
        check_locality(I4, [[1, 1, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], S_EX1)


def test_errors():
    with pytest.raises(ValueError, match="`dim` must be even"):
        Hamiltonian(3)
    with pytest.raises(ValueError, match="`K='blockdiag'` splits y = \\(p, q\\) and needs an even `dim`"):
        Hamiltonian(5, J=torch.zeros(5, 5), K="blockdiag")
    with pytest.raises(ValueError, match="`J` must be skew-symmetric"):
        Hamiltonian(2, J=torch.eye(2))
    with pytest.raises(ValueError, match="`activation` 'gelu' is unknown"):
        Hamiltonian(2, activation="gelu")
    with pytest.raises(NotImplementedError, match="antiderivative"):
        Hamiltonian(2, activation="softplus").energy(0.0, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="`K` must be 'full'"):
        Hamiltonian(2, K="diag")
