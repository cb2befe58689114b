"""Per-sample step control against the shared step, on batches whose samples differ in stiffness.

Van der Pol oscillators ``x' = v``, ``v' = μ (1 − x²) v − x`` from ``(2, 0)`` over ``[0, T]``, ``dopri5``,
``rtol = 1e-5``, ``atol = 1e-7``, float64, batch 256, one thread: ``μ`` drawn per sample from ``[1, 25]``
(``mixed``), the same ``μ = 13`` for all (``equal``), and the mixed batch with a costlier field, the oscillator plus
an MLP ``2 → 256 → 256 → 2`` (tanh, weights scaled by 0.1; ``mixed_mlp``). For each: the shared step
(:func:`cde_nets.functional.odeint`, torchdiffeq's steps) and per-sample control
(:func:`~cde_nets.solvers.per_sample.odeint_per_sample`): batched field calls, steps (shared; per-sample mean and
max), and interleaved median times forward and forward+backward (backprop to ``y0`` and ``μ``). torchode, the
issue's reference, is not installed here and not measured. ``python -m cde_nets.benchmarks.per_sample [--tiny]``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from cde_nets.functional import odeint
from cde_nets.solvers.per_sample import odeint_per_sample

from .common import interleaved_medians, write

TOL = dict(rtol=1e-5, atol=1e-7)


class _Oscillator(nn.Module):
    """Van der Pol with ``μ`` per sample, plus an optional MLP; ``rows`` picks the running samples' ``μ``."""

    def __init__(self, mu: torch.Tensor, hidden: int = 0):
        super().__init__()
        self.mu = mu
        self.calls = 0
        self._rows: torch.Tensor | None = None
        self._mu = mu
        self.mlp = None
        if hidden:
            g = torch.Generator().manual_seed(1)
            self.mlp = nn.Sequential(
                nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2)
            )
            with torch.no_grad():
                for p in self.mlp.parameters():
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
            self.mlp.double()

    def forward(self, t: torch.Tensor, y: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        if rows is not None and rows is not self._rows:  # the same tensor until the batch shrinks: gather once
            self._rows, self._mu = rows, self.mu[rows]
        mu = self.mu if rows is None else self._mu
        x, v = y[:, 0], y[:, 1]
        out = torch.stack((v, mu * (1 - x * x) * v - x), 1)
        return out if self.mlp is None else out + self.mlp(y)


def _case(name: str, batch: int, T: float, repeat: int, warmup: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    mixed = name != "equal"
    mu0 = 1 + 24 * torch.rand(batch, generator=g, dtype=torch.float64) if mixed else torch.full((batch,), 13.0)
    mu0 = mu0.double()
    field = _Oscillator(mu0, hidden=256 if name == "mixed_mlp" else 0)
    y0 = torch.tensor([[2.0, 0.0]], dtype=torch.float64).repeat(batch, 1)
    t = torch.tensor([0.0, T], dtype=torch.float64)

    with torch.no_grad():
        field.calls = 0
        shared = odeint(field, y0, t, **TOL)
        shared_nfe = field.calls
        per, info = odeint_per_sample(field, y0, t, rows=True, return_info=True, **TOL)
    diff = float((shared[-1] - per[-1]).abs().max())

    def fwd_shared():
        with torch.no_grad():
            odeint(field, y0, t, **TOL)

    def fwd_per():
        with torch.no_grad():
            odeint_per_sample(field, y0, t, rows=True, **TOL)

    def bwd(per_sample: bool):
        def run():
            y = y0.clone().requires_grad_()
            field.mu, field._rows = mu0.clone().requires_grad_(), None
            out = odeint_per_sample(field, y, t, rows=True, **TOL) if per_sample else odeint(field, y, t, **TOL)
            out[-1].square().sum().backward()
            field.mu, field._rows = mu0, None

        return run

    rows = []
    if name == "mixed_mlp":  # seconds a solve: fewer repeats
        repeat, warmup = max(1, repeat // 3), 0
    for mode, fns in (("forward", [fwd_shared, fwd_per]), ("forward+backward", [bwd(False), bwd(True)])):
        shared_s, per_s = interleaved_medians(fns, repeat, warmup)
        print(name, mode, f"shared {shared_s:.4f} s, per-sample {per_s:.4f} s", flush=True)
        steps = info.steps.double()
        rows.append(
            {
                "case": name,
                "mode": mode,
                "batch": batch,
                "shared_nfe": shared_nfe,
                "per_sample_nfe": info.nfe,
                "per_sample_rows_evaluated": info.rows,
                "shared_rows_evaluated": shared_nfe * batch,
                "per_sample_steps_mean": float(steps.mean()),
                "per_sample_steps_max": int(info.steps.max()),
                "shared_s": shared_s,
                "per_sample_s": per_s,
                "ratio": per_s / shared_s,
                "max_abs_diff_final": diff,
            }
        )
    return rows


def run(tiny: bool = False, out_dir=None) -> dict:
    batch, T = (8, 1.0) if tiny else (256, 10.0)
    repeat, warmup = (1, 0) if tiny else (7, 1)
    torch.set_num_threads(1)
    rows = []
    for name in ("mixed", "equal", "mixed_mlp"):
        rows += _case(name, batch, T, repeat, warmup)
    res = {
        "setting": {"batch": batch, "T": T, "method": "dopri5", **TOL, "dtype": "float64", "threads": 1},
        "goal": "mixed: per-sample batched calls below the shared step's; equal: per-sample time <= 1.1x shared",
        "torchode": "not installed here; not measured",
        "rows": rows,
    }
    write("per_sample_tiny" if tiny else "per_sample", res, out_dir)
    return res


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    for r in run(args.tiny)["rows"]:
        print(r)
