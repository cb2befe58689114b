"""The adjoint study (Chen et al. 2018) on a 16-piece Hamiltonian block and a 16-piece cubic-friction block.

For each model, ``cde_nets.diagnostics.adjoint_study`` computes the parameter gradient of a binary cross-entropy
loss (fixed linear read-out of ``y(T)``, swiss-roll points of the H-DNN reference code padded to ``R⁴``) by the
continuous adjoint, by backprop through the solver, and by the discrete net, and compares each with backprop through
dopri5 at ``rtol = atol = 1e-10`` in float64 with the step sizes held on their mesh (the ODE's gradient to that
tolerance): relative gradient error, NFE forward/backward, time and peak bytes saved for backward. Expected (R §2.1,
Chen et al. 2018): backprop's error falls with the tolerance like the solution's; the adjoint's error is limited by
the backward solve's tolerance; the discrete nets differ from the ODE gradient by the scheme's O(h) error; the
adjoint's memory does not grow with the step count.
"""

from __future__ import annotations

import time

import torch

from cde_nets.datasets import swiss_roll
from cde_nets.diagnostics import adjoint_study
from cde_nets.fields import CubicFriction, Hamiltonian
from cde_nets.solvers.gradients import GRADIENTS, Backprop

from .common import threads
from .report import result, row, save_figure

# every continuous gradient mode; a mode a method cannot take (reversible needs alf) gives no row

SETTINGS = {
    "tiny": dict(n=16, tolerances=(1e-3, 1e-5), steps=(), methods=("dopri5",), repeat=1, ref_rtol=1e-8),
    "quick": dict(
        n=128,
        tolerances=(1e-3, 1e-5, 1e-7),
        steps=(16, 64, 256),
        methods=("dopri5", "bosh3", "rk4", "euler", "alf"),
        repeat=1,
        ref_rtol=1e-10,
    ),
    "full": dict(
        n=512,
        tolerances=(1e-3, 1e-5, 1e-7, 1e-9),
        steps=(16, 64, 256, 1024),
        methods=("dopri5", "bosh3", "rk4", "euler", "alf"),
        repeat=3,
        ref_rtol=1e-10,
    ),
}

MODELS = {
    "Hamiltonian H2 (16 pieces, T = 4)": lambda: Hamiltonian(
        4, layers=16, T=4.0, K="blockdiag", init_std=1.0, generator=torch.Generator().manual_seed(0)
    ).double(),
    "cubic friction (16 pieces, T = 4)": lambda: CubicFriction(
        4,
        layers=16,
        T=4.0,
        gamma=0.1,
        learn_gamma=False,
        zero_init=False,
        init_std=0.5,
        generator=torch.Generator().manual_seed(0),
    ).double(),
}


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    split = swiss_roll(n=2 * n, dim=4, seed=seed, dtype=torch.float64)
    readout = torch.randn(4, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    return split.x_train[:n], split.y_train[:n].to(torch.float64), readout


def _plot(studies: dict, out_dir) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(studies), figsize=(6.5 * len(studies), 4.2), squeeze=False)
    for ax, (name, st) in zip(axes[0], studies.items()):
        groups: dict[str, list] = {}
        for r in st["rows"]:
            if "error" not in r:
                groups.setdefault(f"{r['mode']} {r['method']}", []).append(r)
        for label, rs in groups.items():
            nfe = [r["nfe_forward"] + r["nfe_backward"] for r in rs]
            err = [max(r["rel_grad_error"], 1e-17) for r in rs]
            ax.loglog(
                nfe,
                err,
                "o-" if rs[0]["mode"] == "backprop" else "s--" if rs[0]["mode"] == "adjoint" else "^",
                label=label,
            )
        ax.set(xlabel="NFE forward + backward", ylabel="relative gradient error", title=name)
        ax.legend(fontsize=7)
    return [save_figure(fig, out_dir, "adjoint_study")]


def run(size: str = "quick", seed: int = 0, out_dir="results") -> dict:
    threads()
    s = SETTINGS[size]
    t0 = time.perf_counter()
    x, label, readout = _data(s["n"], seed)

    def loss_fn(yT, target):
        return torch.nn.functional.binary_cross_entropy_with_logits(yT @ readout, target)

    rows, studies = [], {}
    for name, make in MODELS.items():
        st = adjoint_study(
            make,
            (x, label),
            loss_fn,
            tolerances=s["tolerances"],
            steps=s["steps"],
            methods=s["methods"],
            # every registered gradient method but forward mode (one solve per parameter, hundreds here: its
            # crossover is benchmarks/forward_sensitivity.py's), and backprop on the steps' mesh (their sizes held
            # fixed) beside the default, which differentiates them
            gradients=(*(n for n, cls in GRADIENTS.items() if not cls.per_input), Backprop(steps="fixed")),
            repeat=s["repeat"],
            reference=dict(rtol=s["ref_rtol"], atol=s["ref_rtol"]),
        )
        studies[name] = st
        for r in st["rows"]:
            where = f"rtol {r['rtol']:.0e}" if r["rtol"] is not None else f"{r['steps']} steps"
            setting = f"{name}: {r['mode']} {r['method']}, {where}"
            if "error" in r:
                rows.append(row(setting, None, f"failed: {r['error'][:80]}"))
                continue
            rows.append(
                row(
                    setting,
                    None,
                    r["rel_grad_error"],
                    "rel. grad error",
                    nfe_forward=r["nfe_forward"],
                    nfe_backward=r["nfe_backward"],
                    time_s=r["time_s"],
                    peak_saved_bytes=r["peak_saved_bytes"],
                    model=name,
                    mode=r["mode"],
                    method=r["method"],
                    rtol=r["rtol"],
                    steps=r["steps"],
                )
            )
    notes = [
        "No paper tabulates this study; the module docstring states the expectations. Extra columns in "
        "the JSON: nfe_forward, nfe_backward, time_s, peak_saved_bytes per row.",
        f"Swiss roll, {s['n']} points padded to R⁴, BCE of a fixed random linear read-out; float64; "
        f"reference: backprop through dopri5 at rtol = atol = {s['ref_rtol']:.0e}, step sizes held on their mesh.",
        "backprop, checkpoint and symplectic differentiate every adaptive step size (the derivative of the loss as "
        "computed); 'backprop (fixed steps)' holds the sizes on their mesh (the discrete adjoint of the ODE). Where "
        "the controller rings (many rejected steps) the first can be far from the ODE's gradient while exact for "
        "the computed loss: the gradients guide, 'Step sizes are functions of the state'.",
    ]
    figures = _plot(studies, out_dir)
    return result(
        "adjoint_study",
        rows,
        size=size,
        seed=seed,
        time_s=time.perf_counter() - t0,
        settings={k: list(v) if isinstance(v, tuple) else v for k, v in s.items()}
        | {"references": {k: v["reference"] for k, v in studies.items()}},
        notes=notes,
        figures=figures,
    )
