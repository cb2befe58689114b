r"""Conservation study (Galimberti et al.; Chen et al. 2018): energy drift and the Noether quantity ``a·F`` against
solver and tolerance.

- Energy: a Hamiltonian field (H2 form, ``K`` block-diagonal, canonical ``J``, ``R⁴``) with constant parameters
  conserves ``H`` exactly (eqs. H5, H8: ``dH/dt = ∂H/∂t = 0``). Over ``T = 10`` we measure the relative drift
  ``max_{t,b} |H(y(t)) − H(y(0))| / mean_b |H(y(0))|`` for the adaptive solvers (dopri5, bosh3) against
  ``rtol = atol``, for the fixed-step ones (rk4, euler) against the step count, and for discrete nets with the same
  constant parameters in every layer (symplectic Euler, Verlet, explicit Euler) against the layer count.
  Expected: drift falls with the tolerance and as ``h^p`` (p = 4, 1; Verlet 2, symplectic Euler 1); symplectic
  schemes keep the error bounded (they conserve a nearby energy), explicit Euler's grows with ``T``.
- Noether (eqs. R21, R24-25): for a time-invariant field the adjoint ``a(t) = ∂L/∂y(t)`` and the state satisfy
  ``a(t)·F(y(t)) = const``; we measure its relative drift on a cubic-friction field (``R²``, ``T = 2``) for
  the same continuous solvers (``cde_nets.diagnostics.adjoint_state``: the adjoint of the numerical flow).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.diagnostics import adjoint_state, discrete_energy, energy_trajectory
from cde_nets.fields import CubicFriction, Hamiltonian

from .common import threads
from .report import result, row, save_figure

ADAPTIVE = ("dopri5", "bosh3")
FIXED = ("rk4", "euler")
DISCRETE = ("symplectic_euler", "verlet", "euler")
T_ENERGY, T_NOETHER = 10.0, 2.0
ORDERS = {"rk4": 4, "euler": 1, "symplectic_euler": 1, "verlet": 2}

SETTINGS = {
    "tiny": dict(batch=4, tolerances=(1e-3, 1e-6), steps=(20, 40), samples=11),
    "quick": dict(batch=64, tolerances=(1e-3, 1e-5, 1e-7, 1e-9), steps=(25, 50, 100, 200, 400), samples=101),
    "full": dict(
        batch=256,
        tolerances=(1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10),
        steps=(25, 50, 100, 200, 400, 800, 1600),
        samples=201,
    ),
}


def hamiltonian(layers: int, seed: int) -> Hamiltonian:
    """``H2`` field on ``R⁴`` over ``[0, 10]``; the same parameters in all ``layers`` pieces (constant in t)."""
    base = Hamiltonian(4, layers=1, T=T_ENERGY, K="blockdiag", generator=torch.Generator().manual_seed(seed))
    field = Hamiltonian(4, layers=layers, T=T_ENERGY, K="blockdiag").double()
    with torch.no_grad():
        for p, q in zip(field.parameters(), base.double().parameters()):
            p.copy_(q.expand_as(p) if q.dim() == p.dim() else q)
    return field


def friction(seed: int) -> CubicFriction:
    """Time-invariant cubic friction on ``R²`` (one piece), random ``w``, ``b``, ``γ = 1``."""
    g = torch.Generator().manual_seed(seed)
    return CubicFriction(2, layers=1, T=T_NOETHER, gamma=1.0, learn_gamma=False, zero_init=False, generator=g).double()


def _block(field, method: str, setting) -> ODEBlock:
    if method in ADAPTIVE:
        return ODEBlock(field, method=method, rtol=setting, atol=setting, gradient="backprop")
    return ODEBlock(field, method=method, step_size=field.T / setting, gradient="backprop")


def _times(T: float, method: str, setting, samples: int) -> torch.Tensor:
    """Where the drift is measured: ``samples`` equal intervals, except for fixed-step solvers, which step through
    every requested time (the ODE block adds them to its grid). There the sample times are a subset of the
    ``n``-step grid (every ``n/m``-th point, ``m`` the largest divisor of ``n`` up to ``samples − 1``), so ``n``
    steps really are ``n`` steps."""
    m = samples - 1
    if method in FIXED:
        m = max(d for d in range(1, min(setting, m) + 1) if setting % d == 0)
    return torch.linspace(0, T, m + 1, dtype=torch.float64)


def energy_drift(seed: int, s: dict) -> dict:
    """``{(kind, method, setting): drift}``: continuous solvers over tolerances/steps, discrete schemes over L."""
    y0 = torch.randn(s["batch"], 4, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    field = hamiltonian(1, seed)
    out = {}
    for method in ADAPTIVE + FIXED:
        for setting in s["tolerances"] if method in ADAPTIVE else s["steps"]:
            t = _times(T_ENERGY, method, setting, s["samples"])
            out[("continuous", method, setting)] = energy_trajectory(_block(field, method, setting), y0, t)["drift"]
    for scheme in DISCRETE:
        for L in s["steps"]:
            f = hamiltonian(L, seed)
            with torch.no_grad():
                net = discretize(f, scheme)
                states = net.solve(y0, t=net.times).ys
            out[("discrete", scheme, L)] = discrete_energy(f, states)["drift"]
    return out


def noether_drift(seed: int, s: dict) -> dict:
    """``{(method, setting): drift of a·F}`` on the time-invariant cubic-friction field."""
    field = friction(seed)
    y0 = torch.randn(s["batch"], 2, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    target = torch.randn(s["batch"], 2, generator=torch.Generator().manual_seed(seed + 3), dtype=torch.float64)
    out = {}
    for method in ADAPTIVE + FIXED:
        for setting in s["tolerances"] if method in ADAPTIVE else s["steps"]:
            t = _times(T_NOETHER, method, setting, s["samples"] // 2 + 1)
            st = adjoint_state(_block(field, method, setting), y0, t, loss=lambda y: (y - target).square().sum())
            out[(method, setting)] = st["drift"]
    return out


ROUNDING_FLOOR = 1e-12  # float64 drifts below this are rounding, not truncation error: left out of the slope fit


def slope(xs, ys) -> float:
    """Least-squares slope of ``log y`` against ``log x`` over the points above :data:`ROUNDING_FLOOR`."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    keep = ys > ROUNDING_FLOOR
    if keep.sum() < 2:
        return float("nan")
    return float(np.polyfit(np.log(xs[keep]), np.log(ys[keep]), 1)[0])


def _plot(energy: dict, noether: dict, s: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4))
    for m in ADAPTIVE:
        ax[0].loglog(s["tolerances"], [energy[("continuous", m, r)] for r in s["tolerances"]], "o-", label=f"H, {m}")
        ax[0].loglog(s["tolerances"], [noether[(m, r)] for r in s["tolerances"]], "s--", label=f"a·F, {m}")
    ax[0].set(xlabel="rtol = atol", ylabel="relative drift", title="adaptive solvers")
    for m in FIXED:
        ax[1].loglog(s["steps"], [energy[("continuous", m, n)] for n in s["steps"]], "o-", label=f"H, {m}")
        ax[1].loglog(s["steps"], [noether[(m, n)] for n in s["steps"]], "s--", label=f"a·F, {m}")
    ax[1].set(xlabel="steps", ylabel="relative drift", title="fixed-step solvers")
    for m in DISCRETE:
        ax[2].loglog(s["steps"], [energy[("discrete", m, n)] for n in s["steps"]], "o-", label=m)
    ax[2].set(xlabel="layers L (h = 10/L)", ylabel="relative energy drift", title="discrete nets, constant weights")
    for a in ax:
        a.legend(fontsize=7)
    return [save_figure(fig, out_dir, "conservation")]


def run(size: str = "quick", seed: int = 0, out_dir="results") -> dict:
    threads()
    s = SETTINGS[size]
    t0 = time.perf_counter()
    energy = energy_drift(seed, s)
    noether = noether_drift(seed, s)
    rows = []
    for (kind, method, setting), d in energy.items():
        label = (
            f"rtol {setting:.0e}"
            if method in ADAPTIVE and kind == "continuous"
            else f"{setting} {'steps' if kind == 'continuous' else 'layers'}"
        )
        rows.append(
            row(
                f"energy drift, {kind} {method}, {label}",
                None,
                d,
                kind=kind,
                method=method,
                setting_value=setting,
                quantity="energy",
            )
        )
    for (method, setting), d in noether.items():
        label = f"rtol {setting:.0e}" if method in ADAPTIVE else f"{setting} steps"
        rows.append(
            row(
                f"Noether a·F drift, {method}, {label}",
                None,
                d,
                method=method,
                setting_value=setting,
                quantity="noether",
            )
        )
    for kind, method in [("continuous", m) for m in FIXED] + [("discrete", m) for m in DISCRETE if m != "euler"]:
        ys = [energy[(kind, method, n)] for n in s["steps"]]
        rows.append(
            row(
                f"energy drift slope vs steps, {kind} {method}",
                -float(ORDERS[method]),
                slope(s["steps"], ys),
                quantity="slope",
            )
        )
    notes = [
        "No paper tabulates these; the 'published' column of the slope rows holds the order the theory gives "
        "(drift ∝ h^p; the symplectic schemes' energy error stays bounded, O(h^p), for all time).",
        f"Energy: H2 field on R⁴, constant parameters, T = {T_ENERGY:g}, batch {s['batch']}, float64. Noether: "
        f"cubic friction on R², one piece, T = {T_NOETHER:g}, loss ‖y(T) − target‖², float64.",
    ]
    figures = _plot(energy, noether, s, out_dir)
    return result(
        "conservation",
        rows,
        size=size,
        seed=seed,
        time_s=time.perf_counter() - t0,
        settings={**s, "T_energy": T_ENERGY, "T_noether": T_NOETHER},
        notes=notes,
        figures=figures,
    )
