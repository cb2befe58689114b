"""What a per-sample sweep costs outside the field: on small batches a sweep is a few dozen tensor operations of
a few microseconds each, so their number is its time. We count the torch calls the solver makes per sweep (the
slope over two solves of different lengths, so one-off setup is not counted) and the reads back from the device:
one per sweep (the controller's counts), and none in a piecewise field's lookup of each row's piece."""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from cde_nets.solvers.per_sample.solve import odeint_per_sample

READS = ("__bool__", "__float__", "__int__", "item", "tolist")


class _Calls(TorchFunctionMode):
    """Counts torch calls (functions and methods, not attribute reads), except those inside ``quiet``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.quiet = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.quiet and name != "__get__":
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _per_round(solve) -> tuple[float, float]:
    """Torch calls and host reads per sweep: the slope between a short and a long solve."""
    mode = _Calls()

    def field(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mode.quiet = True
        try:
            return -y
        finally:
            mode.quiet = False

    counts = []
    for T in (2.0, 8.0):
        with torch.no_grad():
            solve(field, T)  # warm
            mode.calls.clear()
            with mode:
                info = solve(field, T)
        counts.append((info.sweeps, sum(mode.calls.values()), sum(mode.calls[r] for r in READS)))
    (r0, c0, h0), (r1, c1, h1) = counts
    assert r1 > r0 + 20
    return (c1 - c0) / (r1 - r0), (h1 - h0) / (r1 - r0)


def test_a_dopri5_round_is_few_tensor_ops_and_one_read():
    """dopri5 on 64 rows: 6 stage combinations and 7 scalings by ``h`` (the step copied onto every component
    once), the stage times written into a buffer (2 calls), about 24 controller ops (the PI controller's memory
    included, both powers one call), 2 state updates: 46 torch calls a sweep (69 before the controller was fused,
    50 before the powers, the stage times and the step went to buffers), held to at most 47 (the shared-step loop
    makes about 49 a step), and one host read."""
    y0 = torch.ones(64, 2, dtype=torch.float64)  # rows alike: they finish in one sweep

    def solve(field, T):
        t = torch.tensor([0.0, T], dtype=torch.float64)
        return odeint_per_sample(field, y0, t, rtol=1e-9, atol=1e-11, return_info=True)[1]

    calls, reads = _per_round(solve)
    assert calls <= 47, calls
    assert reads == 1


def test_piecewise_field_finds_its_pieces_without_reads():
    """A piecewise NAIS block, per-sample control stopping on the piece boundaries, the samples on different
    pieces in most sweeps (``y0`` of different sizes: they reach the boundaries in different sweeps): each row's
    piece is found on the device from the span the sweep's read brings, so the reads per sweep stay at the
    controller's one (before: one or more per field evaluation), and each sample's result is that of its solve
    alone, to rounding."""
    from cde_nets import ODEBlock
    from cde_nets.fields.nais import NAIS

    g = torch.Generator().manual_seed(5)
    field = NAIS(3, 2, layers=4, T=2.0, eps=0.1, init_std=1.0, generator=g).double()
    x0 = torch.randn(6, 3, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, 6, dtype=torch.float64)[:, None]
    u = torch.randn(6, 2, generator=g, dtype=torch.float64)
    mode = _Calls()
    counts = []
    for tol in (1e-5, 1e-9):
        block = ODEBlock(field, controller="per_sample", rtol=tol, atol=tol)
        with torch.no_grad():
            block(x0, u)
            mode.calls.clear()
            with mode:
                sol = block.solve(x0, u)
        y, sweeps = sol.y, sol.stats["steps_forward"] + sol.stats["rejected_forward"]
        counts.append((sweeps, sum(mode.calls[r] for r in READS)))
        with torch.no_grad():
            for b in range(6):
                torch.testing.assert_close(y[b], block(x0[b : b + 1], u[b : b + 1])[0], rtol=0, atol=1e-13)
    (r0, h0), (r1, h1) = counts
    assert r1 > r0 + 20
    assert (h1 - h0) / (r1 - r0) <= 1.0
