"""A block keeps nothing between calls: its modules' attributes, parameters and buffers are the same objects after
a call (and its backward) as before, so a copy or a pickle taken after a call needs no special case, and what the
call produced — statistics, integrated regularisers — travels with its result instead."""

import copy
import pickle

import pytest
import torch
from torch import nn

from cde_nets import ContinuousFlow, ODEBlock, Regularisation, SDEBlock, discretize, integrated_terms
from cde_nets.fields import Hamiltonian


class Tanh(nn.Module):
    def __init__(self, d=3):
        super().__init__()
        self.lin = nn.Linear(d, d).double()

    def forward(self, t, y):
        return torch.tanh(self.lin(y))


def _snapshot(module: nn.Module) -> dict:
    """Every submodule's attributes and the entries of its dicts (``_parameters``, ``_buffers``, ``_modules``),
    held by reference, so no id is reused and identity can be compared."""
    return {
        (name, key): dict(value) if isinstance(value, dict) else value
        for name, m in module.named_modules()
        for key, value in vars(m).items()
    }


def _assert_unchanged(before: dict, module: nn.Module, stream: set) -> None:
    after = _snapshot(module)
    assert after.keys() == before.keys(), set(after) ^ set(before)
    for key, value in before.items():
        if key in stream:
            continue
        if isinstance(value, dict):
            assert after[key].keys() == value.keys() and all(after[key][k] is v for k, v in value.items()), key
        else:
            assert after[key] is value, key


def _cases():
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    regs = ("kinetic", "jacobian")
    field = Hamiltonian(4, layers=2, generator=torch.Generator().manual_seed(1)).double()
    h0 = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return [
        ("ode adjoint, regularised", ODEBlock(Tanh(), 1.0, gradient="adjoint", regularisation=Regularisation(regs)), x),
        ("ode checkpoint, taylor2", ODEBlock(Tanh(), 1.0, regularisation=Regularisation(("taylor2",), steer=0.2)), x),
        ("ode per-sample", ODEBlock(field, controller="per_sample", rtol=1e-6, atol=1e-6), h0),
        ("discrete rk4, regularised", discretize(Tanh(), "rk4", T=1.0, steps=4, regularisers=regs), x),
        ("sde", SDEBlock(field, noise="additive", sigma=0.1, method="euler", step_size=0.1, seed=0), h0),
        ("sde, no noise", SDEBlock(field, noise=None, method="midpoint", step_size=0.1), h0),
        ("flow, hutchinson", ContinuousFlow(Tanh(), trace="hutchinson", regularisers=regs, rtol=1e-4), x),
    ]


@pytest.mark.parametrize("case", range(7), ids=[c[0] for c in _cases()])
def test_a_call_and_its_backward_leave_the_block_as_it_was(case):
    """Only an SDEBlock moves something, by design: the position in its seeded sequence of Brownian paths (call
    ``k`` draws path ``k``, as a generator's state advances; ``reseed()`` restarts it)."""
    _, block, x = _cases()[case]
    stream = {("", "_calls")} if isinstance(block, SDEBlock) else set()
    before = _snapshot(block)
    with integrated_terms() as terms:
        out = block(x)
    loss = out.square().sum() + sum(terms.values())
    loss.backward()
    _assert_unchanged(before, block, stream)
    assert terms.nfe_forward > 0 and len(terms.solutions) == 1
    # a copy and a pickle after the call need no special case (deepcopy refuses tensors that carry a graph)
    for clone in (copy.deepcopy(block), pickle.loads(pickle.dumps(block))):
        torch.manual_seed(0)
        a = clone.eval()(x)
        torch.manual_seed(0)
        torch.testing.assert_close(a, block.eval()(x), rtol=0, atol=0)
        block.train()


def test_the_call_result_carries_its_terms_and_counts():
    block = ODEBlock(Tanh(), 1.0, rtol=1e-6, atol=1e-6, regularisation=Regularisation(("kinetic",)))
    x = torch.randn(5, 3, dtype=torch.float64)
    first, second = block.solve(x), block.solve(2 * x)
    assert first.stats is not second.stats and first.stats.nfe_forward > 0
    assert float(first.regularisation["kinetic"].detach()) != float(second.regularisation["kinetic"].detach())
    first.y.sum().backward()  # the first call's backward fills in the first call's counts alone
    assert first.stats.nfe_backward > 0 and second.stats.nfe_backward == 0
    assert not hasattr(block, "regularisation") and not hasattr(block, "stats")


def _tensors_held(obj, owned: set[int], seen: set[int] | None = None) -> list[str]:
    """Paths to the tensors reachable from ``obj`` through attributes and containers, other than ``owned``
    (the module's parameters and buffers)."""
    seen = set() if seen is None else seen
    found: list[str] = []
    stack: list[tuple[str, object]] = [("", obj)]
    while stack:
        path, o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if id(o) not in owned:
                found.append(path)
            continue
        if isinstance(o, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in o.items()]
        elif isinstance(o, (list, tuple, set)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(o)]
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            stack += [(f"{path}.{k}", v) for k, v in vars(o).items()]
    return found


@pytest.mark.parametrize("memory_free", [False, True], ids=["stored", "memory-free"])
def test_an_implicit_net_keeps_no_stage_chain_between_calls(memory_free):
    """A gl4 net's layers of one pass start each from the last one's stages (a chain the scheme keeps while the
    pass runs); after the call and its backward, and after ``layer_states`` and ``step``, the net holds no tensor
    but its parameters and buffers (the chain and the per-layer counts once stayed on the scheme)."""
    field = Hamiltonian(4, layers=3, generator=torch.Generator().manual_seed(1)).double()
    net = discretize(field, "gl4", memory_free=memory_free)
    owned = {id(p) for p in net.parameters()} | {id(b) for b in net.buffers()}
    y0 = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    sol = net.solve(y0)
    sol.y.square().sum().backward()
    assert sol.stats.nfe_forward > 3 * 2  # Newton iterations counted before the pass ended
    assert not _tensors_held(net, owned)
    net.layer_states(y0.detach())
    net.step(0, (y0.detach(),))
    assert not _tensors_held(net, owned)
