"""Pieces and field constants gathered once per call: same numbers as per-layer indexing, one unbind node per
constant, no views or memo values outliving the call."""

from contextlib import nullcontext

import pytest
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.blocks.gathering import gathered
from cde_nets.fields import NAIS, CubicFriction, Hamiltonian, NAISConv
from cde_nets.fields.pieces import Pieces


def _graph_nodes(t: torch.Tensor) -> dict[str, int]:
    seen, stack, counts = set(), [t.grad_fn], {}
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        counts[type(fn).__name__] = counts.get(type(fn).__name__, 0) + 1
        stack.extend(f for f, _ in fn.next_functions)
    return counts


def _grads_per_layer_indexing(net, y0, u=None):
    """The reference: the same net with gathering switched off (``Pieces[l]`` slices ``data`` every layer)."""
    import cde_nets.blocks.discrete as discrete

    saved = discrete.gathered
    discrete.gathered = lambda m, stacked=True: nullcontext(m)
    try:
        net.zero_grad()
        out = net(y0, u) if u is not None else net(y0)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in net.parameters()]
    finally:
        discrete.gathered = saved


@pytest.mark.parametrize(
    "case",
    ["H1 euler", "H1 masked learned J", "H2 symplectic", "friction rk4", "NAIS", "NAISConv", "momentum memory-free"],
)
def test_gathered_equals_per_layer_indexing(case, f64):
    g = torch.Generator().manual_seed(3)
    u = None
    if case == "H1 euler":
        net = discretize(Hamiltonian(4, layers=12, generator=g), "euler")
    elif case == "H1 masked learned J":
        mask = (torch.rand(12, 6, 4, generator=g) > 0.3).double()
        net = discretize(Hamiltonian(4, layers=12, J="learned", width=6, K_mask=mask, generator=g), "rk4")
    elif case == "NAISConv":
        net = discretize(NAISConv(2, layers=12, generator=g), "euler")
        u = torch.randn(5, 2, 3, 3, generator=g)
    elif case == "H2 symplectic":
        net = discretize(Hamiltonian(4, layers=12, K="blockdiag", J="structured", generator=g), "symplectic_euler")
    elif case == "friction rk4":
        net = discretize(CubicFriction(4, layers=12, zero_init=False, generator=g), "rk4")
    elif case == "NAIS":
        net = discretize(NAIS(4, 3, layers=12, generator=g), "euler")
        u = torch.randn(5, 3, generator=g)
    else:
        net = discretize(
            CubicFriction(4, layers=12, zero_init=False, generator=g), "momentum", momentum=(0.8, 1.0), memory_free=True
        )
    y0 = torch.randn(5, 2, 3, 3, generator=g) if case == "NAISConv" else torch.randn(5, 4, generator=g)
    ref_out, ref_grads = _grads_per_layer_indexing(net, y0, u)
    net.zero_grad()
    out = net(y0, u) if u is not None else net(y0)
    out.square().sum().backward()
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-13)
    for p, ref in zip(net.parameters(), ref_grads):
        assert torch.allclose(p.grad, ref, rtol=1e-12, atol=1e-13)


def test_one_unbind_node_per_constant_and_no_slices():
    net = discretize(Hamiltonian(4, layers=32), "euler")
    nodes = _graph_nodes(net(torch.randn(3, 4)))
    assert nodes.get("UnbindBackward0") == 2  # the constants K, b of all pieces
    assert nodes.get("SelectBackward0", 0) == 0  # a slice per layer would make backward O(L²)


def test_views_and_memo_do_not_outlive_the_call():
    field = NAIS(3, 3, layers=4)
    net = discretize(field, "euler")
    net(torch.randn(2, 3), torch.randn(2, 3))
    assert field._memo is None
    assert all(p._unbound is None for p in field.modules() if isinstance(p, Pieces))
    with gathered(field):
        with gathered(field):  # nested: the inner block reuses the outer views
            field.R[0]
            inner = field.R._unbound
        assert len(inner) == 4 and field.R._unbound is inner and field._memo is not None
    assert field.R._unbound is None


def test_memo_keeps_grad_and_no_grad_values_apart():
    field = NAIS(3, 3, layers=1)
    with gathered(field):
        with torch.no_grad():
            a0 = field.A(0)
        a1 = field.A(0)
    assert a0.grad_fn is None and a1.grad_fn is not None


def test_backprop_ode_block_gradients_unchanged_by_gathering(f64):
    import cde_nets.blocks.ode as ob

    g = torch.Generator().manual_seed(0)
    field = Hamiltonian(4, layers=6, generator=g)
    y0 = torch.randn(3, 4, generator=g)
    block = ODEBlock(field, method="rk4", step_size=1 / 24, gradient="backprop")
    grads = []
    for gather in (True, False):
        saved = ob.gathered
        if not gather:
            ob.gathered = lambda m, stacked=True: nullcontext(m)
        try:
            field.zero_grad()
            block(y0).square().sum().backward()
        finally:
            ob.gathered = saved
        grads.append(field.K.data.grad.clone())
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-14)
    assert grads[0].abs().min() > 0  # every piece got a gradient


def _constant_fields(g):
    mask = (torch.rand(5, 6, 4, generator=g) > 0.3).double()
    return [
        Hamiltonian(4, layers=5, generator=g),
        Hamiltonian(4, layers=5, J="learned", width=6, K_mask=mask, generator=g),
        Hamiltonian(4, layers=5, K="blockdiag", J="structured", generator=g),
        Hamiltonian(4, layers=5, K="blockdiag", J="learned", generator=g),
        CubicFriction(4, layers=5, zero_init=False, generator=g),
        NAIS(4, 3, layers=5, generator=g),
        NAISConv(2, layers=5, generator=g),
    ]


def test_constants_of_all_pieces_equal_piece_by_piece(f64):
    """The table built with one batched operation per tensor equals each piece built on its own (to rounding:
    batched and single matrix products may sum in another order)."""
    g = torch.Generator().manual_seed(5)
    for field in _constant_fields(g):
        with gathered(field):
            table = [field.constants(l) for l in range(5)]
        for l in range(5):
            for a, b in zip(table[l], field.piece_constants(l), strict=True):
                assert torch.allclose(a, b, rtol=1e-14, atol=1e-15), type(field).__name__
        with gathered(field):
            assert all(p._unbound == () for p in field.modules() if isinstance(p, Pieces))  # never unbound


def test_canonical_hamiltonian_values_unchanged_bit_for_bit():
    """With the canonical J (and X = I) the precomputed K Jᵀ, −K_q only permute and negate entries: the field
    equals J ∂H/∂y computed the direct way, bit for bit (float32, where rounding would show)."""
    g = torch.Generator().manual_seed(6)
    y = torch.randn(64, 8, generator=g)
    for K in ("full", "blockdiag"):
        field = Hamiltonian(8, layers=3, K=K, generator=g)
        for l in range(3):
            direct = field.grad_H(l, y) @ field.J.T
            with gathered(field):
                assert torch.equal(field.evaluate(l, y), direct), K


@pytest.mark.parametrize("case", ["H1 masked", "H2", "friction"])
def test_constants_keep_the_formula_bit_for_bit(case):
    """Transposes and masks built once per call leave every product in the formula's order: a discrete net's
    output and gradients equal those of the same net with nothing gathered (each layer slicing its piece and
    rebuilding its weights), bit for bit in float32 — the numbers of the recorded runs stay reproducible. (With
    several evaluations per layer the gradient contributions of one piece are summed in another order.)"""
    g = torch.Generator().manual_seed(7)
    if case == "H1 masked":
        mask = (torch.rand(10, 8, 8, generator=g) > 0.3).float()
        net = discretize(Hamiltonian(8, layers=10, K_mask=mask, generator=g), "euler")
    elif case == "H2":
        net = discretize(Hamiltonian(8, layers=10, K="blockdiag", generator=g), "symplectic_euler")
    else:
        net = discretize(CubicFriction(8, layers=10, zero_init=False, learn_gamma=False, generator=g), "euler")
    y0 = torch.randn(37, 8, generator=g)
    ref_out, ref_grads = _grads_per_layer_indexing(net, y0)
    net.zero_grad()
    out = net(y0)
    out.square().sum().backward()
    assert torch.equal(out, ref_out)
    for p, ref in zip(net.parameters(), ref_grads):
        assert torch.equal(p.grad, ref)


def test_views_first_read_under_no_grad_keep_their_graph():
    """A stopping event checks ‖F‖ under no_grad before any step: the pieces' views made then must still carry
    the graph, or backprop through the steps loses every piece's gradient (SecondOrder reads its MLP's pieces
    as views). Backprop then equals the checkpointed replay, which rebuilds the pieces outside the call."""
    from cde_nets import Stop
    from cde_nets.fields import SecondOrder

    torch.manual_seed(0)
    field = SecondOrder(2, layers=2).double()
    y0 = torch.randn(2, 4, dtype=torch.float64)
    grads = []
    for gradient in ("backprop", "checkpoint"):
        block = ODEBlock(field, method="rk4", step_size=0.25, stop=Stop(eps=0.5), gradient=gradient)
        grads.append(torch.autograd.grad(block(y0).square().sum(), list(field.parameters())))
    for a, b in zip(*grads):
        assert (a - b).norm() <= 1e-10 * b.norm() and b.norm() > 0
