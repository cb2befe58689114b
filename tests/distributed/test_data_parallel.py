"""Data-parallel ``fit`` (DDP over gloo, loopback) equals single-process training; rank 0 alone snapshots. (The
distributed launcher's end-to-end runs are in test_launcher.py.)"""

import shutil

import pytest
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.blocks.models import Classifier
from cde_nets.datasets import Split
from cde_nets.distributed import data_parallel as dp
from cde_nets.distributed.launch import spawn
from cde_nets.fields import NAIS, Hamiltonian
from cde_nets.train import trainer as training
from cde_nets.train.trainer import Hooks, Snapshots, Trainer, load_snapshot, seeded, smoothness_RK

# n_train = 33, batch 16: batches 16, 16, 1; the last one leaves rank 1 of 2 without a sample.
# n_train = 45, batch 16: the last batch of 13 splits 7 / 6.
CASES = {
    "discrete": dict(n=33, batch=16, epochs=2),
    "adjoint": dict(n=45, batch=16, epochs=2),
    "backprop": dict(n=45, batch=16, epochs=2),
}


def data(n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * n, 2, generator=g, dtype=torch.float64)
    y = (x[:, 0] * x[:, 1] > 0).long()
    return Split(x[:n], y[:n], x[n:], y[n:])


def model(kind):
    with seeded(0):
        if kind == "discrete":
            return Classifier(discretize(Hamiltonian(4, layers=3, T=1.0), "euler"), 2, 4, 1)
        field = NAIS(4, 2, T=0.5, init_std=1.0)
        return Classifier(ODEBlock(field, method="rk4", step_size=0.125, gradient=kind), 2, 4, 1, input_as_u=True)


def train(rank, world, kind, ckpt=None, epochs=None, resume=False):
    """One rank's training (also called outside any process group for the single-process reference)."""
    torch.set_default_dtype(torch.float64)
    c = CASES[kind]
    m = model(kind)
    extra = {}
    if kind == "discrete":
        extra["regularisers"] = [smoothness_RK(1e-2, 1 / 3)]
    else:
        extra["hooks"] = Hooks(post_step=lambda mod: mod.block.field.project_())
    writes = []
    save = training.save_snapshot
    training.save_snapshot = lambda path, obj: (writes.append(path), save(path, obj))[1]
    try:
        trainer = Trainer(
            lr=0.05,
            seed=7,
            progress=False,
            snapshots=None if ckpt is None else Snapshots(ckpt, resume=resume),
            **extra,
        )
        hist = trainer.fit(m, data(c["n"]), epochs=epochs or c["epochs"], batch_size=c["batch"])
    finally:
        training.save_snapshot = save
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    refused = None
    try:  # a global batch smaller than the world is refused (on every rank, before any collective)
        Trainer(progress=False).fit(torch.nn.Linear(2, 1), data(8), epochs=1, batch_size=1)
    except ValueError as e:
        refused = str(e)
    return {
        "state": state,
        "history": hist,
        "world": dp.world_size(),
        "rank": dp.rank(),
        "refused": refused,
        "writes": len(writes),
    }


def train_each(rank, world, runs):
    """Several trainings in one set of processes (starting processes costs more than these trainings): ``runs``
    is ``[(kind, checkpoint path or None), ...]``."""
    return [train(rank, world, kind, ckpt) for kind, ckpt in runs]


def single(kind, **kw):
    old = torch.get_default_dtype()
    try:
        return train(0, 1, kind, **kw)
    finally:
        torch.set_default_dtype(old)


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


GROUPS = {"discrete": ("discrete",), "ode-block": ("adjoint", "backprop")}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Every group's two-process trainings from one spawn, the first kind of each group checkpointed:
    ``{group: (each rank's results, checkpoint path)}``."""
    runs, where = [], {}
    for group, kinds in GROUPS.items():
        ckpt = tmp_path_factory.mktemp(group.replace("-", "_")) / "ckpt" / "model.pt"
        where[group] = (len(runs), ckpt)
        runs += [(kind, str(ckpt) if i == 0 else None) for i, kind in enumerate(kinds)]
    out = spawn(train_each, 2, runs, timeout_s=240)
    return {g: ([o[at : at + len(GROUPS[g])] for o in out], ckpt) for g, (at, ckpt) in where.items()}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_two_process_ddp_equals_single_process(group, two_process_runs, tmp_path):
    kinds = GROUPS[group]
    out, ckpt = two_process_runs[group]
    refs = [single(kind) for kind in kinds]
    for j, (kind, ref) in enumerate(zip(kinds, refs, strict=True)):
        ranks = [o[j] for o in out]
        assert [r["world"] for r in ranks] == [2, 2] and [r["rank"] for r in ranks] == [0, 1]
        assert all("`batch_size` (1) is the global batch" in r["refused"] for r in ranks) and ref["refused"] is None
        assert max_diff(model(kind).state_dict(), ref["state"]) > 1e-3  # training moved the parameters
        for r in ranks:
            assert max_diff(r["state"], ref["state"]) < 1e-6, kind
            for h, h_ref in zip(r["history"], ref["history"], strict=True):  # every rank reports global metrics
                assert abs(h["train_loss"] - h_ref["train_loss"]) < 1e-10
                assert h["train_accuracy"] == h_ref["train_accuracy"]
                assert h["test_accuracy"] == h_ref["test_accuracy"]
    kind, ranks, ref = kinds[0], [o[0] for o in out], refs[0]
    # rank 0 alone wrote the snapshot, once per epoch, atomically: one file, holding the trained model
    assert [r["writes"] for r in ranks] == [CASES[kind]["epochs"], 0]
    assert [p.name for p in ckpt.parent.iterdir()] == ["model.pt"]
    assert max_diff(load_snapshot(ckpt)["model"], ranks[0]["state"]) == 0.0
    if kind == "discrete":  # resuming single-process from the 2-process snapshot continues the same run
        resumed = tmp_path / "resumed.pt"
        shutil.copy(ckpt, resumed)
        more = CASES[kind]["epochs"] + 1
        cont = single(kind, ckpt=str(resumed), epochs=more, resume=True)
        straight = single(kind, epochs=more)
        assert len(cont["history"]) == more
        assert max_diff(cont["state"], straight["state"]) < 1e-6
        assert max_diff(cont["state"], ref["state"]) > 1e-4  # the extra epoch did train


def test_shard_outside_a_group_is_the_whole_batch():
    idx = torch.arange(5)
    got, n, w = dp.shard(idx)
    assert got is idx and n == 5 and w == 1.0 and dp.world_size() == 1 and not dp.is_distributed()
