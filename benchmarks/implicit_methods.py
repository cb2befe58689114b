"""Implicit Runge-Kutta methods: a stiff problem against dopri5, and the cost of a gl4 step against an rk4 step.

- Stiff: Van der Pol ``x'' − μ (1 − x²) x' + x = 0`` with ``μ = 1000`` from ``(x, x') = (2, 0)`` over ``[0, 20]``
  (the slow branch; eigenvalue ≈ −3000 at the start), float64. The fixed-step implicit methods at 20–80 steps
  against torchdiffeq's dopri5 at rtol 1e-6 / 1e-8: steps, NFE, time and the relative error of ``(x, x')(T)``
  against scipy's Radau at rtol 1e-10, atol 1e-12.
- Cost: one step of ``gl4`` (stages to rounding with the default ``Newton("auto")``, IFT backward; and with
  ``Newton("simplified")``) against one of ``rk4`` on the H1 field, dim 4 and 64, batch 256, float64: forward time
  and forward+backward CPU time of one thread (loss ``Σ y₁²``, gradients to ``y_0`` and the parameters); targets
  ``gl4 forward ≤ 3 × rk4 forward`` and ``gl4 backward ≤ 2 × gl4 forward``. Also per step of a chain of 10 steps
  (each from the last one's output, as in a solve or a stack of layers: gl4 then starts from the previous step's
  collocation polynomial and simplified Newton reuses the chain's factored matrix, and rk4's field constants are
  already built), with each chained step's evaluations.
- Cost against the step size (``cost_vs_step``): chained steps (chains of 20, each from the last one's output; the
  default ``Newton("auto")``, stages to rounding) of gl4 against rk4 at ``h`` = 0.2, 0.1, 0.05, 0.02, 0.01, dim 4
  and 64, batch 256, one thread, CPU time, all timed alternately in one run; gl4 with its default start (the
  collocation extrapolation corrected by the last three prediction errors, :mod:`solvers.steppers.implicit_predictor`)
  and with the extrapolation alone (``StagePredictor(history=0)``, the start before the correction). With what
  sets a gl4 step's cost at each ``h``: the fixed-point iterations per chained step (evaluations / 2, steps
  2–20), the observed contraction ``θ`` (the slowest sample's, as the stopping rule measures it) beside ``h L``
  (``L``: the largest per-sample ``‖∂F/∂y‖₂`` at the start), the start error ``‖Z⁰ − Z‖_∞`` of each start
  against the converged stages (median over the steps), and a floor: the iterations' field calls alone (one
  call on ``2 × 256`` rows each, timed on their own in the same run) over the rk4 step, the ratio if the loop
  around the calls cost nothing. The iterations from the start error to rounding at rate ``θ`` fall as ``h``
  falls (``θ = O(h)``, start error ``O(h³)`` and less), so this says at which step sizes ``gl4 ≤ 3 × rk4``
  holds and why not at ``h = 0.1``.

``python -m cde_nets.benchmarks.implicit_methods [--tiny]`` writes ``benchmarks/results/implicit_methods.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from torch import nn

from cde_nets import ODEBlock
from cde_nets.fields import Hamiltonian
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.schemes import GL4, get_scheme
from cde_nets.solvers.steppers.implicit import Newton, get_tableau, implicit_step, stage_jacobian
from cde_nets.solvers.steppers.implicit_predictor import HISTORY, StagePredictor

from .common import interleaved_medians, write


class VanDerPol(nn.Module):
    def __init__(self, mu: float):
        super().__init__()
        self.mu = mu

    def forward(self, t, y):
        x, v = y[:, :1], y[:, 1:]
        return torch.cat([v, self.mu * (1 - x**2) * v - x], 1)


def _reference(mu: float, T: float) -> np.ndarray:
    from scipy.integrate import solve_ivp

    sol = solve_ivp(
        lambda t, y: [y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]],
        (0.0, T),
        [2.0, 0.0],
        method="Radau",
        rtol=1e-10,
        atol=1e-12,
    )
    return sol.y[:, -1]


def stiff(tiny: bool) -> list[dict]:
    mu, T = (10.0, 2.0) if tiny else (1000.0, 20.0)
    ref = _reference(mu, T)
    y0 = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    field = VanDerPol(mu)
    runs: list[tuple[str, dict]] = [
        (m, {"step_size": T / n})
        for m in ("radauIIA5", "radauIIA3", "gl4", "trbdf2", "sdirk2", "implicit_euler")
        for n in ((20,) if tiny else (20, 40, 80))
    ]
    runs += [("dopri5", {"rtol": r, "atol": r}) for r in ((1e-6,) if tiny else (1e-6, 1e-8))]
    rows = []
    for method, kw in runs:
        block = ODEBlock(field, T=T, method=method, **kw, options={"max_num_steps": 1_000_000})
        start = time.perf_counter()
        with torch.no_grad():
            sol = block.solve(y0)
            y = sol.y[0].numpy()
        wall = time.perf_counter() - start
        rows.append(
            {
                "problem": f"van der pol mu={mu:g}",
                "method": method,
                **{k: v for k, v in kw.items() if k != "atol"},
                "steps": sol.stats["steps_forward"] + sol.stats["rejected_forward"],
                "nfe": sol.stats["nfe_forward"],
                "time_s": wall,
                "rel_error": float(np.abs(y - ref).max() / np.abs(ref).max()),
            }
        )
    return rows


def _step_fns(sch, bound, y0: torch.Tensor, params: list):
    """One step forward (no graph) and forward + backward (to ``y0`` and ``params``)."""

    def fwd():
        with torch.no_grad():
            return sch.step(bound, 0, (y0,), 0.1, None, 0.0)

    def fwd_bwd():
        y = y0.clone().requires_grad_(True)
        loss = sch.step(bound, 0, (y,), 0.1, None, 0.0)[0].square().sum()
        torch.autograd.grad(loss, [y, *params])

    def chain():  # CHAIN steps, each from the last one's output: an implicit step starts from its prediction
        state = (y0,)
        with torch.no_grad():
            for _ in range(CHAIN):
                state = sch.step(bound, 0, state, 0.1, None, 0.0)

    return [fwd, fwd_bwd, chain]


CHAIN = 10


def _chain_nfe(sch, bound, y0: torch.Tensor) -> list[int]:
    """The evaluations of each step of a chain (Newton iterations included)."""
    state, nfe = (y0,), []
    with torch.no_grad():
        for _ in range(CHAIN):
            state = sch.step(bound, 0, state, 0.1, None, 0.0)
            nfe.append(sch.evaluations(0))
    return nfe


def cost(tiny: bool) -> list[dict]:
    rows = []
    for dim in (4,) if tiny else (4, 64):
        batch = 16 if tiny else 256
        f = Hamiltonian(dim, generator=torch.Generator().manual_seed(0)).double()
        y0 = torch.randn(batch, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        bound, times, fns = BoundField(f), {}, []
        schemes = {"rk4": get_scheme("rk4"), "gl4": get_scheme("gl4"), "gl4_simplified": GL4(Newton("simplified"))}
        for name, sch in schemes.items():
            schemes[name] = sch = sch.for_field(f)
            fns += _step_fns(sch, bound, y0, list(f.parameters()))
        # run alternately, so that the load of a shared machine hits every method alike; CPU time, which a loaded
        # machine's preemption does not inflate (a 20 ms step is preempted far more often than a 0.2 ms one)
        medians = interleaved_medians(fns, repeat=3 if tiny else 25, warmup=1 if tiny else 2, clock=time.process_time)
        for i, (name, sch) in enumerate(schemes.items()):
            times[name] = (medians[3 * i], medians[3 * i + 1], medians[3 * i + 2] / CHAIN)
            sch.step(bound, 0, (y0,), 0.1, None, 0.0)
            times[name + "_nfe"] = sch.evaluations(0)
            chained = _chain_nfe(sch, bound, y0)
            times[name + "_chain_nfe"] = chained
        (rf, rfb, rc), (gf, gfb, gc), (pf, pfb, pc) = times["rk4"], times["gl4"], times["gl4_simplified"]
        rows.append(
            {
                "dim": dim,
                "batch": batch,
                "rk4_forward_s": rf,
                "rk4_forward_backward_s": rfb,
                "gl4_forward_s": gf,
                "gl4_forward_backward_s": gfb,
                "gl4_nfe_per_step": times["gl4_nfe"],
                "gl4_over_rk4_forward": gf / rf,
                "gl4_backward_over_forward": (gfb - gf) / gf,
                "gl4_simplified_forward_s": pf,
                "gl4_simplified_forward_backward_s": pfb,
                "gl4_simplified_nfe_per_step": times["gl4_simplified_nfe"],
                "gl4_simplified_over_rk4_forward": pf / rf,
                "gl4_simplified_backward_over_forward": (pfb - pf) / pf,
                "chain": CHAIN,
                "rk4_chain_step_s": rc,
                "gl4_chain_step_s": gc,
                "gl4_chain_nfe_per_step": times["gl4_chain_nfe"],
                "gl4_chain_over_rk4_chain": gc / rc,
                "gl4_simplified_chain_step_s": pc,
                "gl4_simplified_chain_nfe_per_step": times["gl4_simplified_chain_nfe"],
                "gl4_simplified_chain_over_rk4_chain": pc / rc,
            }
        )
    return rows


STEPS = (0.2, 0.1, 0.05, 0.02, 0.01)


STEP_CHAIN = 20


def _chain_at(sch, bound, y0: torch.Tensor, h: float) -> None:
    state = (y0,)
    for _ in range(STEP_CHAIN):
        state = sch.step(bound, 0, state, h, None, 0.0)


def _iterations(f, y0: torch.Tensor, h: float, history: int) -> dict:
    """gl4's chained steps at ``h`` taken as a solve takes them (each from the last output, started from the
    predictor with ``history`` past errors, the chain's carry): per step after the first, the evaluations, the
    start error, and the observed contraction rate."""
    bound, tab, pred, y = BoundField(f), get_tableau("gl4"), StagePredictor(history), y0
    nfe, start, rate = [], [], []
    for _ in range(STEP_CHAIN):
        fun = _Counted(bound)
        guess, carry, info = pred.guess(tab, y, h, 0), pred.carry(y), {}
        y1, _ = implicit_step(fun, 0.0, y, h, tab, Newton(), batched=True, info=info, guess=guess, carry=carry)
        Z = info["stages"]
        if guess is not None:
            nfe.append(fun.n)
            start.append(float((guess - Z).abs().max()))
            rate.append(carry.rates.get("fixed_point", float("nan")))
        pred.record(y1, h, Z, info["kind"])
        y = y1
    return {
        "nfe_per_step": nfe,
        "iterations_per_step": float(np.mean(nfe)) / tab.stages,  # one batched call of the stages per iteration
        "theta_observed": float(np.median(rate)),
        "start_error": float(np.median(start)),
    }


class _Counted:
    def __init__(self, bound):
        self.bound, self.n = bound, 0

    def __call__(self, t, y):
        self.n += 1
        return self.bound.evaluate(0, y, t=t)

    def count(self, k: int) -> None:
        self.n += k


def cost_vs_step(tiny: bool) -> list[dict]:
    """The chained gl4 / rk4 ratio and what sets it, per step size (see the module); CPU time."""
    rows = []
    for dim in (4,) if tiny else (4, 64):
        rows += _cost_vs_step(dim, 16 if tiny else 256, (0.1, 0.01) if tiny else STEPS, tiny)
    return rows


def _cost_vs_step(dim: int, batch: int, steps: tuple[float, ...], tiny: bool) -> list[dict]:
    f = Hamiltonian(dim, generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(batch, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    bound, y2, rows = BoundField(f), torch.cat([y0, y0]), []
    rk4, gl4, alone = (get_scheme(m).for_field(f) for m in ("rk4", "gl4", "gl4"))
    alone._chain = StagePredictor(history=0)  # the start before the error correction
    with torch.no_grad():
        jac = stage_jacobian(lambda t, x: bound.evaluate(0, x, t=t), 0.0, y0)[1]
        L = float(torch.linalg.matrix_norm(jac, 2).max())
        fns = [lambda x=x: [bound.evaluate(0, x, t=0.0) for _ in range(STEP_CHAIN)] for x in (y0, y2)]
        for h in steps:
            fns += [lambda h=h, sch=sch: _chain_at(sch, bound, y0, h) for sch in (rk4, gl4, alone)]
        medians = interleaved_medians(fns, repeat=3 if tiny else 25, warmup=1 if tiny else 2, clock=time.process_time)
        call, call2 = medians[0] / STEP_CHAIN, medians[1] / STEP_CHAIN
        for i, h in enumerate(steps):
            rk, gl, gl_alone = (m / STEP_CHAIN for m in medians[2 + 3 * i : 5 + 3 * i])
            it, it_alone = _iterations(f, y0, h, HISTORY), _iterations(f, y0, h, 0)
            rows.append(
                {
                    "dim": dim,
                    "batch": batch,
                    "h": h,
                    "chain": STEP_CHAIN,
                    "hL": h * L,
                    "theta_observed": it["theta_observed"],
                    "iterations_per_step": it["iterations_per_step"],
                    "start_error": it["start_error"],
                    "nfe_per_step": it["nfe_per_step"],
                    "extrapolation_only_iterations_per_step": it_alone["iterations_per_step"],
                    "extrapolation_only_start_error": it_alone["start_error"],
                    "rk4_chain_step_s": rk,
                    "gl4_chain_step_s": gl,
                    "gl4_chain_over_rk4_chain": gl / rk,
                    "extrapolation_only_chain_step_s": gl_alone,
                    "extrapolation_only_over_rk4_chain": gl_alone / rk,
                    "field_call_s": call,
                    "field_call_2x_rows_s": call2,
                    "calls_floor_over_rk4": it["iterations_per_step"] * call2 / rk,
                }
            )
    return rows


def run(tiny: bool = False, out_dir=None) -> dict:
    start, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time of one thread: a second one's spinning would be counted too
    payload = {
        "setting": "stiff: Van der Pol mu=1000 on [0, 20] from (2, 0), float64, error vs scipy Radau rtol 1e-10; "
        "cost: one step h=0.1 on the H1 field, batch 256, float64; cost_vs_step: chains of 20 steps, "
        "h = 0.2 ... 0.01; one thread, CPU time",
        "goal": "gl4 forward <= 3x rk4 forward; gl4 backward <= 2x gl4 forward",
        "rows": stiff(tiny),
        "cost": cost(tiny),
        "cost_vs_step": cost_vs_step(tiny),
    }
    payload["time_s"] = time.perf_counter() - start
    payload["load_average"] = os.getloadavg()
    write("implicit_methods", payload, out_dir)
    torch.set_num_threads(threads)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| method | setting | steps | NFE | time s | rel. error |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        setting = f"h = {r['step_size']:g}" if "step_size" in r else f"rtol {r['rtol']:.0e}"
        print(f"| {r['method']} | {setting} | {r['steps']} | {r['nfe']} | {r['time_s']:.3f} | {r['rel_error']:.1e} |")
    print("\n| dim | Newton | rk4 fwd ms | gl4 fwd ms | gl4 NFE | gl4/rk4 fwd | gl4 bwd/fwd | chained gl4/rk4 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["cost"]:
        for kind, key in (("auto", "gl4"), ("simplified", "gl4_simplified")):
            print(
                f"| {r['dim']} | {kind} | {1e3 * r['rk4_forward_s']:.2f} | {1e3 * r[key + '_forward_s']:.2f} | "
                f"{r[key + '_nfe_per_step']} | {r[key + '_over_rk4_forward']:.2f} | "
                f"{r[key + '_backward_over_forward']:.2f} | {r[key + '_chain_over_rk4_chain']:.2f} |"
            )
    print(
        "\n| dim | h | h L | θ observed | start error (extrapolation alone) | iterations / step (alone) | "
        "rk4 chained ms | gl4 chained ms | gl4 / rk4 chained (alone) | calls alone / rk4 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["cost_vs_step"]:
        print(
            f"| {r['dim']} | {r['h']:g} | {r['hL']:.3f} | {r['theta_observed']:.3f} | {r['start_error']:.1e} "
            f"({r['extrapolation_only_start_error']:.1e}) | {r['iterations_per_step']:.2f} "
            f"({r['extrapolation_only_iterations_per_step']:.2f}) | {1e3 * r['rk4_chain_step_s']:.3f} | "
            f"{1e3 * r['gl4_chain_step_s']:.3f} | {r['gl4_chain_over_rk4_chain']:.2f} "
            f"({r['extrapolation_only_over_rk4_chain']:.2f}) | {r['calls_floor_over_rk4']:.2f} |"
        )


if __name__ == "__main__":
    main()
