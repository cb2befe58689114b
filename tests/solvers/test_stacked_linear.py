"""An ensemble's ``nn.Linear`` layers as one stacked product (solvers.steppers.stacked_linear): under ``torch.vmap``
over stacked parameters, each layer whose weight is batched computes ``x_i W_iᵀ + b_i`` for every member in one
``baddbmm``, while the field's own ``forward`` and the layer's hooks run at every evaluation as before. The values
and gradients are the loop of single solves' (float64, rtol 1e-9, to 1e-12 relative), for any state shape, with or
without a bias, a shared bias, inside ``nn.Sequential``; the layers are given back as they were, also when the
field raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, stack_module_state, vmap
from vmap_cases import MLP, close

from cde_nets import ODEBlock, odeint

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)
T = torch.tensor([0.0, 0.5], dtype=D)


class Seq(nn.Module):
    """A member field through ``nn.Sequential``, its last layer without a bias."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 2, bias=False))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)


def _ensemble(cls, n: int = 3):
    torch.manual_seed(0)
    members = [cls().double() for _ in range(n)]
    return members, stack_module_state(members)[0], cls().double().to("meta")


def _in_block(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"field.{k}": v for k, v in params.items()}


def _count_products(monkeypatch) -> list[int]:
    calls = [0]
    real = torch.baddbmm, torch.bmm

    def counted(real_fn):
        def fn(*args, **kwargs):
            calls[0] += 1
            return real_fn(*args, **kwargs)

        return fn

    import cde_nets.solvers.steppers.stacked_linear as stacked

    monkeypatch.setattr(stacked.torch, "baddbmm", counted(real[0]))
    monkeypatch.setattr(stacked.torch, "bmm", counted(real[1]))
    return calls


@pytest.mark.parametrize("cls", [MLP, Seq])
@pytest.mark.parametrize("shape", [(2,), (4, 2), (2, 3, 2)])
def test_the_stacked_products_give_the_loops_values_and_gradients(cls, shape, monkeypatch):
    members, params, base = _ensemble(cls)
    y0 = torch.randn(len(members), *shape, dtype=D, generator=torch.Generator().manual_seed(1))
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    calls = _count_products(monkeypatch)
    block = ODEBlock(base, T=0.5, **TOL)
    got = vmap(lambda p, y: functional_call(block, _in_block(p), (y,)))(leaves, y0)
    assert calls[0] > 0  # the stacked products ran
    want = torch.stack([odeint(m, y, T, **TOL)[-1] for m, y in zip(members, y0)])
    close(got, want, 1e-12)
    grads = torch.autograd.grad(got.square().sum(), list(leaves.values()))
    for k, m in enumerate(members):
        out = odeint(m, y0[k], T, **TOL)[-1]
        named = dict(m.named_parameters())
        wants = torch.autograd.grad(out.square().sum(), [named[n] for n in leaves])
        for g, w in zip(grads, wants):
            close(g[k], w, 1e-10)
    assert all("forward" not in layer.__dict__ for layer in base.modules())


def test_a_shared_bias_and_a_state_shared_by_the_members(monkeypatch):
    members, params, _ = _ensemble(MLP)
    for m in members:  # one bias for the ensemble: only the weights are stacked
        m.l1.bias.data.copy_(members[0].l1.bias.data)
    base = MLP().double()
    base.l1.bias.data.copy_(members[0].l1.bias.data)
    weights = {k: v for k, v in params.items() if k != "l1.bias"}
    y0 = torch.tensor([[0.5, -1.0], [0.2, 0.3]], dtype=D)
    calls = _count_products(monkeypatch)
    got = vmap(lambda p: odeint(lambda t, x: functional_call(base, p, (t, x)), y0, T, **TOL))(weights)
    assert calls[0] == 0  # the field called per evaluation swaps its parameters in: vmap's rule serves it
    close(got, torch.stack([odeint(m, y0, T, **TOL) for m in members]), 1e-12)
    block = ODEBlock(base, T=0.5, **TOL)
    got = vmap(lambda p: functional_call(block, _in_block(p), (y0,), strict=False))(weights)
    assert calls[0] > 0
    close(got, torch.stack([odeint(m, y0, T, **TOL)[-1] for m in members]), 1e-12)


def test_hooks_run_at_every_evaluation_on_each_members_view(monkeypatch):
    members, params, base = _ensemble(MLP)
    seen: list[torch.Size] = []
    base.l1.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    y0 = torch.randn(3, 4, 2, dtype=D, generator=torch.Generator().manual_seed(2))
    block = ODEBlock(base, T=0.5, **TOL)
    calls = _count_products(monkeypatch)
    got = vmap(lambda p, y: functional_call(block, _in_block(p), (y,)))(params, y0)
    stacked_seen, stacked_calls = list(seen), calls[0]
    import cde_nets.solvers.steppers.stacked_linear as stacked

    seen.clear()
    monkeypatch.setattr(stacked, "_members", lambda level, func: [])  # vmap's batching rule for every layer
    close(vmap(lambda p, y: functional_call(block, _in_block(p), (y,)))(params, y0), got, 1e-13)
    assert stacked_calls > 0 and calls[0] == stacked_calls
    assert stacked_seen == seen and seen[0] == (4, 8)  # once per evaluation, each member's own shape


def test_a_failing_field_gives_the_layers_back(monkeypatch):
    class Mine(Exception):
        pass

    class Failing(MLP):
        def forward(self, t, y):
            if float(torch._C._functorch.get_unwrapped(t).detach().max()) > 0.2:
                raise Mine("the user's own")
            return super().forward(t, y)

    members, params, base = _ensemble(Failing)
    block = ODEBlock(base, T=0.5, **TOL)
    with pytest.raises(Mine, match="the user's own"):
        vmap(lambda p: functional_call(block, _in_block(p), (torch.ones(2, dtype=D),)))(params)
    assert all("forward" not in layer.__dict__ for layer in base.modules())
    assert torch._C._functorch.peek_interpreter_stack() is None


class StopGradient(nn.Module):
    """Calls ``l1`` first under ``no_grad`` (a stop-gradient statistic), then with grad, by keyword."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(2, 5), nn.Linear(5, 2)

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            s = torch.tanh(self.l1(y)).mean()
        return self.l2(torch.tanh(self.l1(input=y))) * (1 + 0.1 * s)


class Divergence(nn.Module):
    """A field with its own ``torch.func`` transforms over the ensemble's layers (an exact divergence)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(2, 5), nn.Linear(5, 2)

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def f(x):
            return self.l2(torch.tanh(self.l1(x)))

        div = vmap(jacrev(f))(y).diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)
        return f(y) - 0.1 * div * y


@pytest.mark.parametrize("cls", [StopGradient, Divergence])
def test_a_layer_called_under_no_grad_by_keyword_or_inside_the_fields_own_transforms(cls):
    """The stacked weight is not reused across grad modes (a first call under ``no_grad`` once left ``l1``'s
    gradient at zero), ``layer(input=...)`` is nn.Linear's own signature, and a transform inside the field (its
    level above the solve's) keeps ``vmap``'s rule (torch's internal asserts before)."""
    members, params, base = _ensemble(cls)
    y0 = torch.randn(3, 4, 2, dtype=D, generator=torch.Generator().manual_seed(3))
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    block = ODEBlock(base, T=0.5, **TOL)
    got = vmap(lambda p, y: functional_call(block, _in_block(p), (y,)))(leaves, y0)
    close(got, torch.stack([odeint(m, y, T, **TOL)[-1] for m, y in zip(members, y0)]), 1e-12)
    grads = torch.autograd.grad(got.square().sum(), [leaves["l1.weight"], leaves["l2.bias"]])
    for k, m in enumerate(members):
        wants = torch.autograd.grad(odeint(m, y0[k], T, **TOL)[-1].square().sum(), [m.l1.weight, m.l2.bias])
        close(grads[0][k], wants[0], 1e-10)
        close(grads[1][k], wants[1], 1e-10)


def test_an_autocast_region_around_a_vmapped_solve_is_refused_by_name():
    """torch does not autocast a vmapped nn.Linear: the field would silently run partly in float32."""
    members, params, base = _ensemble(MLP)
    f32 = {k: v.float() for k, v in params.items()}
    block = ODEBlock(MLP(), T=0.5)
    y0 = torch.randn(3, 4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="torch.autocast region"):
        vmap(lambda p, y: functional_call(block, _in_block(p), (y,)))(f32, y0)
    m = MLP()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="torch.autocast region"):
        vmap(lambda y: odeint(m, y, T.float(), method="rk4", options=dict(step_size=0.1)))(y0)


def test_autocast_inside_the_field_keeps_vmaps_rule(monkeypatch):
    class Cast(MLP):
        def forward(self, t, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return super().forward(t, y).float()

    members, params, base = _ensemble(Cast)
    f32 = {k: v.float() for k, v in params.items()}
    block = ODEBlock(Cast(), T=0.5)
    y0 = torch.randn(3, 4, 2)
    got = vmap(lambda p, y: functional_call(block, _in_block(p), (y,)))(f32, y0)
    import cde_nets.solvers.steppers.stacked_linear as stacked

    monkeypatch.setattr(stacked, "_members", lambda level, func: [])
    assert torch.equal(got, vmap(lambda p, y: functional_call(block, _in_block(p), (y,)))(f32, y0))


class StiffVdP(nn.Module):
    """Van der Pol (``μ`` in the state's third component) plus a small linear term of the member's own."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, v, mu = y[..., 0], y[..., 1], y[..., 2]
        vdp = torch.stack((v, mu * (1 - x * x) * v - x, torch.zeros_like(mu)), -1)
        return vdp + 0.05 * self.lin(y)


def test_the_stiff_sample_through_the_stacked_products_is_the_derivative_of_each_members_solve(monkeypatch):
    """Van der Pol at μ = 20.88 beside a mild member (over [0, 3], dopri5 at rtol 1e-5): each member's gradient
    in its own bias, through the stacked products and the stacked loop's differentiated steps, is the central
    difference of that member's single solve to 1e-6 (measured 3e-10 and 8e-9)."""
    members, params, base = _ensemble(StiffVdP, n=2)
    y0 = torch.tensor([[[2.0, 0.0, 20.88]], [[1.0, 0.5, 2.0]]], dtype=D)
    tol = dict(rtol=1e-5, atol=1e-7)
    block = ODEBlock(base, T=3.0, **tol)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    calls = _count_products(monkeypatch)
    ends = vmap(lambda p, y: functional_call(block, _in_block(p), (y,)))(leaves, y0)
    assert calls[0] > 0
    (g,) = torch.autograd.grad(ends[..., :2].square().sum(), leaves["lin.bias"])
    for k, m in enumerate(members):
        single = ODEBlock(m, T=3.0, **tol)
        with torch.no_grad():
            m.lin.bias[0] += 1e-4
            up = single(y0[k])[..., :2].square().sum()
            m.lin.bias[0] -= 2e-4
            down = single(y0[k])[..., :2].square().sum()
            m.lin.bias[0] += 1e-4
        fd = float((up - down) / 2e-4)  # the mild member's gradient is 3e-3: a step of 1e-6 meets the solve's noise
        assert abs(float(g[k, 0]) - fd) < 1e-6 * abs(fd)
