"""Every gradient mode of ``ODEBlock`` on the Hamiltonian, cubic-friction and NAIS fields: gradient error against
a float64 reference, NFE forward and backward, time of forward + backward, memory saved for backward.

``python -m cde_nets.benchmarks.gradient_modes [--tiny]`` writes ``benchmarks/results/gradient_modes.json`` (and
one picture per field, error against time and against memory) and prints the table. Two sweeps:

- accuracy: adaptive dopri5 (adjoint, backprop, checkpoint, symplectic) and alf (backprop, reversible) at
  several tolerances, dim 4, batch 64, 16 pieces; reference: backprop through dopri5 at rtol = atol = 1e-11 with
  the step sizes held on their mesh (``Backprop(steps="fixed")``: the ODE's gradient to that tolerance, which the
  derivative of the step sizes is not);
- scaling (the targets): rk4 and alf on fixed grids of 10 and ``N`` steps (``N`` = 1000), dim 64, batch 256,
  where memory is the peak of tensors saved for backward during the forward pass
  (:class:`~cde_nets.diagnostics.memory.SavedTensorMemory`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from cde_nets import Backprop, ODEBlock
from cde_nets.diagnostics.memory import SavedTensorMemory
from cde_nets.fields import NAIS, CubicFriction, Hamiltonian

from .common import RESULTS, interleaved_medians, write

FIELDS = ("hamiltonian", "cubic", "nais")
ACCURACY_MODES = (
    ("dopri5", "adjoint"),
    ("dopri5", "backprop"),
    ("dopri5", "checkpoint"),
    ("dopri5", "symplectic"),
    ("alf", "backprop"),
    ("alf", "reversible"),
)


def _problem(name: str, dim: int, batch: int, layers: int):
    g = torch.Generator().manual_seed(0)
    if name == "hamiltonian":
        field = Hamiltonian(dim, layers=layers, K="blockdiag", generator=g)
    elif name == "cubic":
        field = CubicFriction(dim, layers=layers, gamma=0.5, zero_init=False, generator=g)
    else:
        field = NAIS(dim, dim, layers=layers, generator=g)
    field = field.double()
    y0 = torch.randn(batch, dim, generator=g, dtype=torch.float64)
    u = torch.randn(batch, dim, generator=g, dtype=torch.float64) if name == "nais" else None
    return field, y0, u


def _loss_grads(block: ODEBlock, field, y0, u):
    y = block(y0, u)
    params = [p for p in field.parameters() if p.requires_grad]
    return torch.autograd.grad(y.pow(2).mean(), params)


def _measure(block: ODEBlock, field, y0, u, repeat: int) -> dict:
    params = [p for p in field.parameters()]
    with SavedTensorMemory(exclude=[*params, y0] + ([u] if u is not None else [])) as mem:
        sol = block.solve(y0, u)
    saved = mem.peak_bytes
    grads = torch.autograd.grad(sol.y.pow(2).mean(), params)
    stats = sol.stats
    (t,) = interleaved_medians([lambda: _loss_grads(block, field, y0, u)], repeat=repeat, warmup=1)
    return {
        "nfe_forward": stats["nfe_forward"],
        "nfe_backward": stats["nfe_backward"],
        "steps": stats["steps_forward"],
        "time_s": t,
        "saved_bytes": saved,
        "grads": grads,
    }


def _rel(g, ref) -> float:
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(g, ref)) ** 0.5
    den = sum(float(b.pow(2).sum()) for b in ref) ** 0.5
    return num / den


def accuracy(tiny: bool) -> list[dict]:
    tols = [1e-4] if tiny else [1e-3, 1e-5, 1e-7]
    rows = []
    for name in FIELDS:
        field, y0, u = _problem(name, 4, 16 if tiny else 64, 4 if tiny else 16)
        ref_block = ODEBlock(field, method="dopri5", gradient=Backprop(steps="fixed"), rtol=1e-11, atol=1e-11)
        ref = _loss_grads(ref_block, field, y0, u)
        for tol in tols:
            for method, mode in ACCURACY_MODES:
                block = ODEBlock(field, method=method, gradient=mode, rtol=tol, atol=tol)
                r = _measure(block, field, y0, u, repeat=1 if tiny else 3)
                rows.append(
                    {
                        "field": name,
                        "method": method,
                        "mode": mode,
                        "rtol": tol,
                        "rel_grad_error": _rel(r.pop("grads"), ref),
                        **r,
                    }
                )
            # "the same accepted steps": a given first step, since torchdiffeq's backprop also differentiates
            # its own first-step selection
            same = {}
            for mode in ("backprop", "checkpoint", "symplectic"):
                block = ODEBlock(
                    field, method="dopri5", gradient=mode, rtol=tol, atol=tol, options={"first_step": 0.01}
                )
                same[mode] = _loss_grads(block, field, y0, u)
            for mode in ("checkpoint", "symplectic"):
                rows.append(
                    {
                        "field": name,
                        "method": "dopri5",
                        "mode": f"{mode}_vs_backprop_same_steps",
                        "rtol": tol,
                        "rel_grad_error": _rel(same[mode], same["backprop"]),
                    }
                )
    return rows


def scaling(tiny: bool) -> list[dict]:
    dim, batch, n = (8, 16, 20) if tiny else (64, 256, 1000)
    rows = []
    for name in FIELDS:
        field, y0, u = _problem(name, dim, batch, 10)
        for steps in (10, n):
            for method, mode in (
                ("rk4", "backprop"),
                ("rk4", "checkpoint"),
                ("rk4", "symplectic"),
                ("rk4", "adjoint"),
                ("alf", "backprop"),
                ("alf", "reversible"),
            ):
                block = ODEBlock(
                    field, method=method, gradient=mode, step_size=1.0 / steps, options={"max_num_steps": 10 * n}
                )
                r = _measure(block, field, y0, u, repeat=1 if tiny else 3)
                r.pop("grads")
                rows.append(
                    {
                        "field": name,
                        "method": method,
                        "mode": mode,
                        "grid_steps": steps,
                        "state_bytes": y0.numel() * y0.element_size(),
                        **r,
                    }
                )
    return rows


def targets(scale: list[dict], acc: list[dict]) -> dict:
    n = max(r["grid_steps"] for r in scale)
    out: dict = {}
    for name in FIELDS:

        def get(method, mode, steps, name=name):
            return next(
                r
                for r in scale
                if r["field"] == name and r["method"] == method and r["mode"] == mode and r["grid_steps"] == steps
            )

        bp, ck, sy = get("rk4", "backprop", n), get("rk4", "checkpoint", n), get("rk4", "symplectic", n)
        ab, rv, rv10 = get("alf", "backprop", n), get("alf", "reversible", n), get("alf", "reversible", 10)
        one_step_graph = bp["saved_bytes"] / n
        same = [r["rel_grad_error"] for r in acc if r["field"] == name and r["mode"].endswith("same_steps")]
        out[name] = {
            "exact_vs_backprop_same_steps": {"value": max(same), "target": 1e-10, "met": max(same) <= 1e-10},
            "checkpoint_memory": {
                "value": ck["saved_bytes"],
                "target": 1.2 * n * ck["state_bytes"] + one_step_graph,
                "met": ck["saved_bytes"] <= 1.2 * n * ck["state_bytes"] + one_step_graph,
            },
            "symplectic_memory_le_checkpoint": {
                "value": sy["saved_bytes"],
                "target": ck["saved_bytes"],
                "met": sy["saved_bytes"] <= ck["saved_bytes"],
            },
            "reversible_memory_vs_10_steps": {
                "value": rv["saved_bytes"] / max(rv10["saved_bytes"], 1),
                "target": 1.2,
                "met": rv["saved_bytes"] <= 1.2 * rv10["saved_bytes"],
            },
            "checkpoint_time_vs_backprop": {
                "value": ck["time_s"] / bp["time_s"],
                "target": 1.5,
                "met": ck["time_s"] <= 1.5 * bp["time_s"],
            },
            "symplectic_time_vs_backprop": {
                "value": sy["time_s"] / bp["time_s"],
                "target": 2.0,
                "met": sy["time_s"] <= 2.0 * bp["time_s"],
            },
            "reversible_time_vs_alf_backprop": {
                "value": rv["time_s"] / ab["time_s"],
                "target": 2.5,
                "met": rv["time_s"] <= 2.5 * ab["time_s"],
            },
        }
    return out


def _plots(acc: list[dict], out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for name in FIELDS:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        for method, mode in ACCURACY_MODES:
            rs = [r for r in acc if r["field"] == name and r["method"] == method and r["mode"] == mode]
            label = f"{mode} ({method})"
            axes[0].loglog([r["time_s"] for r in rs], [max(r["rel_grad_error"], 1e-16) for r in rs], "o-", label=label)
            axes[1].loglog(
                [max(r["saved_bytes"], 1) for r in rs], [max(r["rel_grad_error"], 1e-16) for r in rs], "o-", label=label
            )
        axes[0].set_xlabel("forward + backward time (s)")
        axes[1].set_xlabel("bytes saved for backward")
        for ax in axes:
            ax.set_ylabel("relative gradient error")
        axes[0].set_title(name)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"gradient_modes_{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(str(path.name))
    return paths


def run(tiny: bool = False, out_dir=None) -> dict:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    acc = accuracy(tiny)
    scale = scaling(tiny)
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    res = {
        "setting": "float64; accuracy: dopri5/alf at rtol = atol = tol, dim 4, 16 pieces, loss mean(y(T)^2), "
        "reference backprop through dopri5 at 1e-11, step sizes held; scaling: fixed grids of 10 and N steps "
        "(rk4, alf), dim 64 batch 256 (tiny: dim 8 batch 16, N = 20); time = median of "
        "forward + backward; memory = peak bytes saved for backward during the forward pass",
        "rows": acc + scale,
        "targets": targets(scale, acc),
        "pictures": _plots(acc, out),
        "total_s": time.perf_counter() - t0,
    }
    write("gradient_modes" + ("_tiny" if tiny else ""), res, out_dir)
    return res


def table(res: dict) -> str:
    lines = [
        "| field | method | gradient | tol / steps | rel. grad error | NFE fwd | NFE bwd | time (ms) | saved KiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "nfe_forward" not in r:
            continue
        size = r.get("rtol", r.get("grid_steps"))
        err = f"{r['rel_grad_error']:.1e}" if "rel_grad_error" in r else "—"
        lines.append(
            f"| {r['field']} | {r['method']} | {r['mode']} | {size:g} | {err} | {r['nfe_forward']} | "
            f"{r['nfe_backward']} | {1e3 * r['time_s']:.1f} | {r['saved_bytes'] / 1024:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    res = run(a.tiny)
    print(table(res))
    for name, t in res["targets"].items():
        for k, v in t.items():
            print(f"{name:12s} {k:36s} {v['value']:.3g} (target {v['target']:.3g}) {'met' if v['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
