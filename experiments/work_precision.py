r"""Work-precision diagrams of the structure-preserving methods (issue 39): energy error against cost on five
conservative fields, and each method's energy drift over a long run.

Fields (one parameter piece, float64, a batch of initial states):

- ``H1``: the H-DNN field ``y' = J Kᵀ tanh(K y + b)`` with ``K`` full (Galimberti et al. 2023, eq. H8): not separable,
  so only the Runge-Kutta, Gauss and projected methods apply. Energy ``H = Σ log cosh(K y + b)`` (eq. H5).
- ``H2``: ``K`` block-diagonal (eqs. H12-13): separable; every splitting method applies.
- ``MS3``: ``p' = K1ᵀ tanh(K1 q + b1)``, ``q' = −K2ᵀ tanh(K2 p + b2)`` (H App. I, eq. 40): separable, energy
  ``Σ log cosh(K1 q + b1) + Σ log cosh(K2 p + b2)``.
- ``oscillator``: the seeds' second-order field ``x'' = η f(x)`` (blog §8 without damping; Hauser's C² net) with a
  conservative force ``f(x) = −Wᵀ tanh(W x + c)``, energy ``|x'|²/(2η) + Σ log cosh(W x + c)``; the Nyström
  methods run on it as ``SecondOrder``, the others on its separable form ``(p, q) = (x', x)``.
- ``kepler``: ``q'' = −q/|q|³`` from the orbits of eccentricity 0.3, 0.5, 0.7 (:class:`~cde_nets.fields.Kepler`),
  energy and the angular momentum ``L`` of the rotation symmetry (Noether).

Cost is counted in evaluations of the field's costly parts: a full evaluation is 1; on ``H2``/``MS3`` each half
(``F_p`` or ``F_q``, one tanh layer each) is ½; on ``oscillator``/``kepler`` the force is 1 and the drift ``q' = p``
free (a splitting method's or Nyström method's cost is its number of force evaluations). Implicit methods count
every Newton iteration's evaluation; projected methods count their base method's evaluations only (the projection's
own invariant evaluations and Jacobians are in the wall time). No method reuses an evaluation across steps here
except the adaptive ones (first same as last), as each runs.

Per method and step size ``h = T/N``: the energy error ``max_b |H(y_T) − H(y_0)|`` at ``T``, the cost and the wall
time; the adaptive baselines (``dopri5``, ``tsit5``; ``dprkn6`` on the oscillator) over tolerances. Then each
fixed-step method runs ``drift_steps`` steps of one ``h`` per field: the drift study's tapered per-sample slope of
the energy error (:func:`~cde_nets.diagnostics.energy_error_fit`), its maximum, and on ``kepler`` the largest
angular-momentum error. Expected (Hairer, Lubich & Wanner 2006, §IX.8, §X.3, §IV.2): bounded energy error without
slope for the symplectic methods, a linear drift for the explicit Runge-Kutta ones, energy kept to rounding by the
projected ones, and the angular momentum kept to rounding by the Gauss methods (a quadratic invariant) and by every
splitting method on Kepler (each substep is the flow of a rotation-invariant part, ``|p|²/2`` or ``−1/|q|``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from cde_nets import ODEBlock, Projection, solve_second_order
from cde_nets.diagnostics import energy_error_fit
from cde_nets.fields import MS3, Field, Hamiltonian, Kepler, SecondOrder, kepler_orbit
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.schemes import Projected, RungeKutta, Scheme, Tableau, get_scheme
from cde_nets.solvers.steppers.splitting_tableaux import SPLITTING_SPECS
from cde_nets.solvers.steppers.tableaux import TABLEAUX

from .common import threads
from .report import result, row, save_figure

SETTINGS = {
    "tiny": dict(
        scale=0.1, levels=2, tols=(1e-5,), drift_steps=60, only=("rk4", "dopri5", "verlet", "mcate5", "nystrom4")
    ),
    "quick": dict(scale=1.0, levels=3, tols=(1e-5, 1e-9), drift_steps=1000),
    "full": dict(scale=1.0, levels=4, tols=(1e-4, 1e-7, 1e-10), drift_steps=3000),
    # the 10⁵-step drift of every fixed-step method on a separable field and on Kepler, one sweep point
    "drift": dict(scale=1.0, levels=1, tols=(1e-8,), drift_steps=100_000, fields=("H2", "kepler")),
}
RK = ("rk4", "dopri5", "tsit5")
GAUSS = ("implicit_midpoint", "gl4", "gl6")
COMPOSITIONS = ("symplectic_euler", "verlet", "yoshida4", "yoshida6")
SPLITTING = (*COMPOSITIONS, *SPLITTING_SPECS)
NYSTROM = ("nystrom4", "dprkn6")
TARGETS = (1e-6, 1e-10)


class FixedRK(RungeKutta):
    """The fifth-order solution of an adaptive pair (``dopri5``, ``tsit5``) as a fixed step: its stages up to the
    last weighted one (the first-same-as-last stage only serves the error estimate)."""

    def __init__(self, name: str):
        tab = TABLEAUX[name].tableau
        s = max(i for i, b in enumerate(tab.b) if b != 0.0) + 1
        self.tableau = Tableau(a=tab.a[:s], b=tab.b[:s], c=tab.c[:s])
        self.name, self.order = name, TABLEAUX[name].order


@dataclass
class Problem:
    """One field of the study: the field the schemes step, the energy, the cost of each half, the horizon."""

    name: str
    field: Field
    y0: torch.Tensor
    energy: Callable[[torch.Tensor], torch.Tensor]
    T: float
    steps: tuple[int, ...]
    h_drift: float
    methods: tuple[str, ...]
    half_cost: tuple[float, float] = (0.5, 0.5)  # a kick (F_p), a drift (F_q), in full evaluations
    second_order: SecondOrder | None = None  # the Nyström methods' view, state (x, v) = (q, p)
    extra: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    exact: torch.Tensor | None = None  # y(T): a closed form, else gl6 with 8× the finest step (reference)

    def reference(self) -> torch.Tensor:
        if self.exact is None:
            N = 8 * max(self.steps)
            sch, bound = get_scheme("gl6").for_field(self.field), BoundField(self.field)
            state = sch.init(self.y0)
            with torch.no_grad():
                for n in range(N):
                    state = sch.step(bound, 0, state, self.T / N, None, n * self.T / N)
            self.exact = sch.readout(state)
        return self.exact


def _ms3_energy(f: MS3) -> Callable[[torch.Tensor], torch.Tensor]:
    def energy(y: torch.Tensor) -> torch.Tensor:
        n = f.half_dim
        p, q = y[:, :n], y[:, n:]
        z1, z2 = q @ f.K1[0].T + f.b1[0], p @ f.K2[0].T + f.b2[0]
        return _log_cosh(z1).sum(-1) + _log_cosh(z2).sum(-1)

    return energy


def _log_cosh(z: torch.Tensor) -> torch.Tensor:
    a = z.abs()
    return a + torch.log1p(torch.exp(-2 * a)) - math.log(2.0)


class _Force(torch.nn.Module):
    """``f(x) = −Wᵀ tanh(W x + c)`` = ``−∇ Σ log cosh(W x + c)``."""

    def __init__(self, W: torch.Tensor, c: torch.Tensor):
        super().__init__()
        self.W, self.c = W, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -torch.tanh(x @ self.W.T + self.c) @ self.W


class Oscillator(Field):
    """The second-order field's separable form ``p' = η f(q)``, ``q' = p`` on ``(p, q)``."""

    separable = True
    kind = "oscillator"

    def __init__(self, force: _Force, eta: torch.Tensor):
        super().__init__(T=1.0, layers=1)
        self.force, self.eta = force, eta
        n = eta.shape[0]
        self.state_shape, self.split = (2 * n,), (n, n)

    def evaluate(self, l, y):
        n = self.split[0]
        return torch.cat([self.evaluate_half(l, y[:, n:], 0), y[:, :n]], -1)

    def evaluate_part(self, l, y, part):
        n = self.split[0]
        return self.evaluate_half(l, y[:, n:] if part == 0 else y[:, :n], part)

    def evaluate_half(self, l, z, part):
        return self.eta * self.force(z) if part == 0 else z


def problems(seed: int, s: dict) -> list[Problem]:
    g = torch.Generator().manual_seed(seed)
    batch = 2 if s["scale"] < 1 else 4
    scale, levels = s["scale"], s["levels"]

    def steps(first: int) -> tuple[int, ...]:
        return tuple(max(2, int(round(first * scale * 2**k))) for k in range(levels))

    out = []
    split_methods = (*RK, *GAUSS, *SPLITTING, "rk4+projection")
    for name in ("H1", "H2"):
        f = Hamiltonian(4, K="full" if name == "H1" else "blockdiag", generator=g).double()
        y0 = torch.randn(batch, 4, dtype=torch.float64, generator=g)
        methods = (*RK, *GAUSS, "rk4+projection") if name == "H1" else split_methods
        out.append(
            Problem(name, f, y0, lambda y, f=f: f.energy(0.0, y), _horizon(name, scale), steps(25), 0.1, methods)
        )
    ms3 = MS3(4, generator=g).double()
    y0 = torch.randn(batch, 4, dtype=torch.float64, generator=g)
    out.append(Problem("MS3", ms3, y0, _ms3_energy(ms3), _horizon("MS3", scale), steps(25), 0.1, split_methods))
    W = torch.randn(2, 2, dtype=torch.float64, generator=g) + 1.5 * torch.eye(2, dtype=torch.float64)
    c = 0.3 * torch.randn(2, dtype=torch.float64, generator=g)
    so = SecondOrder(2, damping=False, learn=False, f=_Force(W, c)).double()
    osc = Oscillator(so.f, so.eta.detach())
    y0 = torch.randn(batch, 4, dtype=torch.float64, generator=g)

    def osc_energy(y: torch.Tensor, W=W, c=c, eta=osc.eta) -> torch.Tensor:
        return 0.5 * (y[:, :2] ** 2 / eta).sum(-1) + _log_cosh(y[:, 2:] @ W.T + c).sum(-1)

    out.append(
        Problem(
            "oscillator",
            osc,
            y0,
            osc_energy,
            _horizon("oscillator", scale),
            steps(25),
            0.1,
            (*split_methods, *NYSTROM),
            (1.0, 0.0),
            so,
        )
    )
    kep = Kepler().double()
    y0 = torch.stack([kepler_orbit(0.0, e) for e in (0.3, 0.5, 0.7)[: max(2, batch - 1)]])
    out.append(
        Problem(
            "kepler",
            kep,
            y0,
            lambda y, f=kep: f.energy(0.0, y),
            _horizon("kepler", scale),
            steps(100),
            2 * math.pi / 400,
            split_methods,
            (1.0, 0.0),
            extra={"angular_momentum": lambda y, f=kep: f.angular_momentum(0.0, y)},
            exact=torch.stack([_orbit_at(4 * math.pi * scale, e) for e in (0.3, 0.5, 0.7)[: len(y0)]]),
        )
    )
    only = s.get("only")
    out = [p for p in out if p.name in s.get("fields", (p.name,))]
    for p in out:
        p.methods = tuple(m for m in p.methods if only is None or m in only)
    return out


def _orbit_at(t: float, e: float) -> torch.Tensor:
    return kepler_orbit(t, e)


def _scheme(prob: Problem, name: str) -> tuple[Scheme, BoundField, bool]:
    """The method as a scheme on the problem's field (or, for a Nyström method, on its second-order view):
    ``(scheme, bound field, swapped)`` with ``swapped`` when the state is ``(q, p)``."""
    if name in NYSTROM:
        assert prob.second_order is not None
        return get_scheme(name).for_field(prob.second_order), BoundField(prob.second_order), True
    if name == "rk4+projection":
        proj = Projection(
            invariant=(lambda t, y: prob.energy(y), *(lambda t, y, g=g: g(y) for g in prob.extra.values()))
        )
        return Projected("rk4", proj).for_field(prob.field), BoundField(prob.field), False
    sch = FixedRK(name) if name in ("dopri5", "tsit5") else get_scheme(name)
    return sch.for_field(prob.field), BoundField(prob.field), False


def _cost(prob: Problem, sch: Scheme, name: str) -> float:
    """One step's cost in full evaluations (module docstring)."""
    if name in SPLITTING:
        kick, drift = prob.half_cost
        return sum(kick if part == 0 else drift for part, _, _ in sch.stages(0.0, 1.0))  # type: ignore[attr-defined]
    return float(sch.evaluations(0))


def _swap(y: torch.Tensor) -> torch.Tensor:
    n = y.shape[1] // 2
    return torch.cat([y[:, n:], y[:, :n]], 1)


def run_steps(prob: Problem, name: str, h: float, steps: int, record: bool = False) -> dict:
    """``steps`` steps of ``h``: energy error at the end, cost, wall time; with ``record``, every step's signed
    energy error ``(steps, batch)`` and the largest error of each extra invariant."""
    sch, bound, swapped = _scheme(prob, name)
    y0 = prob.y0
    E0 = prob.energy(y0)
    X0 = {k: g(y0) for k, g in prob.extra.items()}
    state = sch.init(_swap(y0) if swapped else y0)
    errs = torch.empty(steps if record else 0, len(y0), dtype=y0.dtype)
    extra = dict.fromkeys(prob.extra, 0.0)
    cost, wall = 0.0, 0.0
    with torch.no_grad():
        for n in range(steps):
            start = time.perf_counter()
            state = sch.step(bound, 0, state, h, None, n * h)
            wall += time.perf_counter() - start
            cost += _cost(prob, sch, name)
            if record:
                y = sch.readout(state)
                y = _swap(y) if swapped else y
                errs[n] = prob.energy(y) - E0
                for k, g in prob.extra.items():
                    extra[k] = max(extra[k], float((g(y) - X0[k]).abs().max()))
        y = sch.readout(state)
        y = _swap(y) if swapped else y
        end = float((prob.energy(y) - E0).abs().max())
        state_err = float((y - prob.reference()).abs().max()) if not record else None
        end_extra = {k: float((g(y) - X0[k]).abs().max()) for k, g in prob.extra.items()}
    sch.end_pass()
    out = {"h": h, "steps": steps, "cost": cost, "wall_s": wall, "energy_error": end, "extra_error": end_extra}
    if state_err is not None:
        out["state_error"] = state_err
    if record:
        out["fit"] = energy_error_fit(h * np.arange(1, steps + 1), errs.numpy())
        out["extra_max"] = extra
    return out


def run_adaptive(prob: Problem, name: str, tol: float) -> dict:
    """An adaptive solve over ``[0, T]`` at ``rtol = atol = tol``: energy error at ``T``, evaluations, wall time."""
    start = time.perf_counter()
    with torch.no_grad():
        if name == "dprkn6":
            assert prob.second_order is not None
            sol = solve_second_order(prob.second_order, _swap(prob.y0), [0.0, prob.T], rtol=tol, atol=tol)
            y = _swap(sol.y)
        else:
            sol = ODEBlock(prob.field, method=name, T=prob.T, rtol=tol, atol=tol).solve(prob.y0)
            y = sol.y
    wall = time.perf_counter() - start
    with torch.no_grad():
        err = float((prob.energy(y) - prob.energy(prob.y0)).abs().max())
        extra = {k: float((g(y) - g(prob.y0)).abs().max()) for k, g in prob.extra.items()}
        state = float((y - prob.reference()).abs().max())
    return {
        "tol": tol,
        "cost": float(sol.stats["nfe_forward"]),
        "wall_s": wall,
        "energy_error": err,
        "state_error": state,
        "extra_error": extra,
    }


def study(prob: Problem, s: dict) -> dict:
    out: dict[str, dict] = {}
    for name in prob.methods:
        sweep = [run_steps(prob, name, prob.T / N, N) for N in prob.steps]
        drift = run_steps(prob, name, prob.h_drift, s["drift_steps"], record=True)
        out[name] = {"sweep": sweep, "drift": drift}
    for name in (*("dopri5", "tsit5"), *(("dprkn6",) if prob.second_order is not None else ())):
        if s.get("only") is None or name in s["only"]:
            out[f"{name} (adaptive)"] = {"sweep": [run_adaptive(prob, name, tol) for tol in s["tols"]]}
    return out


def cheapest(res: dict, target: float, key: str = "energy_error") -> tuple[str, float] | None:
    """The method with the least cost whose ``key`` error at ``T`` is at most ``target`` (on its measured points);
    for the energy error, the projected methods (which hold it to rounding at any cost) are left out."""
    best: tuple[str, float] | None = None
    for name, r in res.items():
        if key == "energy_error" and "projection" in name:
            continue
        costs = [p["cost"] for p in r["sweep"] if p[key] <= target]
        if costs and (best is None or min(costs) < best[1]):
            best = (name, min(costs))
    return best


def _horizon(field_name: str, scale: float) -> float:
    return (4 * math.pi if field_name == "kepler" else 10.0) * scale


def plot(field_name: str, T: float, res: dict, out_dir) -> str:
    """One field's diagram (energy error and error in ``y(T)`` against cost): ``work_precision_<field>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter, LogLocator, NullLocator

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    for ax, key, label in (
        (axes[0], "energy_error", "max |H(y_T) − H(y_0)|"),
        (axes[1], "state_error", "max |y_T − y(T)|"),
    ):
        colours = plt.get_cmap("tab20")
        for i, (name, r) in enumerate(res.items()):
            pts = [(p["cost"], max(p[key], 1e-17)) for p in r["sweep"]]
            style = "--" if name in RK or "adaptive" in name else (":" if name in GAUSS or "+" in name else "-")
            marker = "os^vD<>"[i // 20 + (i % 3)]
            ax.loglog(*zip(*pts), style, marker=marker, ms=3, color=colours(i % 20), label=name, lw=1)
        ax.set(xlabel="cost (field evaluations)", ylabel=label, title=f"{field_name}, T = {T:.4g}")
        for axis in (ax.xaxis, ax.yaxis):  # no minor ticks, no mathtext labels: drawing 5× faster
            axis.set_major_locator(LogLocator(numticks=8))
            axis.set_minor_locator(NullLocator())
            axis.set_major_formatter(LogFormatter())
    axes[1].legend(fontsize=6, ncol=3)
    return save_figure(fig, out_dir, f"work_precision_{field_name}")


def replot(res: dict, out_dir) -> list[str]:
    """The diagrams of a recorded result, from its curves."""
    scale = res["settings"]["scale"]
    return [plot(name, _horizon(name, scale), curves, out_dir) for name, curves in res["curves"].items()]


def run(size: str = "quick", seed: int = 0, out_dir="results") -> dict:
    threads()
    s = SETTINGS[size]
    t0 = time.perf_counter()
    rows, figures, curves = [], [], {}
    for prob in problems(seed, s):
        res = study(prob, s)
        figures.append(plot(prob.name, prob.T, res, out_dir))
        curves[prob.name] = res
        for key, what in (("energy_error", "energy error"), ("state_error", "error in y(T)")):
            for target in TARGETS:
                best = cheapest(res, target, key)
                rows.append(
                    row(
                        f"{prob.name}: cheapest method for {what} ≤ {target:g}",
                        None,
                        best[0] if best else "none reached",
                        field=prob.name,
                        kind="cheapest",
                        error=key,
                        target=target,
                        cost=best[1] if best else None,
                    )
                )
        for name, r in res.items():
            if "drift" not in r:
                continue
            d = r["drift"]
            rows.append(
                row(
                    f"{prob.name} {name}: energy slope over {d['steps']} steps of h = {d['h']:.4g}",
                    None,
                    d["fit"]["slope"],
                    field=prob.name,
                    kind="drift",
                    method=name,
                    max_error=d["fit"]["max"],
                    ratio_to_first=d["fit"]["ratio"],
                    cost_per_step=d["cost"] / d["steps"],
                    wall_s=d["wall_s"],
                    **{f"{k}_max": v for k, v in d["extra_max"].items()},
                )
            )
    notes = [
        "published: none (the study's own measurements). Cost in full field evaluations (halves ½ on H2/MS3; "
        "force evaluations on oscillator/kepler, where the drift q' = p is free); implicit methods count Newton "
        "iterations; projected rk4 counts rk4's evaluations.",
        "cheapest: the least cost among the measured points whose error at T is below the target; for the energy "
        "error the projected methods (rounding at any cost) are left out. y(T): the closed form on kepler, else gl6 "
        "with 8× the finest step.",
        "slope: the drift study's Hann-tapered per-sample least-squares slope of H(y_n) − H(y_0) (the largest in "
        "magnitude over the batch); ratio_to_first: max error / max over the first 1 % of the run.",
    ]
    return result(
        "work_precision",
        rows,
        size=size,
        seed=seed,
        time_s=time.perf_counter() - t0,
        settings={k: v for k, v in s.items()},
        notes=notes,
        figures=figures,
        curves=curves,
    )


def cheapest_table(res: dict) -> str:
    """The conservation guide's table: the cheapest method per field and target, with its cost."""
    rows = {(r["field"], r["error"], r["target"]): r for r in res["rows"] if r["kind"] == "cheapest"}
    fields = list(dict.fromkeys(f for f, _, _ in rows))
    head = "| field | energy error ≤ 1e-6 | energy error ≤ 1e-10 | error in y(T) ≤ 1e-6 | error in y(T) ≤ 1e-10 |"
    out = [head, "|---|---|---|---|---|"]
    for f in fields:
        cells = []
        for key in ("energy_error", "state_error"):
            for target in TARGETS:
                r = rows[(f, key, target)]
                cells.append(f"`{r['ours']}` ({r['cost']:.0f})" if r["cost"] is not None else "none measured")
        out.append(f"| {f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def drift_table(res: dict) -> str:
    """The conservation guide's drift table: each fixed-step method's tapered slope and maximum of the energy
    error per field, and Kepler's largest angular-momentum error."""
    drift = [r for r in res["rows"] if r["kind"] == "drift"]
    fields = list(dict.fromkeys(r["field"] for r in drift))
    by = {(r["field"], r["method"]): r for r in drift}
    steps = {r["field"]: r["setting"].split(" over ")[1].split(" steps")[0] for r in drift}
    kepler = "kepler" in fields
    out = ["| method | " + " | ".join(f"{f}: slope / max ({steps[f]} steps)" for f in fields)]
    out[0] += " | kepler: max angular-momentum error |" if kepler else " |"
    out.append("|---" * (len(fields) + 1 + kepler) + "|")
    for m in dict.fromkeys(r["method"] for r in drift):
        cells = [f"{by[(f, m)]['ours']:.1e} / {by[(f, m)]['max_error']:.1e}" if (f, m) in by else "—" for f in fields]
        if kepler:
            k = by.get(("kepler", m))
            cells.append(f"{k['angular_momentum_max']:.1e}" if k else "—")
        out.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(out)
