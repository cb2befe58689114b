"""``torch.vmap`` through adaptive solves (solvers.steppers.vmappable): every vmapped instance is solved on its own
steps, as if alone, so the vmapped solve equals the loop of single solves (float64, rtol 1e-9, to 1e-7 relative),
nested and composed with ``jacrev``/``grad``, over ``y0``, over per-instance end times and inputs, and over
stacked parameters (ensembles by ``functional_call``), in both doors; a linear field's solution and Jacobian are
``expm``'s. What vmap cannot serve is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap
from vmap_cases import MLP, close

from cde_nets import ODEBlock, Stop, odeint, odeint_dense
from cde_nets.fields.nais import NAIS
from cde_nets.solvers.errors import SolverError
from cde_nets.solvers.gradients import Checkpoint
from cde_nets.solvers.steppers.tableaux import TABLEAUX
from cde_nets.solvers.steppers.vmappable import odeint_vmappable, vmap_methods

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)
T3 = torch.tensor([0.0, 0.3, 1.0], dtype=D)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


A = torch.randn(3, 3, dtype=D, generator=_gen(1))
Y = torch.randn(4, 3, dtype=D, generator=_gen(2))


def field(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(y @ A.T) + 0.1 * torch.sin(t)


def test_the_loop_serves_every_adaptive_explicit_tableau():
    assert set(vmap_methods()) == {"dopri8", "dopri5", "tsit5", "bosh3", "fehlberg2", "adaptive_heun"}


@pytest.mark.parametrize("method", ["dopri8", "dopri5", "tsit5", "bosh3", "fehlberg2", "adaptive_heun"])
def test_vmap_over_y0_equals_the_loop(method):
    # the second-order pairs take ~10^5 steps at rtol 1e-9: checked at 1e-5, still far below the 1e-7 comparison's
    # sensitivity to a different step sequence
    tol = TOL if TABLEAUX[method].order > 2 else dict(rtol=1e-5, atol=1e-7)
    got = vmap(lambda y: odeint(field, y, T3, method=method, **tol))(Y)
    close(got, torch.stack([odeint(field, y, T3, method=method, **tol) for y in Y]))


def test_nested_vmap_and_decreasing_times_and_tuple_states():
    loop = torch.stack([odeint(field, y, T3, **TOL) for y in Y])
    close(vmap(vmap(lambda y: odeint(field, y, T3, **TOL)))(Y.reshape(2, 2, 3)), loop.reshape(2, 2, 3, 3))
    back = T3.flip(0)
    close(vmap(lambda y: odeint(field, y, back, **TOL))(Y), torch.stack([odeint(field, y, back, **TOL) for y in Y]))

    def pair(t, s):
        return s[1], -torch.sin(s[0])

    got = vmap(lambda a, b: odeint(pair, (a, b), T3, **TOL)[0])(Y, Y.flip(0))
    close(got, torch.stack([odeint(pair, (a, b), T3, **TOL)[0] for a, b in zip(Y, Y.flip(0))]))


def test_vmap_composed_with_jacrev_and_grad():
    def end(y):
        return odeint(field, y, T3, **TOL)[-1]

    loop = torch.stack([torch.autograd.functional.jacobian(end, y) for y in Y])  # autograd through single solves
    close(vmap(jacrev(end))(Y), loop)
    close(jacrev(vmap(end))(Y).diagonal(dim1=0, dim2=2).permute(2, 0, 1), loop)
    close(vmap(grad(lambda y: end(y).sum()))(Y), loop.sum(1))


def test_a_linear_field_gives_expm_and_its_jacobian():
    L = torch.randn(3, 3, dtype=D, generator=_gen(3))

    def end(y):
        return odeint(lambda t, x: L @ x, y, T3, rtol=1e-11, atol=1e-12)[-1]

    E = torch.linalg.matrix_exp(L)
    close(vmap(end)(Y), Y @ E.T)
    close(vmap(jacrev(end))(Y), E.expand(4, 3, 3))


def test_vmap_over_per_instance_end_times():
    times = torch.tensor([[0.0, 0.5], [0.0, 1.0], [0.0, 2.0], [0.0, 0.1]], dtype=D)
    got = vmap(lambda y, t: odeint(field, y, t, **TOL))(Y, times)
    close(got, torch.stack([odeint(field, y, t, **TOL) for y, t in zip(Y, times)]))


def test_the_stacked_loop_is_the_vmapped_loop_to_rounding(monkeypatch):
    import cde_nets.solvers.steppers.vmappable as vmappable

    def solve_and_grad():
        y = Y.clone().requires_grad_(True)
        ys = vmap(lambda y0: odeint(field, y0, T3, **TOL))(y)
        return ys, torch.autograd.grad(ys.square().sum(), y)[0]

    stacked = solve_and_grad()
    monkeypatch.setattr(vmappable, "_stackable", lambda *args: False)  # the loop under vmap's batching rules
    under_vmap = solve_and_grad()
    assert torch.equal(stacked[0], under_vmap[0])  # the same operations on the same numbers
    close(stacked[1], under_vmap[1], rel=1e-13)  # autograd sums the broadcast step sizes' terms in its own order


def test_the_norms_square_root_keeps_a_nan_and_has_derivative_zero_at_zero():
    from cde_nets.solvers.norms import StateNorm, safe_sqrt

    x = torch.tensor([0.0, 4.0, float("nan")], dtype=D, requires_grad=True)
    y = safe_sqrt(x)
    assert y[:2].tolist() == [0.0, 2.0] and y[2].isnan()  # a non-finite state must still read as one
    assert torch.autograd.grad(y[:2].sum(), x)[0][:2].tolist() == [0.0, 0.25]
    assert StateNorm()(torch.tensor([1.0, float("nan")], dtype=D)).isnan()


@pytest.mark.parametrize("gradient", ["backprop", "checkpoint", "symplectic"])
def test_a_zero_state_or_a_zero_error_estimate_keeps_the_gradient_finite(gradient):
    # an RMS of 0 (a zero initial state; a field dopri5 integrates exactly: y' = c) has an infinite derivative
    def end(f):
        return lambda y: odeint(f, y, T3, gradient=gradient, adjoint_params=(), rtol=1e-6, atol=1e-8)[-1].sum()

    c = torch.tensor([1.0, -2.0, 0.5], dtype=D)
    close(vmap(grad(end(lambda t, y: c)))(Y), torch.ones_like(Y), 1e-12)
    zeros = torch.zeros_like(Y)
    y = zeros[0].clone().requires_grad_(True)
    want = torch.autograd.grad(end(field)(y), y)[0]
    close(vmap(grad(end(field)))(zeros), want.expand_as(Y), 1e-12)


def test_instances_sharing_the_state_or_the_field_are_broadcast():
    times = torch.tensor([[0.0, 0.5], [0.0, 1.0], [0.0, 2.0]], dtype=D)
    y0 = Y[0]
    got = vmap(lambda t: odeint(field, y0, t, **TOL))(times)  # neither y0 nor the field's output is batched
    close(got, torch.stack([odeint(field, y0, t, **TOL) for t in times]))
    scales = torch.tensor([0.5, 1.0, -2.0], dtype=D)
    got = vmap(lambda c: odeint(lambda t, y: c * field(t, y), y0, T3, **TOL))(scales)  # y0 shared
    close(got, torch.stack([odeint(lambda t, y, c=c: c * field(t, y), y0, T3, **TOL) for c in scales]))


def test_a_failing_solve_under_vmap_leaves_torch_func_as_it_found_it():
    class Mine(Exception):
        pass

    mine = Mine("the user's own")

    def failing(t, y):
        if float(torch._C._functorch.get_unwrapped(t).max()) > 0.5:
            raise mine
        return field(t, y)

    with pytest.raises(Mine) as caught:
        vmap(lambda y: odeint(failing, y, T3, **TOL))(Y)
    assert caught.value is mine
    with pytest.raises(SolverError, match="max_num_steps=3 reached by an instance under torch.vmap"):
        vmap(lambda y: odeint(field, y, T3, options=dict(max_num_steps=3), **TOL))(Y)
    assert torch._C._functorch.peek_interpreter_stack() is None
    close(vmap(lambda y: odeint(field, y, T3, **TOL))(Y), torch.stack([odeint(field, y, T3, **TOL) for y in Y]))


def test_an_ensemble_by_functional_call_equals_the_loop_in_values_and_gradients():
    torch.manual_seed(0)
    members = [MLP().double() for _ in range(3)]
    params, _ = stack_module_state(members)
    base = MLP().double().to("meta")
    y0 = torch.tensor([0.5, -1.0], dtype=D)

    def solve(p, y):
        return odeint(lambda t, x: functional_call(base, p, (t, x)), y, T3, **TOL)[-1]

    close(vmap(solve, in_dims=(0, None))(params, y0), torch.stack([odeint(m, y0, T3, **TOL)[-1] for m in members]))
    got = vmap(grad(lambda p, y: solve(p, y).sum()), in_dims=(0, None))(params, y0)
    for k, m in enumerate(members):
        want = torch.autograd.grad(odeint(m, y0, T3, **TOL)[-1].sum(), (m.l1.weight, m.l2.bias))
        close(got["l1.weight"][k], want[0])
        close(got["l2.bias"][k], want[1])


def test_odeblock_under_vmap_over_inputs_and_stacked_parameters():
    nais = NAIS(3, 2, generator=_gen(4)).double()
    block = ODEBlock(nais, T=1.0, **TOL)
    x0 = torch.randn(2, 3, dtype=D, generator=_gen(5))
    U = torch.randn(3, 2, 2, dtype=D, generator=_gen(6))
    close(vmap(lambda u: block(x0, u=u))(U), torch.stack([block(x0, u=u) for u in U]))
    close(
        vmap(jacrev(lambda x: block(x, u=U[0, :1])))(x0[:, None]),
        torch.stack([torch.autograd.functional.jacobian(lambda z: block(z, u=U[0, :1]), x) for x in x0[:, None]]),
    )
    torch.manual_seed(1)
    blocks = [ODEBlock(MLP().double(), T=1.0, **TOL) for _ in range(3)]
    params, _ = stack_module_state(blocks)
    base = ODEBlock(MLP().double(), T=1.0, **TOL)
    X = torch.randn(2, 2, dtype=D, generator=_gen(7))
    got = vmap(lambda p: functional_call(base, p, (X,)))(params)
    close(got, torch.stack([b(X) for b in blocks]))


@pytest.mark.parametrize("method", ["euler", "rk4"])
def test_fixed_step_methods_keep_working(method):
    opts = dict(step_size=0.1)
    got = vmap(lambda y: odeint(field, y, T3, method=method, options=opts))(Y)
    close(got, torch.stack([odeint(field, y, T3, method=method, options=opts) for y in Y]), 1e-12)


def test_rows_of_one_batch_on_their_own_clocks_equal_the_loop():
    """The hand-stacked form (``rows=1``: per-row clocks, ``t`` of shape ``(batch,)``) is the same solve."""

    def rows(t, y):  # t: (batch,), one time per row
        return torch.tanh(y @ A.T) + 0.1 * torch.sin(t)[:, None]

    got = odeint_vmappable(rows, Y, T3, method="dopri5", rows=1, **TOL)
    close(got, torch.stack([odeint(field, y, T3, **TOL) for y in Y], 1))


def test_a_forward_only_solve_serves_every_gradient_method():
    with torch.no_grad():
        got = vmap(lambda y: odeint(field, y, T3, gradient="adjoint", adjoint_params=(), **TOL))(Y)
    close(got, torch.stack([odeint(field, y, T3, **TOL) for y in Y]))


def test_the_adjoint_under_vmap_equals_backprop_to_its_tolerance():
    """Each instance's adjoint solved backwards on its own steps (an autograd.Function vmapped by torch): the
    gradient of vmap∘grad, grad∘vmap (every output time) and vmap∘jacrev equals backprop's to ~1e-7 relative."""

    def ends(y, gradient):
        return odeint(field, y, T3, gradient=gradient, adjoint_params=(), **TOL)

    for make in (
        lambda g: vmap(grad(lambda y: ends(y, g)[-1].sum()))(Y),
        lambda g: grad(lambda x: vmap(lambda y: ends(y, g))(x).pow(2).sum())(Y),
        lambda g: vmap(jacrev(lambda y: ends(y, g)[-1]))(Y[:2]),
    ):
        close(make("adjoint"), make("backprop"), 1e-6)


def test_the_adjoint_under_vmap_differentiates_stacked_parameters_in_both_doors():
    """Parameters the field closes over (a dict of stacked parameters, a block's own under functional_call) are
    swapped for the adjoint's inputs: their gradients are the adjoint's, equal to backprop's to its tolerance."""
    torch.manual_seed(0)
    params, _ = stack_module_state([MLP().double() for _ in range(2)])
    base = MLP().double().to("meta")
    y0 = torch.tensor([0.5, -1.0], dtype=D)

    def loss(p, gradient, named=True):
        func = lambda t, x: functional_call(base, p, (t, x))  # noqa: E731
        given = tuple(p.values()) if named else ()
        return odeint(func, y0, T3, gradient=gradient, adjoint_params=given, **TOL)[-1].sum()

    want = vmap(grad(loss), in_dims=(0, None))(params, "backprop")
    for named in (True, False):  # closed over but not in adjoint_params: tracked, so taken as inputs too
        got = vmap(grad(loss), in_dims=(0, None, None))(params, "adjoint", named)
        for k in want:
            close(got[k], want[k], 1e-6)
    blocks = [ODEBlock(MLP().double(), T=1.0, gradient="adjoint", **TOL) for _ in range(2)]
    stacked, _ = stack_module_state(blocks)
    X = torch.randn(2, 2, dtype=D, generator=_gen(7))

    def block_loss(p, block):
        return functional_call(block, p, (X,)).sum()

    backprop = ODEBlock(MLP().double(), T=1.0, gradient="backprop", **TOL)
    got, want = (vmap(grad(block_loss), in_dims=(0, None))(stacked, b) for b in (blocks[0], backprop))
    for k in want:
        close(got[k], want[k], 1e-6)


def test_the_adjoint_under_vmap_refuses_what_it_cannot_differentiate():
    W = torch.randn(4, 3, 3, dtype=D, generator=_gen(8))

    def hidden(w, y):  # a tuple's entry cannot be swapped for the adjoint's input
        held = (w,)
        return odeint(lambda t, x: torch.tanh(held[0] @ x), y, T3, gradient="adjoint", adjoint_params=(), **TOL)

    with pytest.raises(ValueError, match="gradient='adjoint' under torch.func: the field reaches a tensor"):
        vmap(grad(lambda w, y: hidden(w, y)[-1].sum(), argnums=(0, 1)))(W, Y)

    def unused(w, y):
        return odeint(field, y, T3, gradient="adjoint", adjoint_params=(w,), **TOL)

    with pytest.raises(ValueError, match="a tensor of `adjoint_params` is not one the field reaches"):
        vmap(grad(lambda w, y: unused(w, y)[-1].sum()))(W, Y)


def test_the_checkpointed_replay_under_vmap_is_backprop_to_rounding():
    """Each instance's attempts replayed one at a time (an autograd.Function vmapped by torch): the same operations
    as backprop through the loop, so the same gradient to rounding, over y0, every output time, stacked
    parameters and per-instance end times."""

    def ends(y, gradient, t=T3):
        return odeint(field, y, t, gradient=gradient, adjoint_params=(), **TOL)

    times = torch.tensor([[0.0, 0.5], [0.0, 1.0], [0.0, 2.0], [0.0, 0.1]], dtype=D)
    torch.manual_seed(0)
    params, _ = stack_module_state([MLP().double() for _ in range(2)])
    base = MLP().double().to("meta")

    def loss(p, gradient):
        func = lambda t, x: functional_call(base, p, (t, x))  # noqa: E731
        return odeint(func, Y[0, :2], T3, gradient=gradient, adjoint_params=tuple(p.values()), **TOL)[-1].sum()

    for make in (
        lambda g: vmap(grad(lambda y: ends(y, g)[-1].sum()))(Y),
        lambda g: grad(lambda x: vmap(lambda y: ends(y, g))(x).pow(2).sum())(Y),
        lambda g: vmap(grad(lambda y, t: ends(y, g, t)[-1].sum()))(Y, times),
        lambda g: vmap(grad(loss), in_dims=(0, None))(params, g)["l1.weight"],
    ):
        close(make("checkpoint"), make("backprop"), 1e-13)
    with pytest.raises(ValueError, match="Checkpoint\\(budget=3\\) under torch.func.*drop `budget`"):
        vmap(grad(lambda y: ends(y, Checkpoint(budget=3))[-1].sum()))(Y)


def test_a_gradient_method_without_a_vmapped_backward_pass_is_refused_under_vmap(monkeypatch):
    from toy_gradient import Segmented  # a user's own gradient method, on torchdiffeq's host-side steps

    from cde_nets.solvers.gradients import GRADIENTS

    monkeypatch.setitem(GRADIENTS, "segmented", Segmented)

    def loss(y):
        return odeint(field, y, T3, gradient=Segmented(), adjoint_params=(), **TOL)[-1].sum()

    with pytest.raises(ValueError, match="gradient='segmented' under torch.vmap.*gradient='backprop'"):
        vmap(grad(loss))(Y)
    with pytest.raises(ValueError, match="gradient='segmented' under torch.vmap.*gradient='backprop'"):
        grad(lambda y: vmap(loss)(y).sum())(Y)


def test_what_vmap_cannot_serve_is_refused_by_name():
    with pytest.raises(ValueError, match="method='alf' under torch.vmap"):
        vmap(lambda y: odeint(field, y, T3, method="alf"))(Y)
    with pytest.raises(ValueError, match="controller='per_sample' under torch.vmap"):
        vmap(lambda y: odeint(field, y[None], T3, controller="per_sample"))(Y)
    block = ODEBlock(MLP().double(), T=1.0, controller="per_sample")
    with pytest.raises(ValueError, match="controller='per_sample' under torch.vmap"):
        vmap(block)(Y[:, None, :2])
    with pytest.raises(ValueError, match=r"\['step_t'\] are not served under torch.vmap"):
        vmap(lambda y: odeint(field, y, T3, options=dict(step_t=[0.5])))(Y)


def test_events_and_dense_output_are_refused_under_vmap_in_both_doors():
    block, stopping = ODEBlock(MLP().double(), T=1.0), ODEBlock(MLP().double(), T=1.0, stop=Stop(1e-3))
    calls = (
        lambda y: odeint(field, y, T3, event_fn=lambda t, x: x[0]),
        lambda y: odeint(field, y[None], T3, event_fn=lambda t, x: x[:, 0], event_mode="per_sample"),
        lambda y: odeint_dense(field, y[None], T3),
        lambda y: block.solve(y[None, :2], event=lambda t, x: x[:, 0]).y,
        lambda y: stopping(y[None, :2]),
    )
    for call in calls:
        with pytest.raises(ValueError, match=r"events \(`event_fn`, `event`, `stop`\) and dense output under"):
            vmap(call)(Y)


def test_failures_under_vmap_say_what_failed():
    with pytest.raises(SolverError, match="max_num_steps=3 reached by an instance under torch.vmap"):
        vmap(lambda y: odeint(field, y, T3, options=dict(max_num_steps=3), **TOL))(Y)
    with pytest.raises(SolverError, match="underflow"):
        vmap(lambda y: odeint(lambda t, x: x / (x - x), y, T3))(Y)
    bad = Y.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite value"):
        vmap(lambda y: odeint(field, y, T3))(bad)


def test_a_regularised_block_under_vmap_is_refused_by_name():
    """A block's regularisers differentiate the field inside the solve by torch.autograd, which torch.func
    refuses with an error of its own: the block says what to do instead."""
    from cde_nets.blocks.regularisers import Regularisation

    class Field(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 2)).double()

        def forward(self, t, y):
            return self.f(y)

    block = ODEBlock(Field(), 1.0, regularisation=Regularisation(("kinetic",)))
    with pytest.raises(ValueError, match="regularisation.*torch.vmap"):
        vmap(block)(torch.randn(3, 4, 2, dtype=torch.float64))


def test_an_sde_block_and_a_continuous_flow_under_vmap_are_refused_by_name():
    """torchsde reads its Brownian path and steps on the host and a flow's trace estimator calls torch.autograd
    inside the solve, both refused by torch.func with errors of its own: each block says to pass one batch."""
    from cde_nets import ContinuousFlow, SDEBlock
    from cde_nets.fields import Hamiltonian

    Y = torch.randn(3, 4, 4)
    with pytest.raises(ValueError, match="SDEBlock under torch.vmap"):
        vmap(SDEBlock(Hamiltonian(4, layers=3), "diagonal", T=1.0), randomness="different")(Y)
    with pytest.raises(ValueError, match="ContinuousFlow under torch.vmap"):
        vmap(ContinuousFlow(Hamiltonian(4, layers=3), T=1.0))(Y)
