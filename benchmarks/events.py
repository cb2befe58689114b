"""Per-sample events on a batch whose event times spread over a decade: does the cost follow ``Σ_i steps_i``?

``y' = −y + 0.1 tanh(W₂ tanh(W₁ y))`` (dim 32, width 256, float32, dopri5 at rtol 1e-5), batch 4096 with
``‖y0‖ = c e^{s}``, ``s`` log-uniform in ``[0.5, 5]``, and the event ``g = ‖y‖ − c``: event times ``≈ s``, a
decade apart. Goal (the issue): the event solve takes at most 1.2 × the ideal compacted cost

    ``full-batch time × Σ_i steps_i / (batch × max steps)``,

where the full batch is solved without events to the last event time (torchdiffeq ``odeint``, same tolerances)
and ``steps_i`` counts its accepted steps that start before sample ``i``'s event. Beside it, torchdiffeq's
``odeint_event`` — on the whole batch it stops everyone at the first event; sample by sample (timed on a subset,
scaled to the batch) it gives every sample its own event, at a solve per sample. Forward passes, no gradient.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torchdiffeq import odeint, odeint_event

from cde_nets import ODEBlock

from .common import write


class _MLPDecay(nn.Module):
    def __init__(self, dim: int, width: int, gen: torch.Generator):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(width, dim, generator=gen) / math.sqrt(dim))
        self.w2 = nn.Parameter(torch.randn(dim, width, generator=gen) / math.sqrt(width))
        self.accepted: list[float] = []

    def forward(self, t, y):
        return -y + 0.1 * torch.tanh(torch.tanh(y @ self.w1.T) @ self.w2.T)

    def callback_accept_step(self, t0, y0, dt):  # torchdiffeq: called on each accepted step
        self.accepted.append(float(t0))


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(tiny: bool = False, out_dir=None) -> dict:
    batch, dim, width, alone_n = (64, 8, 32, 4) if tiny else (4096, 32, 256, 16)
    gen = torch.Generator().manual_seed(0)
    field = _MLPDecay(dim, width, gen)
    c, T, rtol, atol = 0.1, 6.0, 1e-5, 1e-7
    s = torch.exp(torch.empty(batch).uniform_(math.log(0.5), math.log(5.0), generator=gen))
    direction = torch.randn(batch, dim, generator=gen)
    y0 = direction / direction.norm(dim=1, keepdim=True) * (c * torch.exp(s))[:, None]

    def event(t, y):
        return y.norm(dim=1) - c

    block = ODEBlock(field, T=T, rtol=rtol, atol=atol, gradient="backprop")
    with torch.no_grad():
        block.solve(y0[:8], event=event)  # warm-up
        t_ours, sol = _timed(lambda: block.solve(y0, event=event))
        stats = sol.stats.as_dict()
        t_last = float(sol.stop_times.max())
        times = torch.tensor([0.0, t_last], dtype=torch.float64)
        field.accepted.clear()
        t_full, _ = _timed(lambda: odeint(field, y0, times, rtol=rtol, atol=atol))
        starts = torch.tensor(field.accepted, dtype=torch.float64)
        steps_i = (starts[None, :] < sol.stop_times[:, None]).sum(1)
        max_steps = len(starts)
        ideal = t_full * float(steps_i.sum()) / (batch * max_steps)

        t0 = torch.tensor(0.0, dtype=torch.float64)
        t_whole, (t_ev, _) = _timed(lambda: odeint_event(field, y0, t0, event_fn=event, rtol=rtol, atol=atol))
        t_alone, alone_times = _timed(
            lambda: [
                float(odeint_event(field, y0[i : i + 1], t0, event_fn=event, rtol=rtol, atol=atol)[0])
                for i in range(alone_n)
            ]
        )
        t_alone *= batch / alone_n
    agree = max(abs(a - float(sol.stop_times[i])) for i, a in enumerate(alone_times))
    row = {
        "batch": batch,
        "dim": dim,
        "width": width,
        "event_time_min": float(sol.stop_times.min()),
        "event_time_max": t_last,
        "fired": int(sol.fired.sum()),
        "ours_s": t_ours,
        "full_batch_s": t_full,
        "full_batch_steps": max_steps,
        "sum_steps_i": int(steps_i.sum()),
        "ideal_s": ideal,
        "ratio_to_ideal": t_ours / ideal,
        "ratio_to_full_batch": t_ours / t_full,
        "odeint_event_whole_batch_s": t_whole,
        "odeint_event_whole_batch_event_time": float(t_ev),
        "odeint_event_per_sample_s": t_alone,
        "ratio_per_sample_to_ours": t_alone / t_ours,
        "max_event_time_diff_vs_per_sample": agree,
        "nfe_forward": stats["nfe_forward"],
        "steps_forward": stats["steps_forward"],
    }
    payload = {
        "setting": {
            "rtol": rtol,
            "atol": atol,
            "T": T,
            "c": c,
            "method": "dopri5",
            "dtype": "float32",
            "per_sample_timed_on": alone_n,
        },
        "goal": "ours <= 1.2 x full-batch time x sum(steps_i) / (batch x max steps)",
        "rows": [row],
    }
    write("events", payload, out_dir)
    return payload
