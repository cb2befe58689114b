"""Per-sample step control (:mod:`cde_nets.solvers.per_sample.solve`): every sample takes the steps it takes alone —
those of a plain one-sample loop written from the controller's equations (Hairer's DOPRI5 PI controller), and bit
for bit the same numbers whatever batch it runs in; closed forms at per-sample times and end times; backprop
gradients against closed forms; the refusals name the fix."""

from __future__ import annotations

import math

import pytest
import torch

from cde_nets.functional import odeint
from cde_nets.solvers.errors import Reason, SolverError
from cde_nets.solvers.gradients import Adjoint
from cde_nets.solvers.per_sample.solve import odeint_per_sample
from cde_nets.solvers.steppers.fast_rk import _dense_weights
from cde_nets.solvers.steppers.tableaux import TABLEAUX

TOL = dict(rtol=1e-5, atol=1e-7)


class VanDerPol:
    """``x' = v``, ``v' = μ (1 − x²) v − x`` with ``μ`` per sample; counts the steps the shared path reports."""

    def __init__(self, mu: torch.Tensor):
        self.mu, self.accepted, self.rejected, self.calls = mu, 0, 0, 0

    def __call__(self, t: torch.Tensor, y: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        mu = self.mu if rows is None else self.mu[rows]
        x, v = y[:, 0], y[:, 1]
        return torch.stack((v, mu * (1 - x * x) * v - x), 1)

    def callback_accept_step(self, *args) -> None:
        self.accepted += 1

    def callback_reject_step(self, *args) -> None:
        self.rejected += 1


def _mixed(B: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = 1 + 24 * torch.rand(B, generator=g, dtype=torch.float64)
    return mu, torch.tensor([[2.0, 0.0]], dtype=torch.float64).repeat(B, 1)


def _alone(f, y0: list[float], times: list[float], rtol: float, atol: float):
    """One sample on its own with dopri5, in plain Python floats: Hairer, Nørsett & Wanner's initial step
    (Solving ODEs I, §II.4), the ratio ``r = ‖err / (atol + rtol max(|y|, |Y|))‖_RMS`` accepted where ``r ≤ 1``,
    the next step ``h · clip(0.9 r^(−α) w, 0.2, cap)`` with ``α = 1/5 − 0.75 β``, ``β = 0.04``, ``w = max(r',
    10⁻⁴)^β`` (``r'`` the last accepted ratio, 1 at first) on acceptance and 1 on rejection, ``cap = 1`` right
    after a rejection and 10 otherwise (Hairer's DOPRI5 code); the last step shortened to end on the last time,
    outputs before it from the dense output. Returns the outputs, accepted and rejected steps, and field calls."""
    tab = TABLEAUX["dopri5"]
    a, c, e, P = tab.tableau.a, tab.tableau.c, tab.error, _dense_weights(tab)
    n = len(y0)
    calls = [0]

    def F(t, y):
        calls[0] += 1
        return f(t, y)

    def rms(v):
        return math.sqrt(sum(x * x for x in v) / n)

    t, y = times[0], list(y0)
    k0 = F(t, y)
    sc = [atol + abs(v) * rtol for v in y]
    d0, d1 = rms([v / s for v, s in zip(y, sc)]), rms([v / s for v, s in zip(k0, sc)])
    h0 = 1e-6 if d0 < 1e-5 or d1 < 1e-5 else 0.01 * d0 / d1
    f1 = F(t + h0, [v + h0 * k for v, k in zip(y, k0)])
    d2 = rms([(p - q) / s for p, q, s in zip(f1, k0, sc)]) / h0
    h = min(100 * h0, (0.01 / max(d1, d2)) ** 0.2)
    alpha, beta, w_prev, cap = 0.2 - 0.75 * 0.04, 0.04, 1.0, 10.0
    outs, j, accepted, rejected = [list(y0)], 1, 0, 0
    while t < times[-1]:
        h = min(t + h, times[-1]) - t  # the last step ends on the end
        ks = [k0]
        for i in range(1, 7):
            Yi = [y[d] + h * sum(a[i][m] * ks[m][d] for m in range(i)) for d in range(n)]
            ks.append(F(t + c[i] * h, Yi))
        Y = Yi
        err = [h * sum(e[m] * ks[m][d] for m in range(7)) for d in range(n)]
        r = rms([er / (atol + rtol * max(abs(p), abs(q))) for er, p, q in zip(err, y, Y)])
        ok = r <= 1
        grow = r**-alpha if r > 0 else math.inf
        fac = min(max(0.9 * grow * (w_prev if ok else 1.0), 0.2), cap)
        if ok:
            accepted += 1
            while j < len(times) - 1 and times[j] <= t + h:
                x = (times[j] - t) / h
                wts = [x * (P[0][m] + x * (P[1][m] + x * (P[2][m] + x * P[3][m]))) for m in range(7)]
                outs.append([y[d] + h * sum(wts[m] * ks[m][d] for m in range(7)) for d in range(n)])
                j += 1
            t, y, k0, w_prev = t + h, Y, ks[6], max(r, 1e-4) ** beta
        else:
            rejected += 1
        h, cap = h * fac, 10.0 if ok else 1.0
    return torch.tensor([*outs, y], dtype=torch.float64), accepted, rejected, calls[0]


def _vdp_alone(mu: float, y0: torch.Tensor, t: torch.Tensor, rtol: float, atol: float):
    def f(_, y):
        return [y[1], mu * (1 - y[0] * y[0]) * y[1] - y[0]]

    return _alone(f, y0.tolist(), t.tolist(), rtol, atol)


def test_steps_equal_single_sample_solve_dopri5():
    """On a mixed-stiffness batch each sample's accepted and rejected steps are those of the plain one-sample
    loop (:func:`_alone`), the values agree to rounding, and the field is called as often as the sample that
    needs the most calls: one batched call per stage per sweep."""
    mu, y0 = _mixed()
    t = torch.tensor([0.0, 1.5, 4.0], dtype=torch.float64)
    out, info = odeint_per_sample(VanDerPol(mu), y0, t, rows=True, return_info=True, **TOL)
    calls = []
    for b in range(len(mu)):
        ref, accepted, rejected, nfe = _vdp_alone(float(mu[b]), y0[b], t, **TOL)
        assert (int(info.steps[b]), int(info.rejected[b])) == (accepted, rejected)
        torch.testing.assert_close(out[:, b], ref, rtol=0, atol=1e-10)
        calls.append(nfe)
    assert info.nfe == max(calls)
    assert info.sweeps == int((info.steps + info.rejected).max())
    assert max(calls) < sum(calls) / len(calls) * 1.6  # the spread the shared step would pay for on every row


@pytest.mark.parametrize("method", ["dopri5", "bosh3", "tsit5"])
def test_batch_does_not_change_a_sample(method):
    """A sample's numbers do not depend on the batch it runs in: bit for bit those of its solve alone."""
    mu, y0 = _mixed(B=6, seed=1)
    t = torch.tensor([0.0, 0.7, 3.0], dtype=torch.float64)
    out, info = odeint_per_sample(VanDerPol(mu), y0, t, method=method, rows=True, return_info=True, **TOL)
    for b in range(len(mu)):
        one, one_info = odeint_per_sample(
            VanDerPol(mu[b : b + 1]), y0[b : b + 1], t, method=method, rows=True, return_info=True, **TOL
        )
        assert torch.equal(one[:, 0], out[:, b])
        assert (int(one_info.steps), int(one_info.rejected)) == (int(info.steps[b]), int(info.rejected[b]))


def test_per_sample_output_times_closed_form():
    """``y' = cos t`` from per-sample starts: ``y(t) = y_0 + sin t − sin t_0`` at every sample's own times; the
    field sees one time per running row."""
    seen = []

    def field(t, y):
        seen.append(t.clone())
        assert t.dim() == 0 or t.shape == (y.shape[0],)
        return torch.cos(t).reshape(-1, 1).expand_as(y)

    t = torch.tensor([[0.0, 0.5, 2.0], [1.0, 1.1, 1.2], [-2.0, 0.0, 3.0]], dtype=torch.float64)
    y0 = torch.tensor([[1.0], [0.0], [2.0]], dtype=torch.float64)
    out = odeint_per_sample(field, y0, t, rtol=1e-10, atol=1e-12)
    assert torch.equal(seen[0], t[:, 0])  # each row's first evaluation at its own start
    exact = y0[None, :, 0] + torch.sin(t.T) - torch.sin(t[:, :1].T)
    torch.testing.assert_close(out[..., 0], exact, rtol=0, atol=1e-8)
    for b in range(3):  # and the one-sample loop's dense output at that sample's times
        ref = _alone(lambda s, v: [math.cos(s)], y0[b].tolist(), t[b].tolist(), 1e-10, 1e-12)[0]
        torch.testing.assert_close(out[:, b], ref, rtol=0, atol=1e-13)


def test_tsit5_per_sample_reads_its_own_continuous_extension():
    """Tsitouras's method on per-sample steps: a damped rotation ``y' = A y`` against ``exp(A t) y_0`` at output
    times between the steps (read off his continuous extension), every sample at its own times, to 1e-9."""
    A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]], dtype=torch.float64)
    y0 = torch.tensor([[1.0, 0.0], [0.3, -2.0], [-1.0, 0.5]], dtype=torch.float64)
    t = torch.tensor([[0.0, 0.37, 1.9, 3.0], [0.5, 0.61, 2.2, 2.5], [-1.0, 0.1, 0.2, 4.0]], dtype=torch.float64)
    out, info = odeint_per_sample(lambda s, y: y @ A.T, y0, t, method="tsit5", rtol=1e-10, atol=1e-12, return_info=True)
    for b in range(3):
        exact = torch.stack([torch.linalg.matrix_exp(A * (tj - t[b, 0])) @ y0[b] for tj in t[b]])
        torch.testing.assert_close(out[:, b], exact, rtol=0, atol=1e-9)
    assert int(info.steps.min()) >= 10  # the outputs fell between steps: the extension, not the step ends


def test_t_end_and_compaction():
    """``t_end``: each sample stops exactly at its own end (``y = y_0 e^{−k t_end}``); finished samples leave the
    batch, so the field sees fewer rows in late sweeps."""
    rows_seen = []
    k = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)

    def field(t, y, rows):
        rows_seen.append(len(rows))
        return -k[rows, None] * y

    t_end = torch.tensor([0.2, 3.0, 1.0, 0.5], dtype=torch.float64)
    y0 = torch.ones(4, 1, dtype=torch.float64)
    out, info = odeint_per_sample(field, y0, t_end=t_end, rows=True, rtol=1e-10, atol=1e-12, return_info=True)
    assert out.shape == (2, 4, 1)
    torch.testing.assert_close(out[-1, :, 0], torch.exp(-k * t_end), rtol=1e-8, atol=0)
    assert rows_seen[0] == 4 and rows_seen[-1] == 1
    assert info.rows == sum(rows_seen) < 4 * info.nfe


def test_compaction_stops_at_a_sixteenth_of_the_batch():
    """Samples finishing one after another leave the batch in compactions until no more than a sixteenth of the
    batch is left (64 rows: 4); those last rows stay to the end, the finished ones frozen at their end, and
    every sample still ends exactly on its own end time with its own result."""
    B = 64
    rows_seen = []
    k = torch.linspace(0.5, 2.0, B, dtype=torch.float64)

    def field(t, y, rows):
        rows_seen.append(len(rows))
        return -k[rows, None] * y

    t_end = torch.linspace(0.1, 3.0, B, dtype=torch.float64)
    out = odeint_per_sample(field, torch.ones(B, 1, dtype=torch.float64), t_end=t_end, rows=True, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(out[-1, :, 0], torch.exp(-k * t_end), rtol=1e-7, atol=0)
    assert rows_seen[0] == B and min(rows_seen) == rows_seen[-1]
    assert 1 < rows_seen[-1] <= B // 16  # dropped down to a sixteenth, then no more


def test_finished_sample_rides_along_frozen():
    """A sample that finished while most still run stays in the batch until a quarter has finished, frozen at
    its end, where its last step ended: the field never sees it past its end, and its result and counts are its
    own."""
    k = torch.tensor([4.0] + [1.0] * 7, dtype=torch.float64)
    t_end = torch.tensor([0.1] + [3.0] * 7, dtype=torch.float64)
    latest = torch.zeros(8, dtype=torch.float64)

    def field(t, y, rows):
        latest[rows] = torch.maximum(latest[rows], t)
        return -k[rows, None] * y

    y0 = torch.ones(8, 1, dtype=torch.float64)
    out, info = odeint_per_sample(field, y0, t_end=t_end, rows=True, rtol=1e-8, atol=1e-10, return_info=True)
    assert 0.09 < float(latest[0]) <= 0.1  # its last step ends on 0.1; never beyond
    torch.testing.assert_close(out[-1, :, 0], torch.exp(-k * t_end), rtol=1e-6, atol=0)
    _, alone = odeint_per_sample(field, y0[:1], t_end=t_end[:1], rows=True, rtol=1e-8, atol=1e-10, return_info=True)
    assert (int(alone.steps), int(alone.rejected)) == (int(info.steps[0]), int(info.rejected[0]))


def test_per_sample_tolerances():
    """``rtol``/``atol`` of shape ``(batch,)``: each sample takes the steps of its solve alone at its tolerance."""
    mu, y0 = torch.full((3,), 5.0, dtype=torch.float64), torch.tensor([[2.0, 0.0]] * 3, dtype=torch.float64)
    rtol = torch.tensor([1e-3, 1e-5, 1e-7], dtype=torch.float64)
    t = torch.tensor([0.0, 2.0], dtype=torch.float64)
    _, info = odeint_per_sample(VanDerPol(mu), y0, t, rtol=rtol, atol=1e-8, rows=True, return_info=True)
    for b in range(3):
        _, accepted, rejected, _ = _vdp_alone(5.0, y0[b], t, float(rtol[b]), 1e-8)
        assert (int(info.steps[b]), int(info.rejected[b])) == (accepted, rejected)
    assert info.steps[0] < info.steps[1] < info.steps[2]


def test_backprop_gradient_closed_form():
    """Backprop through per-sample steps: ``y(T_b) = y_0 e^{−k_b T_b}``, so ``∂y/∂k_b = −T_b y(T_b)`` and
    ``∂y/∂y_0 = e^{−k_b T_b}``."""
    k = torch.tensor([0.3, 1.0, 4.0], dtype=torch.float64, requires_grad=True)
    y0 = torch.tensor([[1.0], [2.0], [-1.0]], dtype=torch.float64, requires_grad=True)
    t_end = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    out = odeint_per_sample(lambda t, y, rows: -k[rows, None] * y, y0, t_end=t_end, rows=True, rtol=1e-10, atol=1e-12)
    out[-1].sum().backward()
    decay = torch.exp(-k.detach() * t_end)
    torch.testing.assert_close(k.grad, -t_end * y0.detach()[:, 0] * decay, rtol=1e-7, atol=0)
    torch.testing.assert_close(y0.grad[:, 0], decay, rtol=1e-7, atol=0)


def test_functional_controller_and_dtype():
    """``odeint(..., controller="per_sample")`` is this solver; a float32 state gives float32 results and times."""
    mu, y0 = torch.tensor(5.0, dtype=torch.float64), _mixed(B=4)[1]
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    field = VanDerPol(mu)
    a = odeint(lambda t, y: field(t, y), y0, t, controller="per_sample", **TOL)
    b = odeint_per_sample(lambda t, y: field(t, y), y0, t, **TOL)
    assert torch.equal(a, b)
    times = []

    def f32(t, y):
        times.append(t.dtype)
        return -y

    out = odeint_per_sample(f32, y0.float(), t)
    assert out.dtype == torch.float32 and set(times) == {torch.float32}
    torch.testing.assert_close(out[-1], y0.float() * math.exp(-1.0), rtol=1e-5, atol=1e-6)


def test_module_field_hooks_run_on_every_evaluation():
    """A module field without hooks is called through its ``forward`` during the forward solve (the same numbers
    as through ``__call__``); one with a forward hook is called through ``__call__``, so the hook sees every
    evaluation; and the backward pass calls the module as given (a hook added after the forward sees the
    checkpoint's replays)."""

    class Decay(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.k = torch.nn.Parameter(torch.tensor([0.5, 2.0], dtype=torch.float64))

        def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return -self.k * y

    f = Decay()
    y0 = torch.ones(3, 2, dtype=torch.float64) * torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    t = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    with torch.no_grad():
        out = odeint_per_sample(f, y0, t)
        assert torch.equal(out, odeint_per_sample(lambda t, y: f(t, y), y0, t))
        seen: list[int] = []
        handle = f.register_forward_hook(lambda *args: seen.append(1))
        hooked, info = odeint_per_sample(f, y0, t, return_info=True)
        handle.remove()
    assert torch.equal(hooked, out) and len(seen) == info.nfe > 0
    out, info = odeint_per_sample(f, y0, t, gradient="checkpoint", return_info=True)
    replays: list[int] = []
    handle = f.register_forward_hook(lambda *args: replays.append(1))
    out[-1].sum().backward()
    handle.remove()
    assert info.backward is not None and len(replays) == info.backward.nfe > 0


def test_refusals_name_the_fix():
    y0 = torch.ones(2, 1, dtype=torch.float64)
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="controller='batch'"):
        odeint_per_sample(lambda t, y: -y, y0, t, gradient="reversible")
    for gradient in (
        "checkpoint",
        "adjoint",
        "symplectic",
    ):  # a closure's tensors are out of their reach: named, not dropped
        with pytest.raises(ValueError, match="params="):
            odeint_per_sample(lambda t, y: -y, y0, t, gradient=gradient)
    with pytest.raises(ValueError, match="Adjoint\\(method='rk4'\\)"):
        odeint_per_sample(lambda t, y: -y, y0, t, gradient=Adjoint(method="rk4"), params=[])
    with pytest.raises(ValueError, match="serves methods"):
        odeint_per_sample(lambda t, y: -y, y0, t, method="rk4")
    with pytest.raises(ValueError, match="strictly increasing"):
        odeint_per_sample(lambda t, y: -y, y0, torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(batch, n\)"):
        odeint_per_sample(lambda t, y: -y, y0, torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="`rtol`"):
        odeint_per_sample(lambda t, y: -y, y0, t, rtol=torch.ones(3))
    with pytest.raises(ValueError, match="t_end.detach"):  # its gradient was dropped silently before
        odeint_per_sample(lambda t, y: -y, y0, t_end=torch.ones(2, dtype=torch.float64, requires_grad=True))
    with pytest.raises(ValueError, match="`controller`"):
        odeint(lambda t, y: -y, y0, t, controller="sample")
    # a field that reads a scalar time: its own exception, with a note naming the option
    with pytest.raises((RuntimeError, ValueError)) as info:
        odeint_per_sample(lambda t, y: -y * float(t), y0, t)
    assert any("controller='batch'" in note for note in getattr(info.value, "__notes__", ["controller='batch'"]))
    with pytest.raises(ValueError, match="controller='batch'"):
        odeint_per_sample(lambda t, y: -y.sum(0), y0, t)
    # per-sample data without `rows`: refused once the batch shrinks, never broadcast silently
    k = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"forward\(t, y, rows\)"):
        odeint_per_sample(lambda t, y: -k * y, y0, t_end=torch.tensor([0.5, 1.0], dtype=torch.float64))


def test_nonfinite_sample_is_named():
    def field(t, y, rows):
        return torch.where(rows[:, None] == 1, y / 0.0 * 0.0, -y)

    with pytest.raises(SolverError, match="sample 1"):
        odeint_per_sample(field, torch.ones(3, 1, dtype=torch.float64), torch.tensor([0.0, 1.0]), rows=True)


@pytest.mark.slow
def test_failed_backward_solve_names_the_exact_methods_that_do_not_integrate_backwards():
    """Van der Pol's limit cycle attracts forwards, so the adjoint's time-reversed solve diverges and its step
    underflows; the error says why and names ``checkpoint`` and ``backprop``, which gives the gradient."""

    class Oscillator(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mu = torch.nn.Parameter(torch.tensor(25.0, dtype=torch.float64))

        def forward(self, t, y):
            x, v = y[..., 0], y[..., 1]
            return torch.stack((v, self.mu * (1 - x * x) * v - x), -1)

    field, y0 = Oscillator(), torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    t = torch.tensor([0.0, 10.0], dtype=torch.float64)
    out = odeint(field, y0, t, rtol=1e-5, atol=1e-7, gradient="adjoint")
    with pytest.raises(SolverError, match="backwards in time.*gradient='checkpoint' or gradient='backprop'") as info:
        out[-1].sum().backward()
    assert info.value.reason is Reason.UNDERFLOW
    out = odeint(field, y0, t, rtol=1e-5, atol=1e-7, gradient="checkpoint")
    out[-1].sum().backward()
    assert torch.isfinite(field.mu.grad)


def test_wants_rows_reads_every_kind_of_field():
    """``rows`` is found (or not) the same way ``inspect.signature`` finds it, whether the field is a function, a
    keyword-only parameter, a decorated function, a ``partial``, a module's class ``forward`` (read once per class)
    or a ``forward`` set on one instance."""
    import functools

    from cde_nets.solvers.per_sample.solve import wants_rows

    def plain(t, y):
        return y

    def with_rows(t, y, rows):
        return y

    def keyword_rows(t, y, *, rows=None):
        return y

    def star(t, y, *args, **kwargs):
        return y

    @functools.wraps(with_rows)
    def decorated(*args, **kwargs):
        return with_rows(*args, **kwargs)

    class Rows(torch.nn.Module):
        def forward(self, t, y, rows):
            return y

    class NoRows(torch.nn.Module):
        def forward(self, t, y):
            return y

    patched = NoRows()
    patched.forward = with_rows  # type: ignore[method-assign]
    cases = [
        (plain, False),
        (with_rows, True),
        (keyword_rows, True),
        (star, False),
        (decorated, True),
        (functools.partial(with_rows, 0.0), True),
        (Rows(), True),
        (NoRows(), False),
        (NoRows(), False),
        (patched, True),
        (torch.sin, False),
    ]
    assert [wants_rows(f) for f, _ in cases] == [want for _, want in cases]
