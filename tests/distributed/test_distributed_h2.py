"""The distributed H2-DNN across processes equals the centralised masked model (Galimberti et al., Theorem H2)."""

import pytest
import torch

from cde_nets.distributed.h2 import _setup, run_h2
from cde_nets.fields.locality import LocalityError

M = 4
RING = [[1 if (i - j) % M in (0, 1, M - 1) else 0 for j in range(M)] for i in range(M)]
I = torch.eye(M, dtype=torch.int64).tolist()


def with_edges(*edges):
    R = [row[:] for row in I]
    for i, k in edges:
        R[i][k] = 1
    return R


def centralised_reference(spec):
    """eqs. H12-13 written out on the centralised masked field, float64."""
    torch.set_default_dtype(torch.float64)
    field, y0, c = _setup(spec)
    y0 = y0.clone().requires_grad_(True)
    n = field.dim // 2
    p, q = y0[:, :n], y0[:, n:]
    X, h = field.X_eff(), field.grid.h
    for j in range(field.layers):
        Kq, Kp = field.K_half(j, 1), field.K_half(j, 0)
        p = p - h * torch.tanh(q @ Kq.T + field.b_q[j]) @ Kq @ X
        q = q + h * torch.tanh(p @ Kp.T + field.b_p[j]) @ Kp @ X.T
    loss = (c * torch.cat([p, q], 1)).sum()
    loss.backward()
    return field, torch.cat([p, q], 1).detach(), y0.grad


CASES = {
    # T = I; each layer couples different ring neighbours through K
    "K along R": dict(
        sizes=[2, 1, 2, 1],
        T=I,
        S=RING,
        seed=3,
        batch=5,
        R_layers=[with_edges((0, 1), (2, 3)), with_edges((1, 2), (3, 0)), with_edges((1, 0), (3, 2))],
    ),
    # R = I; the learned X couples ring neighbours
    "X along T": dict(sizes=[1, 2, 1, 2], T=RING, S=RING, seed=4, batch=5, R_layers=[I, I, I]),
}


def _both_cases(rank, world_size, specs):
    """Each case's node worker in turn, in one set of processes (starting four processes costs more than both
    cases); the barrier keeps one case's messages from meeting the next case's receives."""
    import torch.distributed as dist

    from cde_nets.distributed.h2 import h2_node_worker

    out = []
    for spec in specs:
        out.append(h2_node_worker(rank, world_size, spec))
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def distributed_results():
    """``{case: per-rank results}``, both cases from one spawn; the locality check ``run_h2`` makes before
    spawning is made here too."""
    from cde_nets.distributed.launch import spawn
    from cde_nets.fields.locality import check_locality

    for spec in CASES.values():
        for j, R in enumerate(spec["R_layers"]):
            check_locality(R, spec["T"], spec["S"], where=f"in layer {j}")
    per_rank = spawn(_both_cases, M, list(CASES.values()), timeout_s=240)
    return {case: [ranks[i] for ranks in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_distributed_h2_equals_centralised(case, distributed_results):
    spec = CASES[case]
    results = distributed_results[case]
    old = torch.get_default_dtype()
    try:
        field, y_ref, dy_ref = centralised_reference(spec)
    finally:
        torch.set_default_dtype(old)
    n = field.dim // 2
    off = [0]
    for s in spec["sizes"]:
        off.append(off[-1] + s)
    y = torch.zeros_like(y_ref)
    dy = torch.zeros_like(dy_ref)
    for r, res in enumerate(results):
        rows = slice(off[r], off[r + 1])
        y[:, :n][:, rows], y[:, n:][:, rows] = res["p"], res["q"]
        dy[:, :n][:, rows], dy[:, n:][:, rows] = res["dp0"], res["dq0"]
        for name, g in res["grads"].items():
            kind, *idx = name.split("_")
            if kind in ("Kp", "Kq"):
                j, k = map(int, idx)
                ref = getattr(field, "K_p" if kind == "Kp" else "K_q").data.grad[j, rows, off[k] : off[k + 1]]
            elif kind in ("bp", "bq"):
                ref = getattr(field, "b_p" if kind == "bp" else "b_q").data.grad[int(idx[0]), rows]
            else:
                ref = field.X.grad[rows, off[int(idx[0])] : off[int(idx[0]) + 1]]
            assert torch.allclose(g, ref, atol=1e-10, rtol=0), name
    assert torch.allclose(y, y_ref, atol=1e-10, rtol=0)
    assert torch.allclose(dy, dy_ref, atol=1e-10, rtol=0)
    # every message went to a neighbour in S, and each rank did talk to the neighbours its sparsity needs
    for r, res in enumerate(results):
        allowed = {j for j in range(M) if RING[r][j] and j != r}
        dsts = {int(key.split("->")[1]) for key in res["traffic"]}
        assert dsts and dsts <= allowed, (r, dsts)


def test_sparsity_violating_the_graph_is_refused_before_spawning():
    spec = dict(sizes=[1] * M, T=I, S=RING, R_layers=[with_edges((0, 2))])  # node 0 reads node 2: not neighbours
    with pytest.raises(LocalityError, match=r"in layer 0: nodes \(1, 3\) \(1-based\)"):
        run_h2(spec, timeout_s=5)
