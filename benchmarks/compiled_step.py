"""The compiled step (``odeint(..., options={"compile": True})``, :mod:`solvers.steppers.compiled`) against
torchdiffeq and the library's eager stepper: where compilation pays, and what it costs to compile.

- Spiral: torchdiffeq's ``examples/ode_demo.py`` training (``y' = (y³) A`` data, the model ``Linear(2, 50) → tanh →
  Linear(50, 2)`` on ``y³``, RMSprop 1e-3, batches of 20 windows of 10 times, dopri5 at torchdiffeq's defaults,
  float32), 200 iterations, compiled and torchdiffeq one iteration each in turn from the same seeds: the time of
  iterations 2…200 (the first, which compiles, reported apart) and the final losses. Goal: ≤ 0.25x, final loss
  within 1 %.
- Small neural ODE: MLP 2-64-2, batch 512, ``rtol = atol = 1e-6``, float32, ``t = linspace(0, 1, 10)``: forward
  (no graph) and forward + backward, compiled against torchdiffeq, and the compiled forward against the eager loop
  of the same number of field evaluations. Goals: ≤ 0.25x, ≤ 0.3x, ≤ 1.0x.
- Large: MLP 256-256-256, batch 1024, the same solve: compiled against the eager stepper (``cde_nets.odeint``
  without ``compile``), forward and forward + backward. Goal: ≤ 1.05x.
- Mixed-μ Van der Pol per sample against torchode: not served (the compiled step runs the shared step).
- A profile of one compiled step of the small neural ODE (torch.profiler, self CPU time by operation).

Interleaved medians (:func:`benchmarks.common.interleaved_medians`), one thread, after a warm-up that compiles; the
first call's time is recorded as the compile time. ``python -m cde_nets.benchmarks.compiled_step [--tiny]`` (tiny:
small sizes on the ``aot_eager`` backend) writes ``benchmarks/results/compiled_step.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from cde_nets import odeint
from cde_nets.solvers.gradients import Backprop
from cde_nets.solvers.steppers import compiled

from .common import interleaved_medians, write
from .torchdiffeq_dropin import _A, spiral_iteration

COMPILE = {"compile": True}


class _MLP(nn.Module):
    def __init__(self, dim: int, width: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, width), nn.Tanh(), nn.Linear(width, dim))

    def forward(self, t, y):
        return self.net(y)


def _goal(ratio: float, goal: float) -> dict:
    return dict(ratio=ratio, goal=goal, met=bool(ratio <= goal))


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _spiral_race(iters: int, held_variant: bool = True) -> dict:
    """Compiled (every step size differentiated, the library's backprop), compiled with torchdiffeq's gradient
    (``Backprop(steps="torchdiffeq")``: only the first step size differentiated) and torchdiffeq, one iteration
    of each in turn. One iteration's loss is one minibatch's: the losses are compared at the last iteration and
    as the mean of the last 20."""
    import torchdiffeq

    t = torch.linspace(0.0, 25.0, 1000)
    with torch.no_grad():
        data = odeint(lambda t, y: (y**3) @ _A, torch.tensor([[2.0, 0.0]]), t, method="dopri5")
    held = Backprop(steps="torchdiffeq")
    runs = {
        "compiled": spiral_iteration(lambda f, y0, t: odeint(f, y0, t, options=COMPILE), data, t, 10, 20),
        "compiled_torchdiffeq_steps": spiral_iteration(
            lambda f, y0, t: odeint(f, y0, t, options=COMPILE, gradient=held), data, t, 10, 20
        ),
        "torchdiffeq": spiral_iteration(torchdiffeq.odeint, data, t, 10, 20),
    }
    if not held_variant:
        del runs["compiled_torchdiffeq_steps"]
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(iters):
        for name, iteration in runs.items():
            start = time.perf_counter()
            losses[name].append(iteration())
            times[name].append(time.perf_counter() - start)
    theirs = sum(times["torchdiffeq"][1:])
    ref, ref20 = losses["torchdiffeq"][-1], float(np.mean(losses["torchdiffeq"][-20:]))

    def against(name: str) -> dict:
        final = abs(losses[name][-1] - ref) / abs(ref)
        last20 = abs(float(np.mean(losses[name][-20:])) - ref20) / abs(ref20)
        return dict(
            compile_s=times[name][0],
            compiled_s=sum(times[name][1:]),
            final_loss=losses[name][-1],
            final_loss_rel_diff=final,
            last20_mean_loss=float(np.mean(losses[name][-20:])),
            last20_mean_rel_diff=last20,
            time=_goal(sum(times[name][1:]) / theirs, 0.25),
            loss_within_1_percent=bool(final <= 0.01),
        )

    return dict(
        iterations=iters,
        torchdiffeq_s=theirs,
        final_loss_torchdiffeq=ref,
        last20_mean_loss_torchdiffeq=ref20,
        compiled=against("compiled"),
        compiled_torchdiffeq_steps=against("compiled_torchdiffeq_steps" if held_variant else "compiled"),
    )


def _nfe(f: _MLP, y0: torch.Tensor, t: torch.Tensor, kw: dict) -> int:
    count = [0]

    def counting(s, y):
        count[0] += 1
        return f(s, y)

    with torch.no_grad():
        odeint(counting, y0, t, **kw)
    return count[0]


def _small(repeat: int, dim: int, width: int, batch: int, f: _MLP | None = None) -> dict:
    import torchdiffeq

    torch.manual_seed(0)
    f = _MLP(dim, width) if f is None else f
    y0, t = torch.randn(batch, dim), torch.linspace(0.0, 1.0, 10)
    kw = dict(rtol=1e-6, atol=1e-6)

    def fwd(impl, **o):
        def go():
            with torch.no_grad():
                return impl(f, y0, t, **kw, **o)

        return go

    def fwd_bwd(impl, **o):
        def go():
            f.zero_grad()
            impl(f, y0, t, **kw, **o).square().mean().backward()

        return go

    nfe = _nfe(f, y0, t, kw)
    t0 = y0.new_zeros(())

    def field_loop():
        with torch.no_grad():
            for _ in range(nfe):
                f(t0, y0)

    compile_fwd = _timed(fwd(odeint, options=COMPILE))
    compile_bwd = _timed(fwd_bwd(odeint, options=COMPILE))
    with torch.no_grad():
        diff = float((odeint(f, y0, t, options=COMPILE, **kw) - torchdiffeq.odeint(f, y0, t, **kw)).abs().max())
    calls = [fwd(odeint, options=COMPILE), fwd(torchdiffeq.odeint), fwd(odeint), field_loop]
    c_f, td_f, e_f, loop = interleaved_medians(calls, repeat=repeat, warmup=1)
    calls = [fwd_bwd(odeint, options=COMPILE), fwd_bwd(torchdiffeq.odeint), fwd_bwd(odeint)]
    c_b, td_b, e_b = interleaved_medians(calls, repeat=repeat, warmup=1)
    return dict(
        dim=dim,
        width=width,
        batch=batch,
        nfe=nfe,
        compile_forward_s=compile_fwd,
        compile_forward_backward_s=compile_bwd,
        max_abs_diff_from_torchdiffeq=diff,
        forward=dict(compiled_s=c_f, torchdiffeq_s=td_f, eager_s=e_f, field_loop_s=loop),
        forward_backward=dict(compiled_s=c_b, torchdiffeq_s=td_b, eager_s=e_b),
        compiled_over_eager_forward=c_f / e_f,
        compiled_over_eager_forward_backward=c_b / e_b,
    )


def _profile(dim: int, width: int, batch: int, f: _MLP | None = None) -> dict:
    """One compiled step of the small neural ODE, alone (the solve's own loop left out): its wall time, the eager
    field's six evaluations for comparison, and torch.profiler's self CPU time by operation."""
    from cde_nets.solvers.dropin import Problem

    torch.manual_seed(0)
    f = _MLP(dim, width) if f is None else f
    y0 = torch.randn(batch, dim)
    with torch.no_grad():
        odeint(f, y0, torch.linspace(0.0, 1.0, 2), rtol=1e-6, atol=1e-6, options=COMPILE)
        graphs = next(iter(compiled._CACHE[f].values()))
        p = Problem(f, None)
        p.checked = True
        t0, h = torch.tensor(0.0, dtype=torch.float64), torch.tensor(0.01, dtype=torch.float64)
        k0 = f(t0, y0)

        def step():
            graphs.step(p, t0, h, y0, k0)[3].tolist()

        def fields():
            for _ in range(6):
                f(t0, y0)

        step_s, fields_s = interleaved_medians([step, fields], repeat=15, warmup=3, number=20)
        with torch.profiler.profile() as prof:
            for _ in range(50):
                step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    return dict(
        step_s=step_s,
        six_eager_field_evaluations_s=fields_s,
        self_cpu_us_per_step={e.key[:60]: e.self_cpu_time_total / 50 for e in rows},
    )


def run(tiny: bool = False, out_dir=None) -> dict:
    torch.set_num_threads(1)
    backend = compiled.BACKEND
    if tiny:  # inductor's compiles take minutes on two cores: the tiny run traces the same graphs without codegen
        compiled.BACKEND = "aot_eager"
    start = time.perf_counter()
    try:
        repeat = 1 if tiny else 15
        spiral = _spiral_race(2 if tiny else 200, held_variant=not tiny)
        # tiny: one field for every part, so that each graph compiles once
        field = _MLP(2, 8) if tiny else None
        small = _small(repeat, 2, 8 if tiny else 64, 16 if tiny else 512, field)
        large = small if tiny else _small(repeat, 256, 256, 1024)
        profile = _profile(2, 8 if tiny else 64, 16 if tiny else 512, field)
    finally:
        compiled.BACKEND = backend
    goals = {
        "spiral training / torchdiffeq": spiral["compiled"]["time"],
        "spiral training, torchdiffeq's gradient / torchdiffeq": spiral["compiled_torchdiffeq_steps"]["time"],
        "small forward / torchdiffeq": _goal(small["forward"]["compiled_s"] / small["forward"]["torchdiffeq_s"], 0.25),
        "small forward+backward / torchdiffeq": _goal(
            small["forward_backward"]["compiled_s"] / small["forward_backward"]["torchdiffeq_s"], 0.3
        ),
        "small forward / eager field loop": _goal(
            small["forward"]["compiled_s"] / small["forward"]["field_loop_s"], 1.0
        ),
        "large forward / eager stepper": _goal(small_ratio(large, "forward"), 1.05),
        "large forward+backward / eager stepper": _goal(small_ratio(large, "forward_backward"), 1.05),
        "mixed-mu Van der Pol per sample / torchode": dict(
            ratio=None, goal=0.25, met=False, note="not served: compile=True runs the shared step"
        ),
    }
    res = dict(
        setting="one thread, float32, interleaved medians; compiled on torch.compile(backend="
        f"{'aot_eager' if tiny else backend!r}, dynamic=False); the first call (compile) timed apart; inductor's "
        f"caches {'off (cold compiles)' if os.environ.get('TORCHINDUCTOR_FORCE_DISABLE_CACHES') == '1' else 'on'}",
        goal="spiral <= 0.25x torchdiffeq (loss within 1 %); small forward <= 0.25x, fwd+bwd <= 0.3x torchdiffeq, "
        "forward <= 1.0x the eager field loop; large <= 1.05x eager",
        load_average=os.getloadavg(),
        goals=goals,
        rows=[dict(name=name, **g) for name, g in goals.items()],
        spiral=spiral,
        small=small,
        large=large,
        profile=profile,
        time_s=time.perf_counter() - start,
    )
    write("compiled_step_tiny" if tiny else "compiled_step", res, out_dir)
    return res


def small_ratio(res: dict, mode: str) -> float:
    return res[mode]["compiled_s"] / res[mode]["eager_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    res = run(tiny=parser.parse_args().tiny)
    for row in res["rows"]:
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.3f}"
        print(f"{row['name']:45s} {ratio:>8s}  goal <= {row['goal']}  met={row['met']}")
    print(
        f"compile: spiral first iteration {res['spiral']['compiled']['compile_s']:.1f} s, small forward "
        f"{res['small']['compile_forward_s']:.1f} s, fwd+bwd {res['small']['compile_forward_backward_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
