"""A tuple state's default error norm is torchdiffeq's: the largest of the parts' RMS norms (its ``_mixed_norm``),
not the RMS over the concatenated state. Compared live with torchdiffeq: every accepted and rejected step (the
callbacks' times and step sizes), the values, and the gradients, in each engine the functional API runs."""

import pytest
import torch
import torchdiffeq
from torch import nn
from torchdiffeq_reference import torchdiffeq_method

from cde_nets import Backprop, Checkpoint, ContinuousFlow, Symplectic, odeint, odeint_adjoint
from cde_nets.solvers.norms import StateNorm

F64 = torch.float64


def _f(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


class Pair(nn.Module):
    """``a' = −a Σb``, ``b' = (b_1, −b_0)·(1 + a_0²)`` on a tuple ``(a, b)``: parts of different sizes and scales,
    so the two norms pick different steps. Records every step's ``(kind, t0, dt)``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.3, dtype=F64))
        self.steps: list[tuple[str, float, float]] = []

    def forward(self, t, state):
        a, b = state
        rot = torch.stack([b[..., 1], -b[..., 0]], -1) * (1 + a[..., :1] ** 2)
        return -self.w * a * b.sum(-1, keepdim=True), rot

    def _note(self, kind):
        return lambda t0, y0, dt: self.steps.append((kind, _f(t0), _f(dt)))

    def record(self):
        self.callback_accept_step = self._note("accept")
        self.callback_reject_step = self._note("reject")
        return self


def _state(n: int = 1, grad: bool = False):
    """The issue's ``(tensor([1.]), tensor([2., 3.]))``, repeated ``n`` times along a leading axis."""
    a = torch.tensor([1.0], dtype=F64).repeat(n, 1)
    b = torch.tensor([2.0, 3.0], dtype=F64).repeat(n, 1)
    return (a.requires_grad_(grad), b.requires_grad_(grad))


T = torch.tensor([0.0, 0.7, 1.5], dtype=F64)


def _both(method: str, n: int, grad: bool, **kw):
    ours, theirs = Pair().record(), Pair().record()
    ya, yb = _state(n, grad), _state(n, grad)
    # torchdiffeq's backprop (the first step size differentiated, the others fixed), for its gradients' bits
    out = odeint(ours, ya, T, method=method, gradient=Backprop(steps="torchdiffeq"), **kw)
    ref = torchdiffeq.odeint(theirs, yb, T, method=torchdiffeq_method(method), **kw)
    return (ours, ya, out), (theirs, yb, ref)


# n = 1: the issue's state (Buffered engine without a graph, Graph with one); n = 200: 600 elements (StageMajor engine)
@pytest.mark.parametrize("n,grad", [(1, False), (1, True), (200, False)])
def test_dopri5_takes_torchdiffeqs_steps_on_a_tuple_state(n, grad):
    (ours, ya, out), (theirs, yb, ref) = _both("dopri5", n, grad)
    assert ours.steps == theirs.steps
    assert any(kind == "reject" for kind, _, _ in ours.steps)
    for x, y in zip(out, ref):
        assert torch.equal(x, y)  # the fast path's dopri5 is torchdiffeq's bits
    if grad:
        g = torch.autograd.grad(sum(o.sum() for o in out), ya)
        r = torch.autograd.grad(sum(o.sum() for o in ref), yb)
        for x, y in zip(g, r):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_first_step_is_the_issues_number():
    """The issue measured torchdiffeq's first step on ``(tensor([1.]), tensor([2., 3.]))`` at 0.0158682 against
    the concatenated norm's 0.0158621 (its field; here ``Pair``'s): the first accepted step is torchdiffeq's,
    and differs from the one the concatenated norm picks."""
    (ours, _, _), (theirs, _, _) = _both("dopri5", 1, False)
    flat = Pair().record()
    odeint(flat, _state(), T, options={"norm": _concatenated_rms})
    assert ours.steps[0] == theirs.steps[0]
    assert flat.steps[0][2] != ours.steps[0][2]


@pytest.mark.parametrize("method", ["bosh3", "dopri8"])
def test_other_adaptive_methods_take_torchdiffeqs_steps(method):
    """bosh3 and dopri8 on the library's stepper: torchdiffeq's steps on a tuple state (both read their outputs off
    interpolants of their own order, unlike torchdiffeq's: docs/guides/torchdiffeq_differences.md)."""
    (ours, _, out), (theirs, _, ref) = _both(method, 1, False, rtol=1e-6, atol=1e-8)
    assert ours.steps == theirs.steps


@pytest.mark.parametrize("gradient", [Checkpoint, Symplectic])
def test_replayed_gradients_record_torchdiffeqs_steps(gradient):
    """The replays record the forward steps once: torchdiffeq's steps; with ``steps="torchdiffeq"`` their
    gradient is torchdiffeq's backprop through them (the first step size differentiated, the others held)."""
    ours, theirs = Pair().record(), Pair().record()
    ya, yb = _state(1, True), _state(1, True)
    out = odeint(ours, ya, T, gradient=gradient(steps="torchdiffeq"), adjoint_params=tuple(ours.parameters()))
    ref = torchdiffeq.odeint(theirs, yb, T)
    assert ours.steps == theirs.steps
    g = torch.autograd.grad(sum(o.sum() for o in out), (*ya, ours.w))
    r = torch.autograd.grad(sum(o.sum() for o in ref), (*yb, theirs.w))
    for x, y in zip(g, r):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_adjoint_takes_torchdiffeqs_steps_forward_and_backward():
    """The seminorm adjoint against torchdiffeq's ``odeint_adjoint(adjoint_options={"norm": "seminorm"})``: both
    use the parts' largest RMS for ``y`` and for ``a``, so the backward solves take the same steps too."""
    ours, theirs = Pair().record(), Pair().record()
    back_ours, back_theirs = [], []
    ours.callback_accept_step_adjoint = lambda t0, y0, dt: back_ours.append((_f(t0), _f(dt)))
    theirs.callback_accept_step_adjoint = lambda t0, y0, dt: back_theirs.append((_f(t0), _f(dt)))
    ya, yb = _state(1, True), _state(1, True)
    out = odeint_adjoint(ours, ya, T)
    ref = torchdiffeq.odeint_adjoint(theirs, yb, T, adjoint_options={"norm": "seminorm"})
    assert ours.steps == theirs.steps
    g = torch.autograd.grad(sum(o.sum() for o in out), (*ya, ours.w))
    r = torch.autograd.grad(sum(o.sum() for o in ref), (*yb, theirs.w))
    assert len(back_ours) == len(back_theirs)
    flat = [v for step in back_ours for v in step]
    assert flat == pytest.approx([v for step in back_theirs for v in step], rel=1e-9, abs=1e-12)
    for x, y in zip(g, r):
        torch.testing.assert_close(x, y, rtol=1e-7, atol=1e-9)


def test_event_search_takes_torchdiffeqs_steps():
    """``odeint_event`` on a tuple state finds torchdiffeq's event time, its search stepping as torchdiffeq's."""
    from cde_nets import odeint_event

    t0 = torch.tensor(0.0, dtype=F64)

    def ev(t, s):
        return s[1][..., 0].sum() - 1.0

    ours, theirs = Pair().record(), Pair().record()
    t_ours, _ = odeint_event(ours, _state(), t0, event_fn=ev)
    t_theirs, _ = torchdiffeq.odeint_event(theirs, _state(), t0, event_fn=ev)
    assert _f(t_ours) == _f(t_theirs)
    assert ours.steps[: len(theirs.steps)] == theirs.steps


def test_state_norm_is_torchdiffeqs_mixed_norm():
    """``StateNorm(sizes)`` on a flat state is torchdiffeq's ``_mixed_norm`` of the parts; ``StateNorm()`` its RMS."""
    from torchdiffeq._impl.misc import _mixed_norm, _rms_norm

    x = torch.randn(7, generator=torch.Generator().manual_seed(3), dtype=F64)
    assert torch.equal(StateNorm((2, 5))(x), _mixed_norm((x[:2], x[2:])))
    assert torch.equal(StateNorm()(x), _rms_norm(x))


def _concatenated_rms(parts):
    return torch.cat([p.reshape(-1) for p in parts]).square().mean().sqrt()


def test_flow_keeps_its_own_norm():
    """``ContinuousFlow`` solves ``(z, ℓ)`` as a tuple but controls its steps by the RMS over the concatenation,
    as its recorded runs did: the evaluations of the tuple solve with that norm given, not those of the default
    (which differ on this flow)."""

    class Tanh(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2).double()

        def forward(self, t, z):
            return torch.tanh(3 * self.lin(z))

    torch.manual_seed(0)
    flow = ContinuousFlow(Tanh(), T=2.0)
    x = torch.randn(64, 2, dtype=F64)
    with torch.no_grad():
        z, logdet, _, nfe = flow._transform(x, None)
        t = torch.tensor([0.0, 2.0], dtype=F64)
        counts = {}
        for name, options in (("concatenated", {"norm": _concatenated_rms}), ("default", None)):
            call = flow.aug.bind(None)
            zs, ls = odeint(call, (x, x.new_zeros(64)), t, rtol=flow.rtol, atol=flow.atol, options=options)
            counts[name] = call.nfe
            if name == "concatenated":
                torch.testing.assert_close(zs[-1], z, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(ls[-1], logdet, rtol=1e-12, atol=1e-12)
    assert nfe == counts["concatenated"] != counts["default"]
