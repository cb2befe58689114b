"""The distributed H2-DNN: one process per node, talking only to its neighbours in ``S`` (Galimberti et al., Thm. H2).

The state is split into ``M`` nodes, node ``i`` owning ``p_i`` and ``q_i`` (``sizes[i]`` entries each). Layer
``j`` (eqs. H12-13) with ``K_{p,j}, K_{q,j} ∈ BlkSprs(R_j)`` and ``X ∈ BlkSprs(T)``:

    p_{j+1} = p_j − h Xᵀ K_{q,j}ᵀ σ(K_{q,j} q_j + b_{q,j}),   q_{j+1} = q_j + h X K_{p,j}ᵀ σ(K_{p,j} p_{j+1} + b_{p,j}).

Node ``i`` computes its rows with three neighbour exchanges per half step: the state along ``R`` (``K q``), the
contributions ``K[m, i]ᵀ σ_m`` along ``Rᵀ``, and ``X``'s contributions along ``T``. Every partner is a neighbour
in ``S`` when ``T RᵀR + RᵀR T <= S`` (eq. H32), which :func:`~cde_nets.fields.locality.check_locality` verifies first.
"""

from __future__ import annotations

import torch
from torch import nn

from cde_nets.fields.locality import block_mask, check_locality

from ..fields.hamiltonian import Hamiltonian
from .exchange import Comm, exchange

__all__ = ["h2_masks", "centralised_h2", "NodeH2", "neighbours", "h2_node_worker", "run_h2", "distributed_forward"]


def _pattern(A) -> torch.Tensor:
    return torch.as_tensor(A).to(torch.int64)


def neighbours(S, i: int) -> frozenset[int]:
    """Nodes ``j != i`` with ``S[i, j] = 1`` (0-based)."""
    S = _pattern(S)
    return frozenset(int(j) for j in S[i].nonzero().flatten().tolist() if j != i)


def h2_masks(R_layers, T, sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """``K_mask`` ``(L, n/2, n/2)`` from the per-layer node patterns ``R_j`` and ``J_mask`` ``(n, n)`` from ``T``."""
    K_mask = torch.stack([block_mask(R, sizes) for R in R_layers])
    Mx = block_mask(T, sizes)
    Z = torch.zeros_like(Mx)
    J_mask = torch.cat([torch.cat([Z, Mx.T], 1), torch.cat([Mx, Z], 1)], 0)
    return K_mask, J_mask


def centralised_h2(
    sizes,
    R_layers,
    T,
    S,
    T_end: float = 1.0,
    J: str = "structured",
    generator: torch.Generator | None = None,
    init_std: float | None = None,
) -> Hamiltonian:
    """The centralised masked H2 field; raises :class:`~cde_nets.fields.locality.LocalityError` before anything runs
    if some layer's sparsity needs communication that ``S`` does not allow."""
    for j, R in enumerate(R_layers):
        check_locality(R, T, S, where=f"in layer {j}")
    n = 2 * sum(sizes)
    K_mask, J_mask = h2_masks(R_layers, T, sizes)
    field = Hamiltonian(
        n,
        layers=len(R_layers),
        T=T_end,
        K="blockdiag",
        J=J,
        K_mask=K_mask,
        J_mask=J_mask,
        generator=generator,
        init_std=init_std,
    )
    with torch.no_grad():  # masked entries carry no meaning: zero them so parameters equal their masked use
        field.K_p.data.mul_(K_mask)
        field.K_q.data.mul_(K_mask)
        if J == "structured":
            field.X.mul_(J_mask[n // 2 :, : n // 2])
    return field


class NodeH2(nn.Module):
    """Node ``rank``'s share of an H2-DNN: its rows of every ``K_{p,j}``, ``K_{q,j}``, ``b``, and of ``X``.

    Built from the centralised masked field (parameters are copied, so gradients can be compared block by block).
    ``forward(p_i, q_i)`` runs all layers; it must be called on every rank in step (collective in effect).
    """

    def __init__(self, field: Hamiltonian, sizes, R_layers, T, S, rank: int):
        super().__init__()
        self.sizes = list(sizes)
        self.M = len(self.sizes)
        self.rank = rank
        self.R = [_pattern(R) for R in R_layers]
        self.Tm = _pattern(T)
        self.h = field.grid.h
        self.sigma = field.sigma
        self.comm = Comm(rank, neighbours(S, rank))
        off = [0]
        for s in self.sizes:
            off.append(off[-1] + s)
        self.off = off
        rows = slice(off[rank], off[rank + 1])
        params = {}
        for j, R in enumerate(self.R):
            for k in range(self.M):
                if R[rank, k]:
                    cols = slice(off[k], off[k + 1])
                    params[f"Kp_{j}_{k}"] = field.K_p.data[j, rows, cols]
                    params[f"Kq_{j}_{k}"] = field.K_q.data[j, rows, cols]
            params[f"bp_{j}"] = field.b_p.data[j, rows]
            params[f"bq_{j}"] = field.b_q.data[j, rows]
        X = field.X_eff()
        self.learned_X = field.J_kind == "structured"
        for k in range(self.M):
            if self.Tm[rank, k]:
                cols = slice(off[k], off[k + 1])
                dtype = field.b_p.data.dtype
                if X is not None:
                    blk = X[rows, cols]
                elif k == rank:
                    blk = torch.eye(self.sizes[rank], dtype=dtype)
                else:
                    blk = torch.zeros(self.sizes[rank], self.sizes[k], dtype=dtype)
                if self.learned_X:
                    params[f"X_{k}"] = blk
                else:
                    self.register_buffer(f"X_{k}", blk.detach().clone())
        self.params = nn.ParameterDict({k: nn.Parameter(v.detach().clone()) for k, v in params.items()})

    def _X(self, k: int) -> torch.Tensor:
        return self.params[f"X_{k}"] if self.learned_X else getattr(self, f"X_{k}")

    def _shape(self, x: torch.Tensor, k: int) -> torch.Size:
        return torch.Size((x.shape[0], self.sizes[k]))

    def _K_transpose_sigma(self, j: int, name: str, z_own: torch.Tensor, bias: torch.Tensor):
        """``(Kᵀ σ(K z + b))_i`` for node ``i``, with ``z`` gathered along ``R_j`` and contributions along ``R_jᵀ``."""
        i, R = self.rank, self.R[j]
        send = {m: z_own for m in range(self.M) if m != i and R[m, i]}
        recv = {k: self._shape(z_own, k) for k in range(self.M) if k != i and R[i, k]}
        z_own, z = exchange(self.comm, send, recv, z_own)
        z[i] = z_own
        pre = bias + sum(z[k] @ self.params[f"{name}_{j}_{k}"].T for k in z)
        s = self.sigma(pre)
        contrib = {k: s @ self.params[f"{name}_{j}_{k}"] for k in range(self.M) if R[i, k]}
        own = contrib.pop(i)
        recv = {m: self._shape(own, i) for m in range(self.M) if m != i and R[m, i]}
        own, got = exchange(self.comm, contrib, recv, own)
        return own + sum(got.values()) if got else own

    def forward(self, p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, Tm = self.rank, self.Tm
        for j in range(len(self.R)):
            # p_{j+1} = p_j − h (Xᵀ g)_i with g = K_qᵀ σ(K_q q + b_q): node i sends X[i, k]ᵀ g_i to k along T.
            g = self._K_transpose_sigma(j, "Kq", q, self.params[f"bq_{j}"])
            contrib = {k: g @ self._X(k) for k in range(self.M) if Tm[i, k]}
            own = contrib.pop(i)
            recv = {m: self._shape(own, i) for m in range(self.M) if m != i and Tm[m, i]}
            own, got = exchange(self.comm, contrib, recv, own)
            p = p - self.h * (own + sum(got.values()) if got else own)
            # q_{j+1} = q_j + h (X g)_i with g = K_pᵀ σ(K_p p_{j+1} + b_p): node i gathers g_k along T.
            g = self._K_transpose_sigma(j, "Kp", p, self.params[f"bp_{j}"])
            send = {m: g for m in range(self.M) if m != i and Tm[m, i]}
            recv = {k: self._shape(g, k) for k in range(self.M) if k != i and Tm[i, k]}
            g, got = exchange(self.comm, send, recv, g)
            got[i] = g
            q = q + self.h * sum(got[k] @ self._X(k).T for k in got)
        return p, q

    def traffic(self) -> dict:
        """Messages and bytes this rank sent, per phase and destination."""
        return {
            f"{phase}->{dst}": {"messages": m, "bytes": b} for (phase, dst), (m, b) in sorted(self.comm.sent.items())
        }


def _setup(spec: dict) -> tuple[Hamiltonian, torch.Tensor, torch.Tensor]:
    """The centralised field, input batch and loss weights that every rank rebuilds identically from ``spec``."""
    g = torch.Generator().manual_seed(spec.get("seed", 0))
    field = centralised_h2(
        spec["sizes"],
        spec["R_layers"],
        spec["T"],
        spec["S"],
        T_end=spec.get("T_end", 1.0),
        J=spec.get("J", "structured"),
        generator=g,
        init_std=spec.get("init_std"),
    )
    n = field.dim
    K_mask, J_mask = h2_masks(spec["R_layers"], spec["T"], spec["sizes"])
    with torch.no_grad():
        field.b_p.data.normal_(0, 0.5, generator=g)
        field.b_q.data.normal_(0, 0.5, generator=g)
        if field.J_kind == "structured":
            noise = torch.randn(field.X.shape, generator=g, dtype=field.X.dtype)
            field.X.add_(0.3 * noise).mul_(J_mask[n // 2 :, : n // 2])
    y0 = torch.randn(spec.get("batch", 8), n, generator=g)
    c = torch.randn(spec.get("batch", 8), n, generator=g)
    return field, y0, c


def h2_node_worker(rank: int, world_size: int, spec: dict) -> dict:
    """One rank of a distributed H2 forward + backward of ``loss = Σ c ⊙ y_L``; returns outputs, gradients, traffic.

    ``spec``: ``sizes``, ``R_layers``, ``T``, ``S`` (node patterns), optional ``seed``, ``batch``, ``T_end``,
    ``J``, ``dtype`` ("float64"/"float32"), ``repeat`` (timed repetitions).
    """
    import time

    torch.set_default_dtype(getattr(torch, spec.get("dtype", "float64")))
    field, y0, c = _setup(spec)
    node = NodeH2(field, spec["sizes"], spec["R_layers"], spec["T"], spec["S"], rank)
    half = field.dim // 2
    rows = slice(node.off[rank], node.off[rank + 1])
    p0 = y0[:, :half][:, rows].clone().requires_grad_(True)
    q0 = y0[:, half:][:, rows].clone().requires_grad_(True)
    times = []
    for _ in range(spec.get("repeat", 1)):
        node.zero_grad()
        p0.grad = q0.grad = None
        node.comm.sent.clear()
        t0 = time.perf_counter()
        p, q = node(p0, q0)
        loss = (c[:, :half][:, rows] * p).sum() + (c[:, half:][:, rows] * q).sum()
        loss.backward()
        times.append(time.perf_counter() - t0)
    return {
        "p": p.detach(),
        "q": q.detach(),
        "dp0": p0.grad,
        "dq0": q0.grad,
        "time_s": times,
        "grads": {k: v.grad.detach() for k, v in node.params.items()},
        "traffic": node.traffic(),
        "neighbours": sorted(node.comm.neighbours),
        "layers": len(node.R),
    }


def run_h2(spec: dict, timeout_s: float = 300.0) -> list[dict]:
    """Check locality for every layer (raising before any process starts), then run one process per node."""
    from .launch import spawn

    for j, R in enumerate(spec["R_layers"]):
        check_locality(R, spec["T"], spec["S"], where=f"in layer {j}")
    return spawn(h2_node_worker, len(spec["sizes"]), spec, timeout_s=timeout_s)


def _forward_worker(rank: int, world_size: int, spec: dict) -> dict:
    """One rank of a no-grad distributed forward of a given (e.g. trained) centralised field on inputs ``y0``."""
    torch.set_default_dtype(spec["y0"].dtype)
    field = centralised_h2(spec["sizes"], spec["R_layers"], spec["T"], spec["S"], T_end=spec["T_end"], J=spec["J"])
    field.load_state_dict(spec["state"])
    node = NodeH2(field, spec["sizes"], spec["R_layers"], spec["T"], spec["S"], rank)
    half = field.dim // 2
    rows = slice(node.off[rank], node.off[rank + 1])
    y0 = spec["y0"]
    with torch.no_grad():
        p, q = node(y0[:, :half][:, rows], y0[:, half:][:, rows])
    return {"p": p, "q": q, "traffic": node.traffic(), "neighbours": sorted(node.comm.neighbours)}


def distributed_forward(
    field: Hamiltonian, sizes, R_layers, T, S, y0: torch.Tensor, J: str = "structured", timeout_s: float = 300.0
) -> tuple[torch.Tensor, list[dict]]:
    """``y_N`` of the masked H2 ``field`` (built by :func:`centralised_h2` with the same ``sizes``, ``R_layers``,
    ``T``, ``S``, ``J``) computed by one process per node, each holding only its node's parameter blocks and
    state rows and exchanging only with its neighbours in ``S``. Returns ``y_N`` assembled in the centralised
    layout ``(p, q)`` and each rank's traffic record."""
    from .launch import spawn

    for j, R in enumerate(R_layers):
        check_locality(R, T, S, where=f"in layer {j}")
    spec = {
        "sizes": list(sizes),
        "R_layers": R_layers,
        "T": T,
        "S": S,
        "T_end": field.T,
        "J": J,
        "state": {k: v.detach().clone() for k, v in field.state_dict().items()},
        "y0": y0.detach().clone(),
    }
    out = spawn(_forward_worker, len(sizes), spec, timeout_s=timeout_s)
    y = torch.cat([torch.cat([o["p"] for o in out], 1), torch.cat([o["q"] for o in out], 1)], 1)
    return y, [{"traffic": o["traffic"], "neighbours": o["neighbours"]} for o in out]
