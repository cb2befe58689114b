"""The whole benchmark suite from one command: ``python -m cde_nets.benchmarks [--tiny] [--only NAME ...]``.

Runs every module of :data:`BENCHMARKS` (each writes ``benchmarks/results/<name>.json``; ``--tiny`` runs write
to a temporary folder), then prints one summary
table: each benchmark's headline ratios against its goal. A new benchmark module is added to the table below;
``tests/experiments/test_benchmarks.py`` fails while one is missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cde_nets.solvers.errors import did_you_mean

from .summary import Row, at_least, at_most, below, info, table

Headline = list[Row]


def _max(rows: list[dict], key: str, **where) -> float | None:
    vals = [r[key] for r in rows if key in r and all(r.get(k) == v for k, v in where.items())]
    return max(vals) if vals else None


def _discrete(res: dict) -> Headline:
    rows = res["rows"]
    out = [
        at_most(f"ours / hand loop, {mode}, worst", _max(rows, "ratio_hand", mode=mode), 1.1)
        for mode in ("forward", "forward+backward")
    ]
    return out + [info("torchdiffeq euler / hand loop, worst", _max(rows, "ratio_torchdiffeq_to_hand"))]


def _continuous(res: dict) -> Headline:
    rows = res["rows"]
    same = all(r["nfe_ours"] == r["nfe_torchdiffeq"] for r in rows)
    return [
        at_most("ODEBlock / odeint, worst", _max(rows, "ratio"), 1.05),
        Row("same NFE", same, goal="True", met=same),
    ]


def _memory(res: dict) -> Headline:
    s = res["summary"]
    d = res["discrete_summary"]
    return [
        at_most("adjoint memory, most / fewest steps", s["adjoint"]["ratio_max_to_min_steps"], 1.2, ".2f"),
        info("backprop KiB per step", s["backprop"]["bytes_per_step"] / 1024, ".1f"),
        at_most(
            "memory-free discrete memory, most / fewest layers, worst",
            max(v["memory_ratio"] for v in d.values()),
            1.2,
            ".2f",
        ),
        at_most("memory-free H2-DNN time / stored activations", d["H2-DNN"]["time_ratio_to_stored"], 2.0, ".2f"),
    ]


def _jump(res: dict) -> Headline:
    rows = res["rows"]
    with_j = sum(r["nfe_forward"] for r in rows if r["jumps"])
    without = sum(r["nfe_forward"] for r in rows if not r["jumps"])
    return [below("forward NFE with / without jump_t", with_j / without if without else None, 1.0)]


def _adjoint_study(res: dict) -> Headline:
    first = res["rows"][0].get("problem")  # the first problem (a seed's field); refused cells carry no numbers
    rows = [r for r in res["rows"] if r["method"] == "dopri5" and r.get("problem") == first and r["time_s"]]
    tight = min(r["rtol"] for r in rows)

    def pick(mode):
        return next(r for r in rows if r["mode"] == mode and r["rtol"] == tight)

    a, b = pick("adjoint"), pick("backprop")
    memory = a["peak_saved_bytes"] / b["peak_saved_bytes"] if b["peak_saved_bytes"] else None
    return [
        info(f"adjoint / backprop time, dopri5 rtol {tight:g}", a["time_s"] / b["time_s"], ".2f"),
        below(f"adjoint / backprop memory, dopri5 rtol {tight:g}", memory, 1.0),
    ]


def _stopping(res: dict) -> Headline:
    return [
        at_most(f"max deviation from c·Σdepths + t0, {mode}", f["max_rel_deviation"], 0.2, ".1%")
        for mode, f in res["fit"].items()
    ]


def _stopping_saving(res: dict) -> Headline:
    out = [below(f"per-sample stop / whole-batch time, {r['mode']}", r["time_ratio"], 1.0) for r in res["timings"]]
    return out + [below("field rows, per-sample stop / whole batch", res["rows_ratio"], 1.0)]


def _peer(res: dict) -> Headline:
    if "skipped" in res:
        return [info("momentumnet", f"not measured ({res['skipped']})")]
    out = []
    for r in res["rows"]:
        kind = "memory-free" if r["memory_free"] else "stored"
        out.append(info(f"ours / momentumnet time, depth {r['depth']}, {kind}", r["time_ratio"], ".2f"))
        out.append(info(f"ours / momentumnet memory, depth {r['depth']}, {kind}", r["memory_ratio"], ".2f"))
    worst = max(r["max_abs_diff_output"] for r in res["rows"])
    return out + [below("max abs. output difference from momentumnet (float64)", worst, 1e-10, ".1e")]


def _training(res: dict) -> Headline:
    return [
        at_most("64-layer H1 swiss roll: wall time / reference's 36 s", res["time_ratio_to_reference"], 1.0, ".2f"),
        at_least("64-layer H1 swiss roll: test accuracy", res["test_accuracy"], 0.99, ".2%"),
    ]


def _adjoint_pieces(res: dict) -> Headline:
    out = []
    for case, growth in res["per_piece_growth"].items():
        rows = [r for r in res["rows"] if f"dim={r['dim']} batch={r['batch']}" == case]
        top = max(rows, key=lambda r: r["pieces"])
        out += [
            at_most(f"adjoint / backprop, {top['pieces']} pieces, {case}", top["new_over_backprop"], 3.0, ".2f"),
            at_most(f"adjoint time per piece, most / fewest pieces, {case}", growth["new_adjoint"], 1.2, ".2f"),
        ]
    return out


def _gradient_modes(res: dict) -> Headline:
    met = [(f, k) for f, t in res["targets"].items() for k, v in t.items() if v["met"]]
    total = sum(len(t) for t in res["targets"].values())
    worst = max(
        v["value"] for t in res["targets"].values() for k, v in t.items() if k == "exact_vs_backprop_same_steps"
    )
    return [
        Row("targets of the study met", f"{len(met)} of {total}", goal=f"{total} of {total}", met=len(met) == total),
        at_most("checkpoint/symplectic vs backprop, same steps", worst, 1e-10, ".1e"),
    ]


def _compiled(res: dict) -> Headline:
    rows = res["rows"]
    return [
        info(f"compiled / eager speed-up, {mode}, worst", min(r["speedup"] for r in rows if r["mode"] == mode), ".2f")
        for mode in ("forward", "forward+backward")
    ] + [at_most("max relative difference from eager", max(r["max_rel_diff"] for r in rows), 1e-5, ".1e")]


def _compiled_step(res: dict) -> Headline:
    return [at_most(r["name"], r["ratio"], r["goal"], ".3f") for r in res["rows"] if r["ratio"] is not None] + [
        info("compile, spiral's first iteration, s", res["spiral"]["compiled"]["compile_s"], ".1f")
    ]


def _forward_grid(res: dict) -> Headline:
    rows = res["rows"]
    wide = [r["ours_over_fe"] for r in rows if r["dim"] >= 64]
    out = [
        at_most("forward / field evaluations alone, dim >= 64, worst", max(wide) if wide else None, 1.5, ".2f"),
        at_most("forward / field evaluations alone, dim 4, worst", _max(rows, "ours_over_fe", dim=4), 2.5, ".2f"),
    ]
    fwd = [r["torchode_over_ours"] for r in rows if r.get("torchode_over_ours") is not None]
    fb = [r["torchode_autodiff_over_ours_backprop"] for r in rows if r.get("torchode_autodiff_over_ours_backprop")]
    if not fwd:
        return out + [info("torchode / ours", "not measured (torchode not installed)")]
    out.append(below("ours / torchode, forward, worst", 1 / min(fwd), 1.0, ".2f"))
    if fb:
        out.append(below("ours / torchode, forward+backward, worst", 1 / min(fb), 1.0, ".2f"))
    return out


def _events(res: dict) -> Headline:
    r = res["rows"][0]
    return [
        at_most("per-sample events / ideal compacted cost", r["ratio_to_ideal"], 1.2, ".2f"),
        info("odeint_event sample by sample / ours", r["ratio_per_sample_to_ours"], ".1f"),
    ]


def _finiteness(res: dict) -> Headline:
    return [at_most("finiteness check / forward call, worst", res["worst_overhead"], 0.03, "+.1%")]


def _dropin(res: dict) -> Headline:
    rows = res["rows"]
    out = [
        at_most(f"cde_nets.odeint / torchdiffeq.odeint, {m}, worst", _max(rows, "ratio", mode=m), 0.8)
        for m in ("forward", "forward+backward")
    ]
    for dtype, sp in res["spiral"].items():
        same = sp["torchdiffeq_steps"]
        out.append(at_most(f"ode_demo spiral, {dtype}: time ratio", sp["ratio"], 0.8))
        out.append(
            info(
                f"ode_demo spiral, {dtype}: max abs. loss difference, steps differentiated", sp["max_loss_diff"], ".1e"
            )
        )
        out.append(
            at_most(
                f"ode_demo spiral, {dtype}: max abs. loss difference, steps='torchdiffeq'",
                same["max_loss_diff"],
                1e-5,
                ".1e",
            )
        )
    return out


def _suite(res: dict) -> Headline:
    c = res["counts"]
    passed = f"{c['pass']} / {c['fail']} / {c['error']} / {c['not_served']}"
    return [info("torchdiffeq's suite: pass / fail / error / not served", passed, "s")]


def _implicit(res: dict) -> Headline:
    cost = res["cost"]
    nfe = {r["method"]: r["nfe"] for r in res["rows"] if r.get("step_size", 1.0) == 1.0}
    ratio = nfe["radauIIA5"] / nfe["dopri5"] if {"radauIIA5", "dopri5"} <= set(nfe) else None
    by_h: dict[float, list[float]] = {}
    for r in res.get("cost_vs_step", []):
        by_h.setdefault(r["h"], []).append(r["gl4_chain_over_rk4_chain"])
    return [
        at_most("gl4 / rk4 forward step, worst", max(r["gl4_over_rk4_forward"] for r in cost), 3.0, ".2f"),
        at_most("gl4 backward / its forward, worst", max(r["gl4_backward_over_forward"] for r in cost), 2.0, ".2f"),
        below("stiff Van der Pol: radauIIA5 NFE / dopri5 NFE", ratio, 1.0, ".4f"),
    ] + [info(f"gl4 / rk4 chained step, h = {h:g}, worst dim", max(by_h[h]), ".2f") for h in sorted(by_h, reverse=True)]


def _implicit_tolerance(res: dict) -> Headline:
    def label(tol) -> str:
        return "to rounding" if tol is None else f"tol {tol:.0e}"

    out = []
    for r in res["rows"]:
        slope = r["slope_over_rk4"]
        out.append(at_most(f"gl4 drift slope / rk4's, {label(r['tol'])}", slope, 1e-3, ".1e"))
        dims = {c["dim"]: c["gl4_over_rk4"] for c in res["cost"] if c["tol"] == r["tol"]}
        out += [info(f"gl4 / rk4 chained step, dim {d}, {label(r['tol'])}", v, ".2f") for d, v in dims.items()]
    return out


def _per_sample(res: dict) -> Headline:
    rows = res["rows"]

    def pick(case: str, mode: str) -> dict:
        return next(r for r in rows if r["case"] == case and r["mode"] == mode)

    mixed, equal = pick("mixed", "forward"), pick("equal", "forward")
    out = [
        below("per-sample / shared batched calls, mixed μ", mixed["per_sample_nfe"] / mixed["shared_nfe"], 1.0, ".2f"),
        at_most("per-sample / shared time, equal μ, forward", equal["ratio"], 1.1, ".2f"),
    ]
    return out + [info(f"per-sample / shared time, {r['case']}, {r['mode']}", r["ratio"], ".2f") for r in rows]


def _ensembles(res: dict) -> Headline:
    rows = {r["members"]: r for r in res["rows"]}
    mid = rows.get(256) or rows[max(rows)]
    m = mid["members"]
    out = [at_most(f"vmap / hand-stacked field, {m} members", mid["vmap_over_stacked"], 1.2, ".2f")]
    for name in ("vmap_block", "vmap_per_evaluation"):
        if f"{name}_over_stacked" in mid:
            out.append(info(f"{name} / hand-stacked field, {m} members", mid[f"{name}_over_stacked"], ".2f"))
    return out + [info(f"loop / vmap, {n} members", r["loop_over_vmap"], ".1f") for n, r in rows.items()]


def _per_sample_device(res: dict) -> Headline:
    return [
        info(f"{k.removesuffix('_over_shared')} / shared, {r['case']} batch {r['batch']}, {r['mode']}", v, ".2f")
        for r in res["rows"]
        for k, v in r.items()
        if k.endswith("_over_shared")
    ]


def _forward_sensitivity(res: dict) -> Headline:
    rows = res["rows"]
    worst = max(r["forward_rel_diff_from_backprop"] for r in rows)
    return [
        at_most("forward / backprop gradient, worst relative difference", worst, 1e-10, ".1e"),
        info("forward / reverse crossover, parameters", res["crossover_params"], ".0f"),
        info(
            f"forward / best reverse time, {rows[0]['params']} parameters", rows[0]["forward_over_best_reverse"], ".2f"
        ),
        info(
            f"forward / best reverse time, {rows[-1]['params']} parameters",
            rows[-1]["forward_over_best_reverse"],
            ".1f",
        ),
    ]


def _default_gradient(res: dict) -> Headline:
    rows = res["rows"]
    small = [r for r in rows if r["backprop_peak_bytes"] <= 64 * 2**20]

    def default_over_fastest(r: dict) -> float:
        return r[f"{r['default']}_s"] / min(r["backprop_s"], r["checkpoint_s"])

    ratios = [r["checkpoint_over_backprop"] for r in rows]
    biggest = max(rows, key=lambda r: r["backprop_peak_bytes"])
    return [
        at_most(
            "default / faster exact gradient, time, where backprop keeps <= 64 MiB, worst",
            max(map(default_over_fastest, small)) if small else None,
            1.05,
            ".2f",
        ),
        info("checkpoint / backprop time, fewest-most", f"{min(ratios):.2f}-{max(ratios):.2f}", "s"),
        info(
            f"backprop / checkpoint memory, {biggest['case']} {biggest['solver']}",
            biggest["backprop_peak_bytes"] / biggest["checkpoint_peak_bytes"],
            ".1f",
        ),
    ]


def _interpolating(res: dict) -> Headline:
    vdp = {r["gradient"]: r for r in res["van_der_pol"]}
    slopes = res["slopes"]
    over = {r["gradient"]: r["over_backprop"] for r in res["timing"]}
    return [
        at_most(
            "interpolating / backprop gradient, stiff Van der Pol",
            vdp["interpolating"].get("rel_error_from_backprop"),
            1e-4,
            ".1e",
        ),
        info("adjoint on stiff Van der Pol", vdp.get("adjoint", {}).get("reason", "not run"), "s"),
        info("interpolating states kept per step (rk4)", slopes["interpolating"]["states_per_step"], ".2f"),
        info("checkpoints=10 states kept per step", slopes["interpolating_checkpoints_10"]["states_per_step"], ".2f"),
        info("interpolating / backprop time, MLP", over["interpolating"], ".2f"),
    ]


def _gauss_adjoint(res: dict) -> Headline:
    rows = res["rows"]
    worst = max(r["gauss_rel_diff_from_backprop"] for r in rows)
    return [
        at_most("gauss / backprop gradient, worst relative difference", worst, 1e-4, ".1e"),
        info("gauss / adjoint crossover, parameters", res["crossover_params"], ".0f"),
        info(f"gauss / adjoint time, {rows[-1]['params']} parameters", rows[-1]["gauss_over_adjoint"], ".2f"),
        *(
            info(f"gauss / adjoint time, {r['params']} parameters, batch {r['batch']}", r["gauss_over_adjoint"], ".2f")
            for r in res["batch_rows"]
        ),
    ]


def _reversible_rk(res: dict) -> Headline:
    s = res["summary"]
    undamped = [r["rebuild_error"] for r in res["stability"] if r["damping"] == 0.0]
    return [
        at_most(
            "reversible_rk4 saved bytes, most / fewest steps",
            s["reversible_rk4 reversible"]["ratio_max_to_min_steps"],
            1.0,
        ),
        info("checkpoint saved bytes per step", s["rk4 checkpoint"]["bytes_per_step"], ".0f"),
        at_most("rebuild error, undamped oscillator, worst", max(undamped), 1e-9, ".1e"),
    ]


def _binomial_checkpoint(res: dict) -> Headline:
    rows = res["rows"]
    kept = all(r["stored_states"] <= r["budget"] for r in rows if r["budget"] != "all")
    ratios = [r["recomputed_steps"] / r["offline_optimum"] for r in rows if r["offline_optimum"]]
    small, full = rows[0], rows[-1]
    out = [
        Row("states kept <= budget", kept, goal="True", met=kept),
        at_most("recomputed / offline optimum, worst", max(ratios) if ratios else None, 1.05),
        info(f"time, budget {small['budget']} / every state", small["time_over_all"], ".2f"),
    ]
    if "peak_over_all" in small:
        out.append(info(f"peak memory, budget {small['budget']} / every state", small["peak_over_all"], ".3f"))
    return out + [info("peak memory rise, every state, MiB", (full["peak_rss_rise_bytes"] or 0) / 2**20, ".1f")]


def _mixed_precision(res: dict) -> Headline:
    rows = {r["problem"]: r for r in res["rows"]}
    worst = max(rows[p]["diff_over_tolerance"] for p in ("spiral", "digits"))
    return [
        at_most("bfloat16 vs float32 mean final loss: difference / tolerance, worst", worst, 1.0, ".2f"),
        *(info(f"bfloat16 / float32 saved bytes, {p}", r["saved_ratio"], ".2f") for p, r in rows.items()),
        *(info(f"bfloat16 / float32 step time, {p}", r["time_ratio"], ".2f") for p, r in rows.items()),
    ]


# (module, headline of its result, goal): every benchmark module of this package.
BENCHMARKS: tuple[tuple[str, Callable[[dict], Headline], str], ...] = (
    ("discrete_overhead", _discrete, "<= 1.1"),
    ("continuous_overhead", _continuous, "<= 1.05, same NFE"),
    ("memory_scaling", _memory, "adjoint <= 1.2; backprop linear; memory-free discrete <= 1.2, H2 time <= 2"),
    ("jump_nfe", _jump, "fewer NFE with jump_t"),
    ("adjoint_study", _adjoint_study, "adjoint memory below backprop"),
    ("adjoint_pieces", _adjoint_pieces, "<= 3; <= 1.2"),
    ("stopping_scaling", _stopping, "<= 20 %"),
    ("stopping_saving", _stopping_saving, "< 1"),
    ("momentum_peer", _peer, "outputs equal (< 1e-10)"),
    ("training", _training, "<= 1 and >= 99 %"),
    ("gradient_modes", _gradient_modes, "exact <= 1e-10; memory and time targets"),
    ("events", _events, "<= 1.2"),
    ("forward_grid", _forward_grid, "<= 1.5 (dim >= 64), <= 2.5 (dim 4); torchode / ours > 1"),
    ("compiled", _compiled, "<= 1e-5 from eager"),
    (
        "compiled_step",
        _compiled_step,
        "spiral <= 0.25x; small <= 0.25x/0.3x torchdiffeq, <= 1x field loop; large <= 1.05x",
    ),
    ("finiteness", _finiteness, "<= 3 %"),
    ("torchdiffeq_dropin", _dropin, "<= 0.8; losses with steps='torchdiffeq' equal to 1e-5"),
    ("torchdiffeq_suite", _suite, "every case but the unserved methods passes"),
    ("implicit_methods", _implicit, "gl4 fwd <= 3x rk4; bwd <= 2x fwd; stiff: fewer NFE than dopri5"),
    ("implicit_tolerance", _implicit_tolerance, "drift <= 1e-3 of rk4's; the cost of each stage tolerance"),
    ("per_sample", _per_sample, "fewer batched calls on mixed μ; <= 1.1 on equal μ"),
    ("per_sample_device", _per_sample_device, "measured on a GPU (the CPU in --tiny)"),
    ("ensembles", _ensembles, "vmap of 256 members <= 1.2x the hand-stacked field, far below the loop"),
    ("forward_sensitivity", _forward_sensitivity, "equal to backprop (1e-10); the crossover recorded"),
    ("default_gradient", _default_gradient, "the default within 1.05 of the faster exact gradient while small"),
    ("interpolating_adjoint", _interpolating, "<= 1e-4 from backprop where the backsolve adjoint fails"),
    ("gauss_adjoint", _gauss_adjoint, "equal to backprop within 1e-4 (rtol 1e-6); the crossover recorded"),
    ("binomial_checkpoint", _binomial_checkpoint, "states kept <= budget; recomputed <= 1.05 x offline optimum"),
    ("reversible_rk", _reversible_rk, "reversible memory flat (1.0); rebuild <= 1e-9"),
    ("mixed_precision", _mixed_precision, "bfloat16 final loss within 2 sd of float32's seeds; memory, time"),
)


# Seconds per benchmark, for the help listing: `--tiny` measured once on the 2-core development machine (shared
# with other work, so upper bounds); full runs from the recorded result's own time where it keeps one.
MEASURED_S: dict[str, dict[str, float]] = {
    "discrete_overhead": {"tiny": 0.1},
    "continuous_overhead": {"tiny": 3.6},
    "memory_scaling": {"tiny": 0.6},
    "jump_nfe": {"tiny": 0.9},
    "adjoint_study": {"tiny": 63.1},
    "adjoint_pieces": {"tiny": 0.2},
    "stopping_scaling": {"tiny": 0.5},
    "stopping_saving": {"tiny": 2.3},
    "momentum_peer": {"tiny": 0.0},  # skipped: the peer package (momentumnet) was not installed
    "training": {"tiny": 0.2},
    "gradient_modes": {"tiny": 33.0},
    "events": {"tiny": 3.0},
    "forward_grid": {"tiny": 2.0},
    "compiled": {"tiny": 14.0},
    "compiled_step": {"tiny": 31.0},
    "finiteness": {"tiny": 1.0, "full": 60.0},
    "torchdiffeq_dropin": {"tiny": 1.0},
    "torchdiffeq_suite": {"tiny": 0.1, "full": 290.0},
    "implicit_methods": {"tiny": 0.4},
    "implicit_tolerance": {"tiny": 1.0},
    "per_sample": {"tiny": 1.0},
    "per_sample_device": {"tiny": 6.0},
    "ensembles": {"tiny": 6.0},
    "forward_sensitivity": {"tiny": 1.0},
    "default_gradient": {"tiny": 1.0},
    "interpolating_adjoint": {"tiny": 2.0},
    "gauss_adjoint": {"tiny": 1.0},
    "binomial_checkpoint": {"tiny": 0.5, "full": 60.0},
    "reversible_rk": {"tiny": 2.0},
    "mixed_precision": {"tiny": 4.0, "full": 465.0},
}


def _times(name: str) -> dict[str, float]:
    out = dict(MEASURED_S.get(name, {}))
    recorded = Path(__file__).parent / "results" / f"{name}.json"
    if recorded.exists():
        import json

        time_s = json.loads(recorded.read_text()).get("time_s")
        if isinstance(time_s, (int, float)):
            out.setdefault("full", float(time_s))
    return out


def listing() -> str:
    """The benchmarks, one a line: name, seconds with ``--tiny`` and in full (— where never timed), goal."""

    def sec(s: float | None) -> str:
        if s is None:
            return "—"
        return "<1 s" if s < 1 else (f"{s:.0f} s" if s < 100 else f"{s / 60:.0f} min")

    lines = [f"  {'name':22s} {'tiny':>7s} {'full':>7s}  goal"]
    for name, _, goal in BENCHMARKS:
        t = _times(name)
        lines.append(f"  {name:22s} {sec(t.get('tiny')):>7s} {sec(t.get('full')):>7s}  {goal}")
    return "\n".join(lines)


_DESCRIPTION = """\
Runs every benchmark (or those named with --only), writes each one's JSON to benchmarks/results/ (with --tiny to a
temporary folder) and prints one summary table. A full run compares each headline with its goal; --tiny runs
check that every benchmark works in seconds and measure no speed."""


def main(argv: list[str] | None = None, prog: str = "python -m cde_nets.benchmarks") -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"benchmarks (seconds on 2 CPU cores; — where never timed):\n{listing()}",
    )
    p.add_argument("--tiny", action="store_true", help="tiny configurations (seconds; what the tests run)")
    p.add_argument("--only", nargs="*", help="names of benchmarks to run (default: all)")
    p.add_argument(
        "--out",
        help="folder for the JSON results (default: benchmarks/results; with --tiny a temporary "
        "folder, so tiny runs never overwrite the recorded results)",
    )
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else (Path(tempfile.mkdtemp(prefix="benchmarks_tiny_")) if a.tiny else None)
    names = [n for n, _, _ in BENCHMARKS]
    unknown = set(a.only or ()) - set(names)
    if unknown:
        p.error(f"unknown benchmark(s) {sorted(unknown)}{did_you_mean(sorted(unknown)[0], names)}; choose from {names}")
    rows: list[tuple[str, Row]] = []
    for name, headline, _ in BENCHMARKS:
        if a.only and name not in a.only:
            continue
        t0 = time.perf_counter()
        res = importlib.import_module(f"cde_nets.benchmarks.{name}").run(tiny=a.tiny, out_dir=out)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        rows += [(name, row) for row in headline(res)]
    print("\n" + table(rows, tiny=a.tiny))
    print(f"results in {out or 'benchmarks/results'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
