"""Peer benchmark: the ``momentumnet`` package (Sander et al., PyPI) against our momentum scheme.

``momentumnet.MomentumNet(functions, gamma)`` iterates ``v ← γ v + (1 − γ) f_l(x)``, ``x ← x + v`` with no step
size. Ours (B §8) iterates ``v ← m v + η h F_l(x)``, ``x ← x + v``; with ``tie_eta=True`` (``η = 1 − m``),
``m = γ`` and ``h = T / L = 1`` (``T = L``) the two are the same map when ``F_l = f_l``. Both sides use the same
weights: ``f_l(x) = J K_lᵀ tanh(K_l x + b_l)`` (the H1 field of :class:`cde_nets.fields.Hamiltonian`), copied
into per-layer modules for the peer. The benchmark checks in float64 that outputs and gradients agree, then
times forward+backward in float32 and measures the bytes saved for backward, with the stored-activation backward
(theirs ``use_backprop=True``, ours default) and the exact-inversion backward (theirs ``use_backprop=False``,
ours ``memory_free=True``), at depths 16 and 64.

``momentumnet`` is a benchmark peer only, never a dependency: when it is missing the result records
``skipped``. ``python -m cde_nets.benchmarks.momentum_peer [--tiny]``.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from cde_nets import discretize
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.fields import Hamiltonian

from .common import interleaved_medians, write

GAMMA = 0.9


class _PeerLayer(nn.Module):
    """``f(x) = J Kᵀ tanh(K x + b)`` with its own copies of one piece's ``K``, ``b`` (the peer wants one module
    per layer and finds their parameters itself)."""

    def __init__(self, K: torch.Tensor, b: torch.Tensor, J: torch.Tensor):
        super().__init__()
        self.K = nn.Parameter(K.detach().clone())
        self.b = nn.Parameter(b.detach().clone())
        self.register_buffer("J", J.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(torch.addmm(self.b, x, self.K.T)) @ self.K) @ self.J.T


def _pair(field: Hamiltonian, memory_free: bool):
    """Our momentum net on ``field`` and the peer's net on copies of the same weights."""
    from momentumnet import MomentumNet

    ours = discretize(field, "momentum", momentum=(GAMMA, 1 - GAMMA), tie_eta=True, memory_free=memory_free)
    ours.a.requires_grad_(False)  # the peer's γ is a constant
    layers = [_PeerLayer(field.K.data[l], field.b.data[l], field.J) for l in range(field.layers)]
    theirs = MomentumNet(layers, gamma=GAMMA, use_backprop=not memory_free)
    return ours, theirs


def _peer_gamma(gamma: float) -> float:
    """The momentum the peer's exact-inversion path really applies: ``TorchExactRep`` multiplies by the rational
    ``n / d`` with ``d = 2¹⁶ // int(γ + 1)``, ``n = int(γ d + 1)`` (momentumnet 0.10, exact_rep_pytorch.py)."""
    d = 2**16 // int(gamma + 1)
    return int(gamma * d + 1) / d


def _output_and_grads(net, x0: torch.Tensor, field: Hamiltonian | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``y`` and the gradients of ``sum(y²)`` w.r.t. every piece's ``K``, ``b`` (stacked, ``(L, ...)``) and ``x0``."""
    x = x0.clone().requires_grad_(True)
    if field is not None:
        field.zero_grad()
    y = net(x)
    y.square().sum().backward()
    if field is not None:
        return y.detach(), [field.K.data.grad.clone(), field.b.data.grad.clone(), x.grad]
    fs = net.functions
    return y.detach(), [torch.stack([f.K.grad for f in fs]), torch.stack([f.b.grad for f in fs]), x.grad]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def _agreement(dim: int, batch: int, depth: int, memory_free: bool) -> dict:
    """In float64: max |ours − momentumnet (use_backprop=True)| of the output and of the gradients of ``K``, ``b``
    and the input; for ``memory_free``, also against the peer's own exact-inversion path (``use_backprop=False``)."""
    from momentumnet import MomentumNet

    field = Hamiltonian(dim, layers=depth, T=float(depth), generator=torch.Generator().manual_seed(depth)).double()
    ours, _ = _pair(field, memory_free)
    ours = ours.double()
    ours.a.data.fill_(math.log(GAMMA / (1 - GAMMA)))  # m = γ to float64 precision (the init rounded it to float32)
    peer = MomentumNet([_PeerLayer(field.K.data[l], field.b.data[l], field.J) for l in range(depth)], gamma=GAMMA)
    x0 = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y_ours, g_ours = _output_and_grads(ours, x0, field)
    y_peer, g_peer = _output_and_grads(peer, x0, None)
    out = {
        "max_abs_diff_output": (y_ours - y_peer).abs().max().item(),
        "output_scale": y_peer.abs().max().item(),
        "max_abs_diff_grad": _max_diff(g_ours, g_peer),
        "grad_scale": max(g.abs().max().item() for g in g_peer),
    }
    if memory_free:
        # The peer's memory-free path keeps v in fixed point, read back in float32, and multiplies by γ rounded to
        # a 16-bit rational while still adding (1 − γ) f: compare it with ours at m = that γ, η = 1 − γ (untied).
        g_eff = _peer_gamma(GAMMA)
        ours = discretize(field, "momentum", momentum=(g_eff, 1 - GAMMA), memory_free=True).double()
        ours.a.data.fill_(math.log(g_eff / (1 - g_eff)))
        ours.b.data.fill_(math.log(math.expm1(1 - GAMMA)))
        ours.requires_grad_(False)
        field.requires_grad_(True)
        peer_mf = MomentumNet(
            [_PeerLayer(field.K.data[l], field.b.data[l], field.J) for l in range(depth)],
            gamma=GAMMA,
            use_backprop=False,
        )
        y_o, g_o = _output_and_grads(ours, x0, field)
        y_p, g_p = _output_and_grads(peer_mf, x0, None)
        out.update(
            peer_memory_free_gamma=g_eff,
            max_abs_diff_output_vs_peer_memory_free=(y_o - y_p).abs().max().item(),
            max_abs_diff_grad_vs_peer_memory_free=_max_diff(g_o, g_p),
        )
    return out


def _saved_bytes(net, x0: torch.Tensor) -> int:
    mem = SavedTensorMemory(exclude=list(net.parameters()) + list(net.buffers()) + [x0])
    with mem:
        y = net(x0)
    y.square().mean().backward()
    return mem.peak_bytes


def run(tiny: bool = False, out_dir=None) -> dict:
    try:
        import momentumnet
    except ImportError:
        payload = {"skipped": "momentumnet not installed", "rows": []}
        write("momentum_peer", payload, out_dir)
        return payload
    dim, batch = (4, 8) if tiny else (64, 256)
    depths = (2, 4) if tiny else (16, 64)
    repeat, warmup = (1, 0) if tiny else (9, 2)
    rows = []
    for depth in depths:
        for memory_free in (False, True):
            check = _agreement(dim, batch, depth, memory_free)
            if check["max_abs_diff_output"] > 1e-10 * max(1.0, check["output_scale"]) or check[
                "max_abs_diff_grad"
            ] > 1e-10 * max(1.0, check["grad_scale"]):
                raise RuntimeError(
                    f"ours and momentumnet disagree at depth {depth}, memory_free={memory_free}: {check}"
                )
            field = Hamiltonian(dim, layers=depth, T=float(depth), generator=torch.Generator().manual_seed(depth))
            ours, theirs = _pair(field, memory_free)
            x0 = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1))
            bytes_ours, bytes_theirs = _saved_bytes(ours, x0), _saved_bytes(theirs, x0)

            def step(net, x0=x0):
                return lambda: net(x0).square().mean().backward()

            t_ours, t_theirs = interleaved_medians([step(ours), step(theirs)], repeat, warmup)
            rows.append(
                {
                    "depth": depth,
                    "dim": dim,
                    "batch": batch,
                    "memory_free": memory_free,
                    **check,
                    "time_ours_s": t_ours,
                    "time_theirs_s": t_theirs,
                    "time_ratio": t_ours / t_theirs,
                    "saved_bytes_ours": bytes_ours,
                    "saved_bytes_theirs": bytes_theirs,
                    "memory_ratio": bytes_ours / max(bytes_theirs, 1),
                }
            )
    payload = {
        "setting": f"H1 field J Kᵀ tanh(K x + b), gamma = m = {GAMMA}, eta = 1 − m, h = 1; forward+backward "
        "of mean(y²), float32 timing, float64 agreement; memory = peak bytes saved for backward",
        "peer": f"momentumnet {momentumnet.__version__}",
        "goal": "outputs equal (< 1e-10, float64)",
        "rows": rows,
    }
    write("momentum_peer", payload, out_dir)
    return payload


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    res = run(p.parse_args().tiny)
    if "skipped" in res:
        print(f"momentum_peer: {res['skipped']}")
        return
    print(
        "| depth | backward | max |Δy| | max |Δgrad| | ours ms | momentumnet ms | time ratio | ours KiB | "
        "momentumnet KiB | memory ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        kind = "memory-free" if r["memory_free"] else "stored"
        print(
            f"| {r['depth']} | {kind} | {r['max_abs_diff_output']:.1e} | {r['max_abs_diff_grad']:.1e} | "
            f"{1e3 * r['time_ours_s']:.2f} | {1e3 * r['time_theirs_s']:.2f} | {r['time_ratio']:.3f} | "
            f"{r['saved_bytes_ours'] / 1024:.1f} | {r['saved_bytes_theirs'] / 1024:.1f} | {r['memory_ratio']:.3f} |"
        )


if __name__ == "__main__":
    main()
