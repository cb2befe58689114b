"""Per-sample step control against the shared step, on batches whose samples differ in stiffness.

Van der Pol oscillators ``x' = v``, ``v' = μ (1 − x²) v − x`` from ``(2, 0)`` over ``[0, T]``, ``dopri5``,
``rtol = 1e-5``, ``atol = 1e-7``, float64, batch 256, one thread: ``μ`` drawn per sample from ``[1, 25]``
(``mixed``), the same ``μ = 13`` for all (``equal``), and the mixed batch with a costlier field, the oscillator plus
an MLP ``2 → 256 → 256 → 2`` (tanh, weights scaled by 0.1; ``mixed_mlp``). For each: the shared step
(:func:`cde_nets.functional.odeint`, torchdiffeq's steps) and per-sample control
(:func:`~cde_nets.solvers.per_sample.solve.odeint_per_sample`): batched field calls, steps (shared; per-sample mean and
max), and interleaved median CPU times (one thread) forward and forward+backward (backprop to ``y0`` and ``μ``),
with torchode's per-sample ``Dopri5`` + ``IntegralController`` (``AutoDiffAdjoint``) in the same interleaving where
it is installed (an optional benchmark peer; its columns are ``None`` otherwise).

``neural``: the small neural ODE of diffrax's benchmark (MLP ``2 → 64 → 2``, tanh, batch 512, ``rtol = atol =
1e-6``, ``T = 1``, float64): both controllers, per-sample and the shared step (the default), forward against the
same number of field calls in a bare loop, and against torchdiffeq and torchode forward and forward+backward.
``adjoint``: the per-sample adjoint's backward pass with the joint design (one batched backward solve) against
solving every sample's backward problem alone (batch 32 of the same field).
``python -m cde_nets.benchmarks.per_sample [--tiny]``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from cde_nets.functional import odeint
from cde_nets.solvers.gradients import Adjoint
from cde_nets.solvers.per_sample.adjoint import SeparateAdjoint
from cde_nets.solvers.per_sample.solve import odeint_per_sample

from .common import interleaved_medians, write


def _medians(fns, repeat: int, warmup: int) -> list[float]:
    """Interleaved medians of CPU time (one thread: the preemption of a busy machine does not count)."""
    return interleaved_medians(fns, repeat, warmup, clock=time.process_time)


try:  # the peer is optional (a benchmark-only dependency): without it, its columns are None
    import torchode as to
except ImportError:  # pragma: no cover - depends on the environment
    to = None

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

    def bwd(solve):
        def run():
            y = y0.clone().requires_grad_()
            field.mu, field._rows = mu0.clone().requires_grad_(), None
            solve(y)[-1].square().sum().backward()
            field.mu, field._rows = mu0, None

        return run

    tode = None if to is None else _torchode(field, y0, TOL, torch.stack((t,) * batch))
    rows = []
    if name == "mixed_mlp":  # seconds a solve: fewer repeats
        repeat, warmup = max(1, repeat // 3), 0
    per_solve = lambda y: odeint_per_sample(field, y, t, rows=True, **TOL)  # noqa: E731
    modes = [
        ("forward", [fwd_shared, fwd_per]),
        ("forward+backward", [bwd(lambda y: odeint(field, y, t, **TOL)), bwd(per_solve)]),
    ]
    for mode, fns in modes:
        if tode is not None:
            fns.append(tode[0] if mode == "forward" else bwd(tode[1]))
        shared_s, per_s, *tode_s = _medians(fns, repeat, warmup)
        print(name, mode, f"shared {shared_s:.4f} s, per-sample {per_s:.4f} s, torchode {tode_s}", flush=True)
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
                "torchode_nfe": None if tode is None else tode[2],
                "torchode_s": tode_s[0] if tode_s else None,
                "per_sample_over_torchode": per_s / tode_s[0] if tode_s else None,
            }
        )
    return rows


def _torchode(field: nn.Module, y0: torch.Tensor, tol: dict, t_eval: torch.Tensor):
    """torchode's per-sample dopri5 on ``field`` (full batch, its own masking): forward-only and differentiable
    solves, and its batched field calls."""
    term = to.ODETerm(lambda t, y: field(t, y))
    step = to.Dopri5(term=term)
    solver = to.AutoDiffAdjoint(step, to.IntegralController(term=term, **tol))

    def solve(y0: torch.Tensor) -> torch.Tensor:
        return solver.solve(to.InitialValueProblem(y0=y0, t_eval=t_eval)).ys.transpose(0, 1)

    def forward() -> None:
        with torch.no_grad():
            solve(y0)

    with torch.no_grad():
        stats = solver.solve(to.InitialValueProblem(y0=y0, t_eval=t_eval)).stats
    return forward, solve, int(stats["n_f_evals"].max())


class _MLP(nn.Module):
    """diffrax's small neural ODE field: ``2 → 64 → 2``, tanh, float64, time-invariant."""

    def __init__(self, width: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 2)).double()
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / p.shape[-1] ** 0.5)

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)


def _neural(batch: int, repeat: int, warmup: int) -> list[dict]:
    from torchdiffeq import odeint as tdq  # here: torchdiffeq loads scipy

    tol = dict(rtol=1e-6, atol=1e-6)
    field = _MLP()
    y0 = torch.randn(batch, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    with torch.no_grad():
        _, info = odeint_per_sample(field, y0, t, return_info=True, **tol)
        shared_nfe = _calls(field, lambda f: odeint(f, y0, t, **tol))

    def field_alone(calls: int):
        def run():
            with torch.no_grad():
                for _ in range(calls):
                    field(t[0], y0)

        return run

    solves = {
        "per_sample": lambda y: odeint_per_sample(field, y, t, **tol),
        "shared": lambda y: odeint(field, y, t, **tol),
        "torchdiffeq": lambda y: tdq(field, y, t, **tol),
    }
    tode = None if to is None else _torchode(field, y0, tol, torch.stack((t,) * batch))
    if tode is not None:
        solves["torchode"] = tode[1]
    rows = []
    alone = ["field_alone", "field_alone_shared"]
    for mode in ("forward", "forward+backward"):
        fns = [] if mode == "forward+backward" else [field_alone(info.nfe), field_alone(shared_nfe)]
        for solve in solves.values():
            fns.append(_timed(solve, y0, field, mode == "forward"))
        times = _medians(fns, repeat, warmup)
        named = dict(zip((alone if mode == "forward" else []) + list(solves), times))
        print("neural", mode, named, flush=True)
        rows.append(
            {
                "case": "neural",
                "mode": mode,
                "batch": batch,
                "shared_nfe": shared_nfe,
                "per_sample_nfe": info.nfe,
                "torchode_nfe": None if tode is None else tode[2],
                "shared_s": named["shared"],
                "per_sample_s": named["per_sample"],
                "ratio": named["per_sample"] / named["shared"],
                **{f"{k}_s": v for k, v in named.items() if k not in ("shared", "per_sample")},
                "per_sample_over_field_alone": named["per_sample"] / named["field_alone"]
                if "field_alone" in named
                else None,
                "per_sample_over_torchdiffeq": named["per_sample"] / named["torchdiffeq"],
                "per_sample_over_torchode": named["per_sample"] / named["torchode"] if "torchode" in named else None,
                # the library's default, controller="batch": the shared step against the same references
                "shared_over_field_alone": named["shared"] / named["field_alone_shared"]
                if "field_alone_shared" in named
                else None,
                "shared_over_torchdiffeq": named["shared"] / named["torchdiffeq"],
                "shared_over_torchode": named["shared"] / named["torchode"] if "torchode" in named else None,
            }
        )
    return rows


def _calls(field: nn.Module, solve) -> int:
    n = [0]
    handle = field.register_forward_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    try:
        solve(field)
    finally:
        handle.remove()
    return n[0]


def _timed(solve, y0: torch.Tensor, field: nn.Module, forward: bool):
    def run():
        if forward:
            with torch.no_grad():
                solve(y0)
            return
        field.zero_grad()
        y = y0.clone().requires_grad_()
        solve(y)[-1].square().sum().backward()

    return run


def _adjoint_design(batch: int, repeat: int, warmup: int) -> dict:
    """The per-sample adjoint's forward+backward, joint backward solve against one per sample."""
    tol = dict(rtol=1e-6, atol=1e-6)
    field = _MLP()
    y0 = torch.randn(batch, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    infos = {}

    def design(gradient, key):
        def run():
            field.zero_grad()
            out, infos[key] = odeint_per_sample(field, y0.clone(), t, gradient=gradient, return_info=True, **tol)
            out[-1].square().sum().backward()

        return run

    separate_s, joint_s = _medians([design(SeparateAdjoint(), "separate"), design(Adjoint(), "joint")], repeat, warmup)
    print("adjoint design", f"separate {separate_s:.4f} s, joint {joint_s:.4f} s", flush=True)
    return {
        "case": "adjoint_design",
        "mode": "forward+backward",
        "batch": batch,
        "shared_nfe": infos["separate"].backward.nfe,
        "per_sample_nfe": infos["joint"].backward.nfe,
        "shared_s": separate_s,
        "per_sample_s": joint_s,
        "ratio": joint_s / separate_s,
        "note": "shared_* columns: the separate design (each sample's backward solve alone); per_sample_*: joint",
    }


def run(tiny: bool = False, out_dir=None) -> dict:
    batch, T = (8, 1.0) if tiny else (256, 10.0)
    repeat, warmup = (1, 0) if tiny else (7, 1)
    torch.set_num_threads(1)
    rows = []
    for name in ("mixed", "equal", "mixed_mlp"):
        rows += _case(name, batch, T, repeat, warmup)
    rows += _neural(8 if tiny else 512, repeat, warmup)
    rows.append(_adjoint_design(4 if tiny else 32, repeat, warmup))
    res = {
        "setting": {
            "batch": batch,
            "T": T,
            "method": "dopri5",
            **TOL,
            "dtype": "float64",
            "threads": 1,
            "clock": "process_time (CPU seconds; interleaved medians)",
        },
        "goal": (
            "mixed: per-sample batched calls <= torchode's; equal: per-sample time <= 1.1x shared; neural, the "
            "default controller: forward <= 2x the field alone, ahead of torchdiffeq and torchode"
        ),
        "torchode": "measured" if to is not None else "not installed here; not measured",
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
