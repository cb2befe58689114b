"""The adjoint study (Chen et al. 2018) for a 16-piece Hamiltonian block on swiss-roll points.

``python -m cde_nets.benchmarks.adjoint_study [--tiny]`` writes ``benchmarks/results/adjoint_study.json`` and prints a
markdown table. Data: the swiss roll of the H-DNN reference code (``cde_nets.datasets`` when present, otherwise
generated here
with the same formula), 2-D points padded with two zeros to R⁴; loss: binary cross-entropy of a fixed linear
read-out of ``y(T)``.
"""

from __future__ import annotations

import argparse
import math

import torch

from cde_nets.diagnostics import adjoint_study, markdown_table, to_jsonable
from cde_nets.fields import Hamiltonian

from .common import write


def swiss_roll(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference code's: label 1 radius linspace(0, 1), label 0 radius linspace(0.2, 1.2), angle linspace(0, 4π −
    4π/m)."""
    m = n // 2
    angle = torch.linspace(0, 4 * math.pi - 4 * math.pi / m, m, dtype=torch.float64)
    pts = []
    for r in (torch.linspace(0, 1, m, dtype=torch.float64), torch.linspace(0.2, 1.2, m, dtype=torch.float64)):
        pts.append(torch.stack([r * torch.cos(angle), r * torch.sin(angle)], 1))
    x = torch.cat(pts)
    y = torch.cat([torch.ones(m), torch.zeros(m)]).to(torch.float64)
    return x, y


def run(tiny: bool = False, out_dir=None) -> dict:
    torch.manual_seed(0)
    n = 32 if tiny else 256
    x, label = swiss_roll(n)
    y0 = torch.cat([x, torch.zeros(n, 2, dtype=torch.float64)], 1)
    readout = torch.randn(4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def loss_fn(yT, target):
        return torch.nn.functional.binary_cross_entropy_with_logits(yT @ readout, target)

    def make_field():
        return Hamiltonian(
            4, layers=16, T=4.0, K="blockdiag", init_std=1.0, generator=torch.Generator().manual_seed(0)
        ).double()

    study = adjoint_study(
        make_field,
        (y0, label),
        loss_fn,
        tolerances=[1e-3] if tiny else [1e-3, 1e-5, 1e-7, 1e-9],
        steps=[16] if tiny else [16, 64, 256],
        methods=["dopri5"] if tiny else ["dopri5", "bosh3", "rk4", "euler"],
        repeat=1 if tiny else 3,
    )
    payload = {
        "setting": f"Hamiltonian H2 form (K blockdiag, canonical J), dim 4, 16 pieces, T=4, tanh, init_std 1, "
        f"swiss roll n={n} padded to R^4, BCE of a fixed linear read-out; float64; reference: "
        "backprop through dopri5 at rtol=atol=1e-10, step sizes held; memory = peak bytes saved for backward "
        "during the forward pass (saved_tensors_hooks)",
        **to_jsonable(study),
    }
    write("adjoint_study" + ("_tiny" if tiny else ""), payload, out_dir)
    return study


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(markdown_table(run(a.tiny)))


if __name__ == "__main__":
    main()
