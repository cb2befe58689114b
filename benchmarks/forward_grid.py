"""Continuous mode near the limit: the fast forward path against the field evaluations alone, torchdiffeq and
torchode.

Hamiltonian field ``J Kᵀ tanh(K y + b)`` with constant parameters, dopri5, rtol 1e-5, atol 1e-7, ``T = 10``,
float32, one thread, over dim {4, 64, 256} × batch {256, 1024, 4096}. Columns (median seconds, interleaved):

- ``fe``: the same number of field evaluations as our solve, in a bare loop (the limit of any solver);
- ``ours``: ``ODEBlock`` forward-only (fast path), ``torchdiffeq``: raw ``odeint``, ``torchode``: ``Dopri5`` with
  an ``IntegralController`` (``AutoDiffAdjoint``), all under ``torch.no_grad``;
- forward+backward of ``y(T).square().mean()`` with respect to the parameters: ours with ``gradient="backprop"``
  against torchode's ``AutoDiffAdjoint``, and ours with ``gradient="adjoint"`` against torchode's
  ``BacksolveAdjoint`` (skipped at the largest size to keep the run short).

Every column sees the same field: its constants (``K Jᵀ``, ``Kᵀ``) built once per solve, as blocks build them
(:func:`cde_nets.blocks.gathering.gathered`).

Goals: forward ≤ 1.5× ``fe`` at dim ≥ 64 and ≤ 2.5× at dim 4; ahead of torchode everywhere.
``python -m cde_nets.benchmarks.forward_grid [--tiny]`` writes ``benchmarks/results/forward_grid.json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torchdiffeq import odeint

from cde_nets import ODEBlock
from cde_nets.blocks.gathering import gathered
from cde_nets.fields import Hamiltonian

from .common import interleaved_medians, write

try:  # the peer is optional (a benchmark-only dependency): without it, its columns are None
    import torchode as to
except ImportError:  # pragma: no cover - depends on the environment
    to = None

T, RTOL, ATOL = 10.0, 1e-5, 1e-7
DIMS, BATCHES = (4, 64, 256), (256, 1024, 4096)


class _Rows(torch.nn.Module):
    """The field on one sample (torchode's backsolve vmaps the vector-Jacobian product over the batch)."""

    def __init__(self, field: torch.nn.Module):
        super().__init__()
        self.field = field

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.field(t, y.unsqueeze(0)).squeeze(0) if y.dim() == 1 else self.field(t, y)


def _torchode(field: torch.nn.Module, adjoint: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, int]]:
    # one piece: the field reads no time, so torchode's per-sample times are fine
    term = to.ODETerm(field if adjoint == "autodiff" else _Rows(field))
    step = to.Dopri5(term=term)
    control = to.IntegralController(atol=ATOL, rtol=RTOL, term=term)
    solver = to.AutoDiffAdjoint(step, control) if adjoint == "autodiff" else to.BacksolveAdjoint(term, step, control)

    def solve(y0: torch.Tensor) -> tuple[torch.Tensor, int]:
        b = y0.shape[0]
        problem = to.InitialValueProblem(y0=y0, t_start=torch.zeros(b), t_end=torch.full((b,), T))
        with gathered(field):
            sol = solver.solve(problem)
        return sol.ys[:, -1], int(sol.stats["n_f_evals"].max())

    return solve


def _size(dim: int, batch: int, repeat: int, backward: bool, backsolve: bool) -> dict:
    g = torch.Generator().manual_seed(dim * 7919 + batch)
    field = Hamiltonian(dim, layers=1, T=T, generator=g)
    y0 = torch.randn(batch, dim, generator=g)
    t = torch.tensor([0.0, T], dtype=torch.float64)
    block = ODEBlock(field, rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        nfe = block.solve(y0).stats["nfe_forward"]
    tt = torch.tensor(1.0)
    tode = None if to is None else _torchode(field, "autodiff")

    def fe():
        with torch.no_grad(), gathered(field):
            for _ in range(nfe):
                field(tt, y0)

    def ours():
        with torch.no_grad():
            block(y0)

    def tdq():
        with torch.no_grad(), gathered(field):
            odeint(field, y0, t, rtol=RTOL, atol=ATOL, method="dopri5")

    def tode_fwd():
        with torch.no_grad():
            tode(y0)

    fns = [fe, ours, tdq] + ([] if tode is None else [tode_fwd])
    times: list = interleaved_medians(fns, repeat, warmup=1 if repeat > 1 else 0) + ([None] if tode is None else [])
    nfe_tode = None
    if tode is not None:
        with torch.no_grad():
            nfe_tode = tode(y0)[1]
    row = {
        "dim": dim,
        "batch": batch,
        "nfe": nfe,
        "nfe_torchode": nfe_tode,
        "repeat": repeat,
        "fe_s": times[0],
        "ours_s": times[1],
        "torchdiffeq_s": times[2],
        "torchode_s": times[3],
        "ours_over_fe": times[1] / times[0],
        "torchdiffeq_over_fe": times[2] / times[0],
        "torchode_over_ours": None if times[3] is None else times[3] / times[1],
    }
    if backward and tode is not None:
        bp = ODEBlock(field, rtol=RTOL, atol=ATOL, gradient="backprop")
        adj = ODEBlock(field, rtol=RTOL, atol=ATOL, gradient="adjoint")
        tode_bs = _torchode(field, "backsolve")

        def step(out: torch.Tensor) -> None:
            out.square().mean().backward()
            field.zero_grad()

        fns = [lambda: step(bp(y0)), lambda: step(tode(y0)[0])]
        if backsolve:
            fns += [lambda: step(adj(y0)), lambda: step(tode_bs(y0)[0])]
        tb = interleaved_medians(fns, max(3, repeat // 2), warmup=0)
        row.update(
            {
                "ours_backprop_fb_s": tb[0],
                "torchode_autodiff_fb_s": tb[1],
                "torchode_autodiff_over_ours_backprop": tb[1] / tb[0],
            }
        )
        if backsolve:
            row.update(
                {
                    "ours_adjoint_fb_s": tb[2],
                    "torchode_backsolve_fb_s": tb[3],
                    "torchode_backsolve_over_ours_adjoint": tb[3] / tb[2],
                }
            )
    return row


def run(tiny: bool = False, out_dir=None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        sizes = [(4, 64)] if tiny else [(d, b) for d in DIMS for b in BATCHES]
        for dim, batch in sizes:
            work = dim * dim * batch
            repeat = (
                1
                if tiny
                else (15 if dim == 4 else 7 if work <= 64 * 64 * 1024 else 3 if work <= 256 * 256 * 256 else 1)
            )
            # torchode's backsolve takes a per-sample vector-Jacobian product (vmap): 15 s at dim 64, so dim 4 only
            rows.append(_size(dim, batch, repeat, backward=work < 256 * 256 * 4096, backsolve=dim == 4))
    finally:
        torch.set_num_threads(threads)
    payload = {
        "goal": "ours_over_fe <= 1.5 at dim >= 64 and <= 2.5 at dim 4; torchode slower than ours everywhere",
        "setting": {
            "field": "Hamiltonian, one piece",
            "method": "dopri5",
            "rtol": RTOL,
            "atol": ATOL,
            "T": T,
            "dtype": "float32",
            "threads": 1,
        },
        "rows": rows,
    }
    write("forward_grid", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print(
        "| dim | batch | NFE (torchode) | fe ms | ours ms | ours/fe | torchdiffeq/fe | torchode/ours | "
        "fwd+bwd torchode/ours backprop | backsolve/ours adjoint |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        fb = " | ".join(
            f"{r[k]:.2f}" if k in r else "—"
            for k in ("torchode_autodiff_over_ours_backprop", "torchode_backsolve_over_ours_adjoint")
        )
        print(
            f"| {r['dim']} | {r['batch']} | {r['nfe']} ({r['nfe_torchode']}) | {1e3 * r['fe_s']:.1f} | "
            f"{1e3 * r['ours_s']:.1f} | {r['ours_over_fe']:.2f} | {r['torchdiffeq_over_fe']:.2f} | "
            f"{r['torchode_over_ours']:.2f} | {fb} |"
        )


if __name__ == "__main__":
    main()
