"""An ensemble of neural ODEs in one call: ``torch.vmap`` over stacked parameters against the Python loop of single
solves and against the ensemble stacked into one batched field by hand.

Each member is an MLP field ``2 → 32 → 2`` (tanh) of its own parameters, solved from its own batch of 8 points over
``[0, 1]`` by ``dopri5`` (``rtol = 1e-6``, ``atol = 1e-8``, float64, one thread), each member on its own steps
(the shared step's controller over the member's batch, as its single solve). For ``E = 16, 256, 4096`` members:

- ``vmap``: ``vmap(lambda p, y: functional_call(solve, p, (y,)))`` with ``solve`` a module whose forward solves
  its field by ``cde_nets.odeint``: the member's parameters swapped in once per solve (torch's way of vmapping an
  ensemble), so the field's ``nn.Linear`` layers run as one stacked product each
  (:mod:`solvers.steppers.stacked_linear`);
- ``vmap_block``: the same with an ``ODEBlock`` as the module;
- ``vmap_per_evaluation``: ``vmap(lambda p, y: cde_nets.odeint(field(p), y, t))`` with ``field(p)`` the module
  called by ``functional_call`` with the member's parameters at every evaluation: ``vmap``'s batching of each
  layer;
- ``loop``: ``cde_nets.odeint`` member by member (for 4096 members a subset of 256 is timed and scaled by 16);
- ``stacked``: one field over all members (``baddbmm`` with the stacked weights, state ``(E, 8, 2)``) solved by the
  same tensor loop with a clock per member (``odeint_vmappable(rows=1)``: the same steps as ``vmap``'s);
- ``per_sample``: that field under the library's per-sample controller (``odeint(controller="per_sample")``: its
  PI controller, so other steps), finished members leaving the batch.

Interleaved medians of CPU time (one thread), forward only, and forward + backward (gradients of the summed end
states with respect to all parameters, which are each member's own: the members are independent) for the three
``vmap`` rows and ``stacked``; and ``vmap(grad(loss))``, each member's gradient taken inside ``vmap`` (the
innermost transform is then ``grad``, so the loop runs under ``vmap``'s batching rules). Goal: ``vmap`` of 256
members at most 1.2x the hand-stacked field and far below the loop.
``python -m cde_nets.benchmarks.ensembles [--tiny]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from cde_nets.blocks.ode import ODEBlock
from cde_nets.functional import odeint
from cde_nets.solvers.steppers.vmappable import odeint_vmappable

from .common import interleaved_medians, write

TOL = dict(rtol=1e-6, atol=1e-8)
POINTS, DIM, HIDDEN = 8, 2, 32
VMAP_ROWS = ("vmap", "vmap_block", "vmap_per_evaluation")
LOOP_SUBSET = 256  # members timed in the loop beyond this count, the time scaled to the whole ensemble


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(y)))


class Stacked(nn.Module):
    """All members as one field: ``y`` ``(E, points, 2)``; ``rows`` picks the running members' weights."""

    def __init__(self, params: dict[str, torch.Tensor]):
        super().__init__()
        self.w1, self.b1 = params["l1.weight"].transpose(1, 2), params["l1.bias"].unsqueeze(1)
        self.w2, self.b2 = params["l2.weight"].transpose(1, 2), params["l2.bias"].unsqueeze(1)

    def forward(self, t: torch.Tensor, y: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        w1, b1, w2, b2 = self.w1, self.b1, self.w2, self.b2
        if rows is not None and rows.shape[0] != w1.shape[0]:
            w1, b1, w2, b2 = w1[rows], b1[rows], w2[rows], b2[rows]
        return torch.baddbmm(b2, torch.tanh(torch.baddbmm(b1, y, w1)), w2)


class Solve(nn.Module):
    """A module whose forward is the solve of its field: ``functional_call`` on it swaps a member's parameters in
    once per solve."""

    def __init__(self, field: nn.Module, t: torch.Tensor):
        super().__init__()
        self.field, self.t = field, t

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return odeint(self.field, y, self.t, **TOL)[-1]


def _members(n: int) -> tuple[list[MLP], dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    members = [MLP().double() for _ in range(n)]
    params, _ = stack_module_state(members)  # type: ignore[arg-type]
    y0 = torch.randn(n, POINTS, DIM, dtype=torch.float64)
    return members, params, y0


def _case(n: int, repeat: int, warmup: int) -> dict:
    members, params, y0 = _members(n)
    t = torch.tensor([0.0, 1.0], dtype=torch.float64)
    base = MLP().double().to("meta")

    def one(p: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return odeint(lambda s, x: functional_call(base, p, (s, x)), y, t, **TOL)[-1]

    def by_vmap_per_evaluation(p=params) -> torch.Tensor:
        return vmap(one)(p, y0)

    solve = Solve(base, t)

    def by_vmap(p=params) -> torch.Tensor:
        return vmap(lambda q, y: functional_call(solve, {f"field.{k}": v for k, v in q.items()}, (y,)))(p, y0)

    block = ODEBlock(base, T=1.0, method="dopri5", **TOL)

    def by_vmap_block(p=params) -> torch.Tensor:
        return vmap(lambda q, y: functional_call(block, {f"field.{k}": v for k, v in q.items()}, (y,)))(p, y0)

    def stacked(p=params) -> torch.Tensor:
        return odeint_vmappable(Stacked(p), y0, t, method="dopri5", rows=1, **TOL)[-1]

    def per_sample() -> torch.Tensor:
        return odeint(Stacked(params), y0, t, controller="per_sample", **TOL)[-1]

    timed = min(n, LOOP_SUBSET)

    def loop() -> torch.Tensor:
        return torch.stack([odeint(m, y, t, **TOL)[-1] for m, y in zip(members[:timed], y0[:timed])])

    vmaps = [by_vmap, by_vmap_block, by_vmap_per_evaluation]
    with torch.no_grad():
        ref = loop()
        outs = [fn() for fn in vmaps]
        s = stacked()
        agree = float((outs[0][:timed] - ref).abs().max() / ref.abs().max())
        agree_stacked = max(float((s - v).abs().max() / v.abs().max()) for v in outs)
        times = interleaved_medians([*vmaps, stacked, per_sample, loop], repeat, warmup, clock=time.process_time)
    *vmap_t, stacked_s, per_sample_s, loop_s = times
    loop_s *= n / timed

    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}

    def grad_of(fn) -> Callable[[], None]:
        def step():
            out = fn(leaves).sum()
            torch.autograd.grad(out, list(leaves.values()))

        return step

    def member_loss(q: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return functional_call(solve, {f"field.{k}": v for k, v in q.items()}, (y,)).sum()

    def vmap_of_grad() -> None:  # each member's gradient inside vmap: the loop under vmap's batching rules
        vmap(grad(member_loss))(params, y0)

    *vmap_b, stacked_b, vmap_of_grad_b = interleaved_medians(
        [*(grad_of(fn) for fn in [*vmaps, stacked]), vmap_of_grad], repeat, warmup, clock=time.process_time
    )
    row = {"members": n, "stacked_s": stacked_s, "per_sample_s": per_sample_s, "loop_s": loop_s}
    for name, fwd, bwd in zip(VMAP_ROWS, vmap_t, vmap_b):
        row |= {f"{name}_s": fwd, f"{name}_over_stacked": fwd / stacked_s}
        row |= {f"{name}_backward_s": bwd, f"{name}_over_stacked_backward": bwd / stacked_b}
    return row | {
        "stacked_backward_s": stacked_b,
        "vmap_of_grad_s": vmap_of_grad_b,
        "vmap_of_grad_over_vmap_backward": vmap_of_grad_b / vmap_b[0],
        "vmap_over_per_sample": vmap_t[0] / per_sample_s,
        "loop_over_vmap": loop_s / vmap_t[0],
        "loop_timed_members": timed,
        "max_rel_diff_vmap_loop": agree,
        "max_rel_diff_vmap_stacked": agree_stacked,
    }


def run(tiny: bool = False, out_dir=None) -> dict:
    sizes = (4, 16) if tiny else (16, 256, 4096)
    repeat, warmup = (1, 0) if tiny else (5, 1)
    torch.set_num_threads(1)
    rows = [_case(n, repeat if n < 4096 else 3, warmup) for n in sizes]
    res = {
        "setting": {
            "field": f"MLP {DIM}-{HIDDEN}-{DIM} (tanh) per member, {POINTS} points per member",
            "method": "dopri5",
            **TOL,
            "T": 1.0,
            "dtype": "float64",
            "threads": 1,
            "clock": "process_time (CPU seconds; interleaved medians)",
            "loop": f"members beyond {LOOP_SUBSET}: {LOOP_SUBSET} timed, scaled to the ensemble",
        },
        "goal": "vmap of 256 members <= 1.2x the hand-stacked field (same steps), far below the loop",
        "rows": rows,
    }
    write("ensembles_tiny" if tiny else "ensembles", res, out_dir)
    return res


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    for r in run(args.tiny)["rows"]:
        print(r)
