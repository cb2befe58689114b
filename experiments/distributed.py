"""Scale-out launcher: ``python -m cde_nets.experiments distributed --nodes 8 [--quick|--tiny] [--mode h2|ddp|both]``.

*h2*: the distributed H2-DNN (one process per node, ring communication graph ``S``, :func:`run_h2`) runs
``repeat`` timed forward + backward passes of ``loss = Σ c ⊙ y_L``; the centralised masked model does the same in
one process. Outputs and every parameter gradient must agree to 1e-10 (float64); the table gives the median wall
times, the bytes each rank sent per layer (forward and backward, from the exchange's traffic counts) and each
rank's neighbours.

*ddp*: a discrete H1 Hamiltonian classifier on the swiss roll trained with :func:`cde_nets.train.trainer.fit` by
``--nodes`` processes (DDP, gloo on loopback, :func:`spawn`) and by one process, same seed and global batch; the
final parameters must agree to 1e-6 (float64, rounding only in practice). The optimiser is plain SGD: with Adam
the training trajectory of this net itself amplifies rounding (in one process, a 1e-15 change of one initial
weight grows to 0.1 within ~160 steps), so no two summation orders, DDP's or another thread count's, agree
beyond the first hundred steps.

*ddp-worker*: one rank of the same training, for ``torchrun``; rank 0 then repeats it single-process and prints
the comparison (``torchrun --standalone --nproc_per_node 8 -m cde_nets.experiments.distributed --mode ddp-worker``).

Not a reproduction of a published table, so not in the registry (``all`` does not run it). Writes
``<out>/distributed.json`` atomically.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from cde_nets import discretize
from cde_nets.datasets import swiss_roll
from cde_nets.distributed import data_parallel as dp
from cde_nets.distributed.h2 import _setup, run_h2
from cde_nets.distributed.launch import spawn
from cde_nets.train.trainer import Trainer

from .common import hdnn_classifier
from .report import format_table, result, row, write_result

SETTINGS = {
    # h2: nodes' state sizes (p and q entries each), layers, batch, timed repetitions;
    # ddp: swiss roll points (half train), H1 layers, epochs, global batch, SGD step (tiny: the last batch has fewer
    # samples than 8 ranks, so some ranks run an empty share)
    "tiny": dict(h2=dict(size=1, layers=2, batch=4, repeat=2), ddp=dict(n=80, layers=4, epochs=2, batch=12, lr=0.1)),
    "quick": dict(
        h2=dict(size=4, layers=4, batch=64, repeat=5), ddp=dict(n=2000, layers=8, epochs=4, batch=100, lr=0.05)
    ),
    "full": dict(
        h2=dict(size=16, layers=8, batch=256, repeat=10), ddp=dict(n=8000, layers=8, epochs=10, batch=128, lr=0.05)
    ),
}


def ring(M: int) -> list[list[int]]:
    """The ring communication graph: node ``i`` talks to ``i ± 1`` (mod ``M``)."""
    return [[1 if (i - j) % M in (0, 1, M - 1) else 0 for j in range(M)] for i in range(M)]


def h2_spec(M: int, size: int, layers: int, batch: int, repeat: int, seed: int = 0) -> dict:
    """Layer ``j`` couples node ``i`` to ``i + 1`` (even ``j``) or ``i − 1`` (odd ``j``) through ``K``; ``T = I``.

    Each row of ``R_j`` holds two adjacent nodes, so ``RᵀR`` stays inside the ring (eq. H32 holds with ``S`` = ring).
    """
    step = [1, -1]
    R_layers = [
        [[1 if k in (i, (i + step[j % 2]) % M) else 0 for k in range(M)] for i in range(M)] for j in range(layers)
    ]
    eye = [[int(i == k) for k in range(M)] for i in range(M)]
    return dict(
        sizes=[size] * M, R_layers=R_layers, T=eye, S=ring(M), seed=seed, batch=batch, repeat=repeat, dtype="float64"
    )


def _centralised(spec: dict) -> dict:
    """The masked centralised model (the library's symplectic-Euler net on the same field) in this process."""
    old, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)  # as each rank of the distributed run
    try:
        field, y0, c = _setup(spec)
        net = discretize(field, "symplectic_euler")
        times = []
        for _ in range(spec["repeat"]):
            field.zero_grad()
            y = y0.clone().requires_grad_(True)
            t0 = time.perf_counter()
            out = net(y)
            (c * out).sum().backward()
            times.append(time.perf_counter() - t0)
        return {"field": field, "y": out.detach(), "dy0": y.grad, "time_s": times}
    finally:
        torch.set_default_dtype(old)
        torch.set_num_threads(threads)


def _h2_differences(spec: dict, ranks: list[dict], ref: dict) -> tuple[float, float]:
    """Max abs differences of outputs and of all gradients (inputs and parameter blocks), nodes vs centralised."""
    field, M = ref["field"], len(spec["sizes"])
    n = field.dim // 2
    off = [0]
    for s in spec["sizes"]:
        off.append(off[-1] + s)
    d_out, d_grad = 0.0, 0.0
    for r, res in enumerate(ranks):
        rows = slice(off[r], off[r + 1])
        p, q = ref["y"][:, :n][:, rows], ref["y"][:, n:][:, rows]
        d_out = max(d_out, float((res["p"] - p).abs().max()), float((res["q"] - q).abs().max()))
        dp0, dq0 = ref["dy0"][:, :n][:, rows], ref["dy0"][:, n:][:, rows]
        d_grad = max(d_grad, float((res["dp0"] - dp0).abs().max()), float((res["dq0"] - dq0).abs().max()))
        for name, g in res["grads"].items():
            kind, *idx = name.split("_")
            if kind in ("Kp", "Kq"):
                j, k = map(int, idx)
                want = getattr(field, "K_p" if kind == "Kp" else "K_q").data.grad[j, rows, off[k] : off[k + 1]]
            elif kind in ("bp", "bq"):
                want = getattr(field, "b_p" if kind == "bp" else "b_q").data.grad[int(idx[0]), rows]
            else:
                want = field.X.grad[rows, off[int(idx[0])] : off[int(idx[0]) + 1]]
            d_grad = max(d_grad, float((g - want).abs().max()))
    assert M == len(ranks)
    return d_out, d_grad


def run_h2_mode(nodes: int, s: dict, seed: int) -> tuple[list[dict], dict]:
    spec = h2_spec(nodes, s["size"], s["layers"], s["batch"], s["repeat"], seed)
    t0 = time.perf_counter()
    ranks = run_h2(spec, timeout_s=600)
    spawn_wall = time.perf_counter() - t0
    ref = _centralised(spec)
    d_out, d_grad = _h2_differences(spec, ranks, ref)
    # a repetition ends when the slowest rank ends
    dist_times = [max(r["time_s"][k] for r in ranks) for k in range(s["repeat"])]
    t_dist, t_cent = statistics.median(dist_times), statistics.median(ref["time_s"])
    per_layer = [sum(v["bytes"] for v in r["traffic"].values()) / s["layers"] for r in ranks]
    fwd_per_layer = [
        sum(v["bytes"] for k, v in r["traffic"].items() if k.startswith("forward")) / s["layers"] for r in ranks
    ]
    partners = [sorted({int(k.split("->")[1]) for k in r["traffic"]}) for r in ranks]
    record = {
        "nodes": nodes,
        "state_dim": 2 * nodes * s["size"],
        "layers": s["layers"],
        "batch": s["batch"],
        "repeat": s["repeat"],
        "time_distributed_s": dist_times,
        "time_centralised_s": ref["time_s"],
        "median_distributed_s": t_dist,
        "median_centralised_s": t_cent,
        "spawn_wall_s": spawn_wall,
        "max_abs_diff_outputs": d_out,
        "max_abs_diff_gradients": d_grad,
        "bytes_per_rank_per_layer": per_layer,
        "forward_bytes_per_rank_per_layer": fwd_per_layer,
        "neighbours": [r["neighbours"] for r in ranks],
        "partners": partners,
    }
    rows = [
        row(f"H2 fwd+bwd, {nodes} processes (ring S), median wall", None, t_dist, "s"),
        row("H2 fwd+bwd, centralised masked model, 1 process, median wall", None, t_cent, "s"),
        row(
            "max abs difference distributed vs centralised: outputs / gradients",
            "< 1e-10",
            f"{d_out:.1e} / {d_grad:.1e}",
        ),
        row(
            "bytes sent per rank per layer (fwd + bwd; fwd only)",
            None,
            f"{statistics.mean(per_layer):.0f}; {statistics.mean(fwd_per_layer):.0f}",
        ),
        row(
            "neighbours per rank / ranks talked to",
            None,
            f"{statistics.mean(len(n) for n in record['neighbours']):.0f} / "
            f"max {max(len(p) for p in partners)} (ring only: "
            f"{all(set(p) <= {(r - 1) % nodes, (r + 1) % nodes} for r, p in enumerate(partners))})",
        ),
    ]
    return rows, record


def ddp_train(rank: int, world: int, cfg: dict) -> dict:
    """One rank's :func:`fit` of the H1 classifier (outside a process group: the single-process run)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        data = swiss_roll(n=cfg["n"], dim=4, seed=cfg["seed"], dtype=torch.float64)
        model = hdnn_classifier("H1", cfg["layers"], float(cfg["layers"]) / 4, cfg["seed"])
        t0 = time.perf_counter()
        trainer = Trainer(
            seed=cfg["seed"], progress=False, optimizer=lambda params: torch.optim.SGD(params, lr=cfg["lr"])
        )
        hist = trainer.fit(model, data, epochs=cfg["epochs"], batch_size=cfg["batch"])
        elapsed = time.perf_counter() - t0
    finally:
        torch.set_default_dtype(old)
    # the epochs' time: a process's first fit also pays one-off lazy imports (about 1.5 s here)
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "history": hist,
        "time_s": sum(h["time_s"] for h in hist),
        "fit_wall_s": elapsed,
        "world": dp.world_size(),
    }


def _single(cfg: dict) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank
    try:
        return ddp_train(0, 1, cfg)
    finally:
        torch.set_num_threads(threads)


def _compare(ranks: list[dict], single: dict) -> dict:
    diff = max(float((r["state"][k] - single["state"][k]).abs().max()) for r in ranks for k in single["state"])
    last, ref = ranks[0]["history"][-1], single["history"][-1]
    return {
        "max_abs_parameter_diff": diff,
        "time_ddp_s": max(r["time_s"] for r in ranks),
        "time_single_s": single["time_s"],
        "train_accuracy_ddp": last["train_accuracy"],
        "train_accuracy_single": ref["train_accuracy"],
        "test_accuracy_ddp": last["test_accuracy"],
        "test_accuracy_single": ref["test_accuracy"],
        "train_loss_ddp": last["train_loss"],
        "train_loss_single": ref["train_loss"],
    }


def _ddp_rows(rec: dict) -> list[dict]:
    n = rec["processes"]
    return [
        row(f"DDP fit, {n} processes vs 1: max abs parameter difference", "< 1e-6", rec["max_abs_parameter_diff"]),
        row(f"DDP fit, {n} processes: wall time of the epochs", None, rec["time_ddp_s"], "s"),
        row("fit, 1 process: wall time of the epochs", None, rec["time_single_s"], "s"),
        row(
            "train / test accuracy, DDP",
            None,
            f"{100 * rec['train_accuracy_ddp']:.2f} / {100 * rec['test_accuracy_ddp']:.2f} %",
        ),
        row(
            "train / test accuracy, 1 process",
            None,
            f"{100 * rec['train_accuracy_single']:.2f} / {100 * rec['test_accuracy_single']:.2f} %",
        ),
    ]


def run_ddp_mode(nodes: int, s: dict, seed: int) -> tuple[list[dict], dict]:
    cfg = dict(s, seed=seed)
    t0 = time.perf_counter()
    ranks = spawn(ddp_train, nodes, cfg, timeout_s=600)
    spawn_wall = time.perf_counter() - t0
    rec = {"processes": nodes, "settings": cfg, "spawn_wall_s": spawn_wall, **_compare(ranks, _single(cfg))}
    return _ddp_rows(rec), rec


def torchrun_line(nodes: int, size: str, seed: int) -> str:
    flag = "" if size == "full" else f" --{size}"
    return (
        f"torchrun --standalone --nproc_per_node {nodes} -m cde_nets.experiments.distributed "
        f"--mode ddp-worker{flag} --seed {seed}"
    )


def ddp_worker(size: str, seed: int) -> int:
    """One rank under torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by it); rank 0 prints the comparison."""
    import torch.distributed as dist

    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks on this machine: keep gloo on loopback
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = dict(SETTINGS[size]["ddp"], seed=seed)
    try:
        mine = ddp_train(dist.get_rank(), dist.get_world_size(), cfg)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        rank, world = dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        rec = {"processes": world, **_compare(ranks, _single(cfg))}
        print(format_table(result("distributed (torchrun)", _ddp_rows(rec), size=size, seed=seed, time_s=0.0)))
        if rec["max_abs_parameter_diff"] > 1e-6:
            print("FAILED: DDP and single-process parameters differ by more than 1e-6")
            return 1
    return 0


_DESCRIPTION = """\
Scale-out launcher (not a reproduction: `all` does not run it; writes OUT/distributed.json).

h2: the distributed H2-DNN, one process per node on a ring, against the centralised masked model in one process:
outputs and every parameter gradient must agree to 1e-10 (float64); the table gives the median wall times, the
bytes each rank sent per layer and each rank's neighbours.

ddp: a discrete H1 Hamiltonian classifier on the swiss roll trained by --nodes processes (DDP, gloo on loopback)
and by one process, same seed and global batch, plain SGD: the final parameters must agree to 1e-6 (float64).

ddp-worker: one rank of the same training, for torchrun; rank 0 then repeats it in one process and prints the
comparison (torchrun --standalone --nproc_per_node 8 -m cde_nets.experiments.distributed --mode ddp-worker)."""


def main(argv: list[str] | None = None, prog: str = "python -m cde_nets.experiments distributed") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=8, help="processes (H2 nodes / DDP ranks), default 8")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="size", action="store_const", const="quick", help="reduced setting")
    size.add_argument("--tiny", dest="size", action="store_const", const="tiny", help="seconds (test suite)")
    parser.add_argument("--mode", choices=("h2", "ddp", "both", "ddp-worker"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results", help="directory for distributed.json")
    args = parser.parse_args(argv)
    size = args.size or "full"
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be an integer in [0, 2**32), got {args.seed}")
    if args.mode == "ddp-worker":
        if "RANK" not in os.environ:
            parser.error("`--mode ddp-worker` runs under torchrun: " + torchrun_line(args.nodes, size, args.seed))
        return ddp_worker(size, args.seed)
    if args.nodes < 2:
        parser.error(f"`--nodes` must be at least 2, got {args.nodes}.")
    t0 = time.perf_counter()
    rows, extra = [], {}
    if args.mode in ("h2", "both"):
        r, extra["h2"] = run_h2_mode(args.nodes, SETTINGS[size]["h2"], args.seed)
        rows += r
    if args.mode in ("ddp", "both"):
        r, extra["ddp"] = run_ddp_mode(args.nodes, SETTINGS[size]["ddp"], args.seed)
        rows += r
    line = torchrun_line(args.nodes, size, args.seed)
    notes = [
        f"Your own script calling Trainer.fit: torchrun --standalone --nproc_per_node {args.nodes} script.py "
        "(it calls torch.distributed.init_process_group first).",
        f"This DDP comparison under torchrun: {line}",
        "Wall times on this machine; each rank and the single process use one intra-op thread.",
    ]
    res = result(
        "distributed",
        rows,
        size=size,
        seed=args.seed,
        time_s=time.perf_counter() - t0,
        settings={"nodes": args.nodes, "mode": args.mode, **SETTINGS[size]},
        notes=notes,
        torchrun=line,
        **extra,
    )
    path = write_result(res, args.out)
    print(format_table(res))
    print(f"\n(wrote {path})", flush=True)
    if any(
        k in extra and extra[k][f] > tol
        for k, f, tol in (
            ("h2", "max_abs_diff_outputs", 1e-10),
            ("h2", "max_abs_diff_gradients", 1e-10),
            ("ddp", "max_abs_parameter_diff", 1e-6),
        )
    ):
        print("FAILED: distributed and single-process results differ beyond the tolerance")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
