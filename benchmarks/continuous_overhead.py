"""Continuous mode against raw ``torchdiffeq.odeint`` on the same field and tolerances.

Goal: ``ODEBlock`` costs <= 1.05x the raw call, with the same NFE. ``python -m cde_nets.benchmarks.continuous_overhead
[--tiny]`` writes ``benchmarks/results/continuous_overhead.json``.
"""

from __future__ import annotations

import argparse

import torch
from torchdiffeq import odeint, odeint_adjoint

from cde_nets import ODEBlock
from cde_nets.blocks.gathering import gathered
from cde_nets.fields import CubicFriction, Hamiltonian

from .common import interleaved_medians, write


class _Counting(torch.nn.Module):
    def __init__(self, field):
        super().__init__()
        self.field = field
        self.nfe = 0

    def forward(self, t, y):
        self.nfe += 1
        return self.field(t, y)


def _case(name, field, y0, gradient, rtol, repeat, warmup):
    block = ODEBlock(field, rtol=rtol, atol=rtol, gradient=gradient)
    raw = _Counting(field)
    t = torch.tensor([0.0, field.T], dtype=torch.float64)
    opts = {"jump_t": field.grid.jumps} if field.layers > 1 else {}
    params = tuple(p for p in field.parameters() if p.requires_grad)

    def ours():
        block(y0).square().mean().backward()

    def theirs():  # the field's constants once per solve, as the block builds them
        with gathered(field):
            y = _raw()
        y[-1].square().mean().backward()

    def _raw():
        if gradient == "adjoint":
            return odeint_adjoint(
                raw,
                y0,
                t,
                rtol=rtol,
                atol=rtol,
                method="dopri5",
                options=opts,
                adjoint_params=params,
                adjoint_options={**opts, "norm": "seminorm"},
            )
        return odeint(raw, y0, t, rtol=rtol, atol=rtol, method="dopri5", options=opts)

    t_ours, t_raw = interleaved_medians([ours, theirs], repeat, warmup)
    raw.nfe = 0
    theirs()
    sol = block.solve(y0)
    sol.y.square().mean().backward()
    return {
        "case": name,
        "gradient": gradient,
        "rtol": rtol,
        "time_ours_s": t_ours,
        "time_torchdiffeq_s": t_raw,
        "ratio": t_ours / t_raw,
        "nfe_ours": sol.stats["nfe_forward"] + sol.stats["nfe_backward"]
        if gradient == "adjoint"
        else sol.stats["nfe_forward"],
        "nfe_torchdiffeq": raw.nfe,
    }


def run(tiny: bool = False, out_dir=None) -> dict:
    torch.manual_seed(0)
    repeat, warmup = (1, 0) if tiny else (15, 2)
    rows = []
    for dim, batch in ((4, 256), (64, 1024)) if not tiny else ((4, 8),):
        g = torch.Generator().manual_seed(dim)
        fields = {
            f"Hamiltonian d={dim} b={batch} L=16": Hamiltonian(dim, layers=16, generator=g),
            f"CubicFriction d={dim} b={batch} L=16": CubicFriction(
                dim, layers=16, gamma=0.5, zero_init=False, generator=g
            ),
        }
        y0 = torch.randn(batch, dim, generator=g)
        for name, field in fields.items():
            for gradient in ("adjoint", "backprop"):
                rows.append(_case(name, field, y0, gradient, 1e-4, repeat, warmup))
    payload = {"goal": "ratio <= 1.05 and equal NFE", "rows": rows}
    write("continuous_overhead", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| case | gradient | ours ms | torchdiffeq ms | ratio | NFE ours | NFE torchdiffeq |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['case']} | {r['gradient']} | {1e3 * r['time_ours_s']:.1f} | {1e3 * r['time_torchdiffeq_s']:.1f} | "
            f"{r['ratio']:.3f} | {r['nfe_ours']} | {r['nfe_torchdiffeq']} |"
        )


if __name__ == "__main__":
    main()
