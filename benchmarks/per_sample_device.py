"""Per-sample step control and the shared step on an accelerator, against torchdiffeq and torchode on the same one.

The cases of :mod:`~cde_nets.benchmarks.per_sample` moved to a CUDA device (the CPU where none is present, as in
``--tiny``): Van der Pol with ``μ`` per sample from ``[1, 25]`` (dopri5, rtol 1e-5, atol 1e-7, ``T = 10``) and the
small neural ODE (MLP ``2 → 64 → 2``, rtol = atol = 1e-6, ``T = 1``), float64, at the CPU benchmark's batch and at a
batch a GPU is made for. On a device every read of a value back to the host waits for the queued kernels, so a
sweep's cost is mostly launches and that one wait: the per-sample controller reads back once a sweep, the shared
step once a step. Columns: batched field calls, and interleaved median wall times (``torch.cuda.synchronize``
after each solve) forward and forward+backward (backprop to ``y0``), each over the shared step's.

``python -m cde_nets.benchmarks.per_sample_device [--tiny]`` writes ``benchmarks/results/per_sample_device.json``.
"""

from __future__ import annotations

import argparse
import time

import torch

from cde_nets.functional import odeint
from cde_nets.solvers.per_sample.solve import odeint_per_sample

from .common import interleaved_medians, write
from .per_sample import _MLP, _calls, _Oscillator, _timed, _torchode, to

TOL = {"vdp": dict(rtol=1e-5, atol=1e-7), "neural": dict(rtol=1e-6, atol=1e-6)}


def _problem(case: str, batch: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    if case == "vdp":
        field = _Oscillator(1 + 24 * torch.rand(batch, generator=g, dtype=torch.float64))
        field.mu = field._mu = field.mu.to(device)
        y0 = torch.tensor([[2.0, 0.0]], dtype=torch.float64).repeat(batch, 1)
        T = 10.0
    else:
        field = _MLP()
        y0 = torch.randn(batch, 2, generator=g, dtype=torch.float64)
        T = 1.0
    return field.to(device), y0.to(device), torch.tensor([0.0, T], dtype=torch.float64, device=device)


def _sync(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _case(case: str, batch: int, device: torch.device, repeat: int, warmup: int) -> list[dict]:
    from torchdiffeq import odeint as tdq  # here: torchdiffeq loads scipy

    field, y0, t = _problem(case, batch, device)
    tol, sync = TOL[case], _sync(device)
    rows = case == "vdp"  # the oscillator gathers its μ for the running samples
    solves = {
        "shared": lambda y: odeint(field, y, t, **tol),
        "per_sample": lambda y: odeint_per_sample(field, y, t, rows=rows, **tol),
        "torchdiffeq": lambda y: tdq(field, y, t, **tol),
    }
    tode = None if to is None else _torchode(field, y0, tol, torch.stack((t,) * batch))
    if tode is not None:
        solves["torchode"] = tode[1]
    with torch.no_grad():
        _, info = odeint_per_sample(field, y0, t, rows=rows, return_info=True, **tol)
        shared = _calls(field, lambda f: odeint(f, y0, t, **tol))
    calls = {"per_sample": info.nfe, "torchode": None if tode is None else tode[2], "shared": shared}

    def timed(solve, forward: bool):
        run = _timed(solve, y0, field, forward)
        return lambda: (run(), sync())

    out = []
    for mode in ("forward", "forward+backward"):
        fns = [timed(s, mode == "forward") for s in solves.values()]
        times = dict(zip(solves, interleaved_medians(fns, repeat, warmup)))
        print(case, batch, mode, {k: f"{v * 1e3:.1f} ms" for k, v in times.items()}, flush=True)
        out.append(
            {
                "case": case,
                "batch": batch,
                "mode": mode,
                "device": str(device),
                "calls": calls,
                **{f"{k}_s": v for k, v in times.items()},
                **{f"{k}_over_shared": v / times["shared"] for k, v in times.items() if k != "shared"},
            }
        )
    return out


def run(tiny: bool = False, out_dir=None) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    repeat, warmup = (1, 0) if tiny else (9, 2)
    sizes = {"vdp": (8,) if tiny else (256, 8192), "neural": (8,) if tiny else (512, 65536)}
    rows = [r for case, batches in sizes.items() for b in batches for r in _case(case, b, device, repeat, warmup)]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    res = {
        "setting": {"device": name, "dtype": "float64", "method": "dopri5", "tolerances": TOL},
        "goal": "measure: per-sample control and the shared step against torchdiffeq and torchode on a device",
        "torchode": "measured" if to is not None else "not installed here; not measured",
        "rows": rows,
    }
    write("per_sample_device_tiny" if tiny else "per_sample_device", res, out_dir)
    return res


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=None, help="folder for the JSON (default: benchmarks/results)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    run(args.tiny, args.out)
    print(f"{time.perf_counter() - t0:.0f} s")
