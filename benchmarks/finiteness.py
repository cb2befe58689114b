"""Cost of the finiteness check every solve makes (one fused ``isfinite(y).all()`` per call, a single host
synchronisation): the check's own time on the call's output against the call without it (``overhead``), and the
difference of whole calls with and without it (``whole_call_difference``, within the machine's noise at these
sizes). Goal: at most 3 % of a forward call.
``python -m cde_nets.benchmarks.finiteness [--tiny]`` writes ``benchmarks/results/finiteness.json``."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

import torch

from cde_nets import ODEBlock, SDEBlock, discretize
from cde_nets.blocks.nonfinite import check_result
from cde_nets.fields import Hamiltonian

from .common import interleaved_medians, median_time, write


@contextmanager
def _unchecked():
    """The blocks with their result check replaced by a no-op (what they cost without it)."""
    import cde_nets.blocks.discrete as d
    import cde_nets.blocks.ode as o
    import cde_nets.blocks.sde as s

    saved = d.check_result, o.check_result, s.check_result
    d.check_result = o.check_result = s.check_result = lambda y, explain: None
    try:
        yield
    finally:
        d.check_result, o.check_result, s.check_result = saved


def run(tiny: bool = False, out_dir: Path | None = None) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sizes = [(4, 64)] if tiny else [(4, 256), (64, 1024)]
        repeat = 3 if tiny else 15
        rows = []
        for dim, batch in sizes:
            torch.manual_seed(0)
            y0 = torch.randn(batch, dim)
            cases = {
                "discrete euler, 64 layers": discretize(Hamiltonian(dim, layers=64), "euler"),
                "ODEBlock rk4, 16 pieces": ODEBlock(Hamiltonian(dim, layers=16), method="rk4", gradient="backprop"),
                "ODEBlock dopri5": ODEBlock(Hamiltonian(dim), rtol=1e-5, atol=1e-7),
                "SDEBlock euler, 16 pieces": SDEBlock(Hamiltonian(dim, layers=16), noise="additive", seed=0),
            }
            for name, block in cases.items():

                @torch.no_grad()
                def checked(block=block, y0=y0):
                    return block(y0)

                @torch.no_grad()
                def unchecked(block=block, y0=y0):
                    with _unchecked():
                        return block(y0)

                t_on, t_off = interleaved_medians([checked, unchecked], repeat=repeat)
                # the whole-call difference is within the machine's noise at these sizes: time the check itself
                # on the call's output, the same isfinite().all() and one read-back
                out = unchecked()
                t_check = median_time(lambda out=out: check_result(out, str), repeat=50 * repeat, warmup=5)
                rows.append(
                    {
                        "case": name,
                        "dim": dim,
                        "batch": batch,
                        "checked_s": t_on,
                        "unchecked_s": t_off,
                        "check_s": t_check,
                        "overhead": t_check / t_off,
                        "whole_call_difference": t_on / t_off - 1,
                    }
                )
    finally:
        torch.set_num_threads(threads)
    res = {
        "goal": "overhead <= 0.03 of a forward call",
        "rows": rows,
        "worst_overhead": max(r["overhead"] for r in rows),
    }
    write("finiteness", res, out_dir)
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m cde_nets.benchmarks.finiteness")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    for r in run(tiny=a.tiny)["rows"]:
        print(f"{r['case']:28s} dim {r['dim']:3d} batch {r['batch']:5d}: overhead {100 * r['overhead']:+.1f} %")
