"""A gradient method written as a user would add one: this file, plus one registry line (see
tests/solvers/gradients/test_gradient_objects.py). Backpropagation with recomputation between output times: each
interval ``[t_i, t_{i+1}]`` is solved under ``torch.utils.checkpoint``, so only the states at the output times stay in
memory and the backward pass re-runs one interval at a time. Its gradient is that of torchdiffeq's backprop
(``Backprop(steps="torchdiffeq")``: the step sizes after each interval's first held fixed), operation for
operation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint
from torchdiffeq import odeint

from cde_nets.solvers.gradients import GradientMethod, Run


@dataclass(frozen=True, repr=False)
class Segmented(GradientMethod):
    name = "segmented"
    counts_vjp = True

    def solve(self, run: Run) -> torch.Tensor:
        s = run.solver
        ys = [run.y0]

        def interval(y: torch.Tensor, i: int) -> torch.Tensor:
            span = run.t[i : i + 2]
            return odeint(run.func, y, span, rtol=s.rtol, atol=s.atol, method=s.method, options=run.options)[-1]

        for i in range(len(run.t) - 1):
            ys.append(checkpoint(interval, ys[-1], i, use_reentrant=False))
        return torch.stack(ys)
