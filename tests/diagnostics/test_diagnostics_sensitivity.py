"""Backward sensitivity matrices (Galimberti et al.): H2 nets keep ‖Φ_ℓ‖ >= 1 at every depth (Lemma H4, Theorem H1's
discrete form), a tanh MLP with the same weight scale loses its gradient; flows are symplectic (Lemma H2)."""

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.diagnostics import continuous_bsm, discrete_bsm, singular_value_pairing, symplecticity_defect
from cde_nets.fields import Hamiltonian, canonical_J

STD, LAYERS = 0.3, 32


def h2_step(f):
    """Eqs. H12-13 written out: p ← p + h F_p(q), then q ← q + h F_q(p_new)."""
    h = f.grid.h

    def step(l, y):
        p, q = y[:, :2], y[:, 2:]
        p = p + h * f.evaluate_part(l, torch.cat([p, q], 1), 0)
        q = q + h * f.evaluate_part(l, torch.cat([p, q], 1), 1)
        return torch.cat([p, q], 1)

    return step


def test_h2_bsm_never_below_one_and_symplectic(f64):
    g = torch.Generator().manual_seed(0)
    f = Hamiltonian(4, layers=LAYERS, T=LAYERS * 0.4, K="blockdiag", init_std=STD, generator=g)
    y0 = torch.randn(16, 4, generator=g)
    r = discrete_bsm(h2_step(f), y0, LAYERS, matrices=True)
    assert r["ell"] == list(range(1, LAYERS + 1))
    assert r["min"].min() >= 1 - 1e-10
    assert symplecticity_defect(r["Phi"], canonical_J(4)).max() < 1e-9
    assert singular_value_pairing(r["Phi"]).max() < 1e-9


def test_tanh_mlp_bsm_collapses(f64):
    g = torch.Generator().manual_seed(0)
    Ws = [torch.randn(4, 4, generator=g) * STD for _ in range(LAYERS)]
    y0 = torch.randn(16, 4, generator=g)
    r = discrete_bsm([lambda y, W=W: torch.tanh(y @ W.T) for W in Ws], y0)
    assert r["max"][-1] < 1e-3
    assert r["max"][0] > 0.1


def test_continuous_bsm_symplectic_and_at_least_one(f64):
    g = torch.Generator().manual_seed(1)
    block = ODEBlock(Hamiltonian(4, layers=4, T=2.0, init_std=1.0, generator=g), rtol=1e-10, atol=1e-10)
    r = continuous_bsm(block, torch.randn(3, 4, generator=g), [0.5, 1.3, 2.0], J=canonical_J(4), matrices=True)
    assert r["min"].min() >= 1 - 1e-8
    assert r["symplecticity_defect"].max() < 1e-6
    assert singular_value_pairing(r["Phi"]).max() < 1e-6
    with pytest.raises(ValueError, match=r"horizons in \(0, T"):
        continuous_bsm(block, torch.zeros(1, 4), [0.0])


def test_pairing_detects_a_non_symplectic_matrix(f64):
    assert singular_value_pairing(torch.diag(torch.tensor([2.0, 1.0, 1.0, 1.0])))[()] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="even size"):
        singular_value_pairing(torch.eye(3))


def test_continuous_bsm_preserves_a_non_canonical_J(f64):
    """The flow of y' = J ∇H preserves any skew J as Φ J Φᵀ = J; with a learned (non-canonical) J the old test
    ΦᵀJΦ = J reported defects of 27-132 for this exactly Poisson flow."""
    g = torch.Generator().manual_seed(2)
    field = Hamiltonian(4, layers=2, T=1.0, J="learned", init_std=1.0, generator=g)
    with torch.no_grad():
        for p in field.parameters():
            p.normal_(0, 1.0, generator=g)
    J = field.J
    assert (J @ J + torch.eye(4)).abs().max() > 0.1  # genuinely non-canonical
    block = ODEBlock(field, rtol=1e-11, atol=1e-12)
    r = continuous_bsm(block, torch.randn(3, 4, generator=g), [0.5, 1.0], J=J.detach(), matrices=True)
    assert r["symplecticity_defect"].max() < 1e-7
    Phi = r["Phi"]
    assert (Phi.transpose(-1, -2) @ J @ Phi - J).abs().max() > 1e-2  # the other form does not hold here
