"""torch.compile (default backend, inductor) against eager for discrete nets: speed, compile time, equality.

H1 (forward Euler, Galimberti et al. 2023, eq. 9), H2 (semi-implicit Euler, eqs. 12-13), the heavy ball on a
cubic-friction field (B §8) and a NAIS-Net block (Ciccone et al. 2018, eq. 3), float32. Reported per net and mode
(forward without gradients, forward+backward): median eager and compiled times after warm-up, the speed-up, the
one-off compile time (the first compiled call) and the largest relative difference of the outputs (and, with
backward, of the gradients) from eager. ``python -m cde_nets.benchmarks.compiled [--tiny]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from cde_nets import discretize
from cde_nets.fields import NAIS, CubicFriction, Hamiltonian

from .common import interleaved_medians, write


def _nets(dim: int, layers: int, tiny: bool) -> list[tuple[str, torch.nn.Module, bool]]:
    g = torch.Generator().manual_seed(0)
    nets = [("H1 euler", discretize(Hamiltonian(dim, layers=layers, generator=g), "euler"), False)]
    if not tiny:
        nets += [
            (
                "H2 symplectic_euler",
                discretize(Hamiltonian(dim, layers=layers, K="blockdiag", generator=g), "symplectic_euler"),
                False,
            ),
            (
                "friction momentum",
                discretize(
                    CubicFriction(dim, layers=layers, zero_init=False, generator=g), "momentum", momentum=(0.5, 1.0)
                ),
                False,
            ),
            ("NAIS euler", discretize(NAIS(dim, dim, layers=layers, generator=g), "euler"), True),
        ]
    return nets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _call(m: torch.nn.Module, net: torch.nn.Module, args: tuple, backward: bool):
    if not backward:
        with torch.no_grad():
            return m(*args), []
    net.zero_grad()
    out = m(*args)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in net.parameters()]


def _measure(net: torch.nn.Module, compiled, args: tuple, backward: bool, repeat: int, warmup: int) -> dict:
    t0 = time.perf_counter()
    out_c, grads_c = _call(compiled, net, args, backward)  # the first call compiles
    compile_s = time.perf_counter() - t0
    out_e, grads_e = _call(net, net, args, backward)
    diff = max([_rel(out_c, out_e)] + [_rel(a, b) for a, b in zip(grads_c, grads_e)])
    t_e, t_c = interleaved_medians(
        [lambda: _call(net, net, args, backward), lambda: _call(compiled, net, args, backward)], repeat, warmup
    )
    return {"eager_s": t_e, "compiled_s": t_c, "speedup": t_e / t_c, "compile_s": compile_s, "max_rel_diff": diff}


def run(tiny: bool = False, out_dir=None) -> dict:
    dim, batch, layers = (4, 8, 2) if tiny else (16, 256, 16)
    repeat, warmup = (1, 0) if tiny else (15, 3)
    g = torch.Generator().manual_seed(1)
    y0 = torch.randn(batch, dim, generator=g)
    u = torch.randn(batch, dim, generator=g)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    # every DiscreteNet shares one forward code object: past dynamo's recompile limit (8) later nets would run eagerly
    limit, torch._dynamo.config.recompile_limit = torch._dynamo.config.recompile_limit, 64
    rows = []
    try:
        for name, net, needs_u in _nets(dim, layers, tiny):
            args = (y0, u) if needs_u else (y0,)
            compiled = torch.compile(net)
            for mode in ("forward", "forward+backward"):
                before = counters["stats"]["unique_graphs"]
                row = _measure(net, compiled, args, mode != "forward", repeat, warmup)
                row["graphs"] = counters["stats"]["unique_graphs"] - before  # 0 would mean it ran eagerly
                rows.append({"net": name, "mode": mode, "dim": dim, "batch": batch, "layers": layers, **row})
    finally:
        torch._dynamo.config.recompile_limit = limit
    payload = {
        "setting": {"dtype": "float32", "backend": "inductor (default)", "threads": torch.get_num_threads()},
        "goal": "max_rel_diff <= 1e-5",
        "rows": rows,
    }
    write("compiled", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    print("| net | mode | eager ms | compiled ms | speed-up | compile s | max rel diff |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(
            f"| {r['net']} | {r['mode']} | {1e3 * r['eager_s']:.2f} | {1e3 * r['compiled_s']:.2f} | "
            f"{r['speedup']:.2f} | {r['compile_s']:.1f} | {r['max_rel_diff']:.1e} |"
        )


if __name__ == "__main__":
    main()
