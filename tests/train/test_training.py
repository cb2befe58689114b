"""Training loop: learns, adds the regularisers exactly, is reproducible bit for bit, resumes exactly after SIGKILL,
and never leaves a torn snapshot."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cde_nets import ODEBlock, discretize
from cde_nets.blocks.models import Classifier
from cde_nets.datasets import Split
from cde_nets.fields import NAIS, CubicFriction
from cde_nets.fields.pieces import Pieces, TimeGrid
from cde_nets.solvers.errors import Reason, SolverError
from cde_nets.train.trainer import (
    Hooks,
    NonFiniteError,
    Regulariser,
    SnapshotError,
    Snapshots,
    Trainer,
    evaluate,
    load_snapshot,
    save_snapshot,
    seeded,
    smoothness_R82,
    smoothness_RK,
    spectral_R_ell,
    weight_decay,
)

DEMO = str(Path(__file__).with_name("train_demo.py"))


def separable(seed=0, n=200):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, 2, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    x = x + 0.3 * (2 * y[:, None] - 1) * torch.tensor([1.0, 0.5])  # margin 0.375 from the line: 100 % attainable
    return Split(x[:n], y[:n], x[n:], y[n:])


def test_learns_a_linearly_separable_set():
    data = separable()
    with seeded(0):
        model = torch.nn.Linear(2, 1)
    hist = Trainer(lr=0.1, progress=False).fit(model, data, epochs=30, batch_size=20)
    assert hist[-1]["test_accuracy"] == 1.0 and hist[-1]["train_accuracy"] == 1.0
    assert [h["epoch"] for h in hist] == list(range(30))
    assert evaluate(model, data.x_test, data.y_test)["accuracy"] == 1.0


def test_regression_reaches_the_least_squares_solution(f64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g)
    y = x @ torch.tensor([[1.0, -2.0], [0.5, 0.0], [3.0, 1.0]]) + 0.1 * torch.randn(64, 2, generator=g)
    X1 = np.hstack([x.numpy(), np.ones((64, 1))])
    coef = np.linalg.lstsq(X1, y.numpy(), rcond=None)[0]
    model = torch.nn.Linear(3, 2)
    trainer = Trainer(task="regression", progress=False, optimizer=lambda p: torch.optim.SGD(p, lr=0.3))
    hist = trainer.fit(model, (x, y, None, None), epochs=400, batch_size=64)
    assert np.allclose(model.weight.detach().numpy(), coef[:3].T, atol=1e-9)
    assert np.allclose(model.bias.detach().numpy(), coef[3], atol=1e-9)
    resid = X1 @ coef - y.numpy()
    assert hist[-1]["train_loss"] == pytest.approx(float(np.mean(resid**2)), rel=1e-9)


class _Piecewise(torch.nn.Module):
    def __init__(self):
        super().__init__()
        init = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 2.0], [1.0, 2.0]])
        self.w = Pieces(TimeGrid(1.0, 4), (2,), init=init)


def test_regulariser_values_match_their_closed_forms(f64):
    m = _Piecewise()  # Σ‖w_l − w_{l−1}‖² = 1 + 4 + 0 = 5, h = 1/4
    assert float(smoothness_R82(1.0).fn(m).detach()) == pytest.approx(5 / (2 * 0.25), rel=1e-15)
    assert float(smoothness_RK(1.0, 0.25).fn(m).detach()) == pytest.approx(5 * 0.25 / 2, rel=1e-15)
    stack = torch.stack([torch.diag(torch.tensor([3.0, 1.0])), torch.tensor([[0.0, 2.0], [0.0, 0.0]])])
    J = torch.tensor([[1.0, 1.0], [1.0, 1.0]])  # spectral norm 2
    assert float(spectral_R_ell(1.0, lambda _: [stack, J]).fn(m)) == pytest.approx(3 + 2 + 2, rel=1e-14)
    assert float(weight_decay(1.0).fn(m).detach()) == pytest.approx(1 + 1 + 4 + 1 + 4, rel=1e-15)


def test_fit_adds_the_weighted_regulariser_to_the_loss(f64):
    """One full-batch SGD step: θ₁ = θ₀ − η ∇(loss + λ‖θ‖²), and ``reg_weight_decay`` reports ‖θ₀‖²."""
    data = separable(3, n=8)
    with seeded(1):
        model = torch.nn.Linear(2, 1)
    theta0 = [p.detach().clone() for p in model.parameters()]
    ref = torch.nn.Linear(2, 1)
    ref.load_state_dict(model.state_dict())
    loss = torch.nn.functional.binary_cross_entropy_with_logits(ref(data.x_train)[:, 0], data.y_train.double())
    loss = loss + 0.5 * sum(p.square().sum() for p in ref.parameters())
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    trainer = Trainer(progress=False, regularisers=[weight_decay(0.5)], optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    hist = trainer.fit(model, data, epochs=1, batch_size=8)
    for p, p0, g in zip(model.parameters(), theta0, grads):
        assert torch.allclose(p.detach(), p0 - 0.1 * g, rtol=0, atol=1e-15)
    assert hist[0]["reg_weight_decay"] == pytest.approx(sum(float(p.square().sum()) for p in theta0), rel=1e-15)


def test_one_seed_fixes_training_bit_for_bit_even_with_dropout():
    data = separable(1)

    def run(seed, disturb):
        with seeded(7):
            model = torch.nn.Sequential(
                torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
            )
        torch.rand(disturb)  # whatever the caller drew before, fit's seed decides batches and dropout masks
        hist = Trainer(seed=seed, progress=False).fit(model, data, epochs=3, batch_size=16)
        return torch.cat([p.detach().flatten() for p in model.parameters()]), hist

    (a, ha), (b, hb), (c, _) = run(7, 1), run(7, 5), run(8, 1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert [h["train_loss"] for h in ha] == [h["train_loss"] for h in hb]


def test_scheduler_factory_steps_once_per_epoch(capsys):
    trainer = Trainer(
        progress=True,
        desc="sched",
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    )
    hist = trainer.fit(torch.nn.Linear(2, 1), separable(), epochs=4, batch_size=50)
    assert [h["lr"] for h in hist] == [0.1, 0.1, 0.05, 0.05]
    err = capsys.readouterr().err  # not a terminal: one line per epoch, no bar redrawn with carriage returns
    assert "\r" not in err
    assert [line.split()[:2] for line in err.splitlines()] == [["sched", f"{k}/4"] for k in range(1, 5)]


def test_progress_on_a_terminal_is_a_bar():
    import io

    from cde_nets.train.progress import LineProgress, progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(progress(3, stream=io.StringIO()), LineProgress)
    bar = progress(3, desc="t", stream=Terminal())
    assert not isinstance(bar, LineProgress)
    bar.close()


def test_post_step_projects_nais_after_every_step():
    data = separable(2)
    field = NAIS(4, 2, T=0.5, init_std=3.0)
    model = Classifier(ODEBlock(field, method="euler", gradient="backprop"), 2, 4, 1, input_as_u=True)
    norms = []

    def project(m):
        m.block.field.project_()
        R = m.block.field.R.data[0]
        norms.append(float(torch.linalg.matrix_norm(R.T @ R).detach()))

    Trainer(lr=0.5, hooks=Hooks(post_step=project), progress=False).fit(model, data, epochs=1, batch_size=50)
    assert len(norms) == 4 and max(norms) <= (1 - 2 * field.eps) * (1 + 1e-6)


def _demo_module():
    spec = importlib.util.spec_from_file_location("train_demo", DEMO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    full_out, ckpt, out = tmp_path / "full.pt", tmp_path / "b.snapshot", tmp_path / "resumed.pt"
    victim = subprocess.Popen([sys.executable, DEMO, str(ckpt), str(out), "--hang-at", "3"], env=env)
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in the subprocesses
        try:
            _demo_module().main(str(tmp_path / "a.snapshot"), full_out)  # the uninterrupted run, meanwhile
        finally:
            torch.set_num_threads(threads)
        deadline = time.time() + 120
        while not out.with_suffix(".hang").exists() and victim.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert victim.poll() is None, "the demo ended before reaching the hang point"
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
    # killed after training epoch 3, before its snapshot: the file holds epoch 2 (StepLR mid-period)
    assert load_snapshot(ckpt)["epoch"] == 2 and not out.exists()
    torn = tmp_path / f".b.snapshot.{victim.pid}.x1y2.tmp"  # what a kill during a write leaves (its writer is dead)
    torn.write_bytes(b"\x80half a pickle")
    subprocess.run([sys.executable, DEMO, str(ckpt), str(out), "--resume"], check=True, env=env, timeout=120)
    a, b = torch.load(full_out), torch.load(out)
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    strip = lambda h: [{k: v for k, v in r.items() if k != "time_s"} for r in h]  # noqa: E731
    assert len(b["history"]) == 6 and strip(a["history"]) == strip(b["history"])
    assert not torn.exists()


def _state(epoch: int) -> dict:
    return {"model": {}, "optimizer": {}, "epoch": epoch, "history": []}


def test_snapshot_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.snapshot"
    save_snapshot(path, _state(1))

    def crash(*a, **k):
        raise KeyboardInterrupt("killed between write and rename")

    with monkeypatch.context() as mp:
        mp.setattr(os, "replace", crash)
        with pytest.raises(KeyboardInterrupt):
            save_snapshot(path, _state(2))
    assert load_snapshot(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.snapshot"]  # no temporary file left behind
    save_snapshot(path, _state(3))
    assert load_snapshot(path)["epoch"] == 3
    assert (path.stat().st_mode & 0o777) == 0o644  # readable like any results file


def test_cleanup_leaves_a_live_writers_temporary_file(tmp_path):
    """Two runs writing one file: the clean-up of stale temporary files must not delete the other's in flight."""
    path = tmp_path / "c.snapshot"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = tmp_path / f".c.snapshot.{other.pid}.abcd.tmp"
        live.write_bytes(b"in flight")
        save_snapshot(path, _state(1))
        assert live.exists()
    finally:
        other.kill()
        other.wait()
    save_snapshot(path, _state(2))
    assert not live.exists()  # its writer is gone: now it is stale


def test_errors(tmp_path):
    data = separable()
    with pytest.raises(ValueError, match="`task` must be"):
        Trainer(task="ranking")
    with pytest.raises(ValueError, match="`epochs` must be a positive integer"):
        Trainer().fit(torch.nn.Linear(2, 1), data, epochs=0)
    with pytest.raises(TypeError, match="`optimizer` must be a factory"):
        Trainer(progress=False, optimizer=lambda p: list(p)).fit(torch.nn.Linear(2, 1), data, epochs=1)
    with pytest.raises(ValueError, match="`data` must be a Split"):
        Trainer().fit(torch.nn.Linear(2, 1), data[:2], epochs=1)
    with pytest.raises(FileNotFoundError, match="no snapshot at"):
        load_snapshot(tmp_path / "missing.snapshot")


# -- a trainer you can leave running --------------------------------------------------------------------------
def _sqrt_regulariser(step_of_nan: int) -> Regulariser:
    """sqrt(d) with d = 0 on the given call: a finite value (0) whose gradient is inf · 0 = NaN."""
    calls = {"n": 0}

    def fn(m):
        calls["n"] += 1
        w = next(m.parameters())
        d = w.square().sum() * (0.0 if calls["n"] == step_of_nan else 1.0)
        return d.sqrt()

    return Regulariser("sqrt", 1e-3, fn)


def test_a_nan_gradient_under_a_finite_loss_is_never_stepped_nor_saved(tmp_path):
    data = separable(n=40)
    ck = tmp_path / "n.snapshot"
    with seeded(0):
        model = torch.nn.Linear(2, 1)
    trainer = Trainer(progress=False, regularisers=[_sqrt_regulariser(6)], snapshots=Snapshots(ck))
    with pytest.raises(
        NonFiniteError,
        match=r"gradient became non-finite in epoch 1, batch 0 .* the last good "
        r"snapshot is .*n.snapshot",
    ) as info:
        trainer.fit(model, data, epochs=3, batch_size=8)  # 5 batches an epoch: call 6 is epoch 1, batch 0
    assert info.value.last_snapshot == ck
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    saved = load_snapshot(ck)
    assert saved["epoch"] == 0 and all(bool(torch.isfinite(v).all()) for v in saved["model"].values())

    with seeded(0):
        model = torch.nn.Linear(2, 1)
    hist = Trainer(progress=False, regularisers=[_sqrt_regulariser(6)], nonfinite="skip").fit(
        model, data, epochs=3, batch_size=8
    )
    assert [h["skipped_steps"] for h in hist] == [0, 1, 0]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _trained(tmp_path, **kw) -> tuple[Path, Split]:
    data = separable(n=40)
    ck = tmp_path / "r.snapshot"
    with seeded(0):
        model = torch.nn.Linear(2, 1)
    Trainer(progress=False, snapshots=ck, lr=0.01, **kw).fit(model, data, epochs=2, batch_size=8)
    return ck, data


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(lr=0.5), r"optimizer: .*'lr': 0.01.* in the snapshot, .*'lr': 0.5"),
        (dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)), r"optimizer: .*'class': 'Adam'"),
        (dict(regularisers=[weight_decay(0.1)]), r"regularisers: \[\] in the snapshot, \[\['weight_decay', 0.1\]\]"),
        (dict(task="regression"), r"task: 'classification' in the snapshot, 'regression' now"),
        (dict(seed=3), r"seed: 0 in the snapshot, 3 now"),
        (dict(batch_size=4), r"batch_size: 8 in the snapshot, 4 now"),
        (dict(model=torch.nn.Linear(2, 2)), r"model parameter 'weight' has shape \[1, 2\] in the snapshot, \[2, 2\]"),
        (dict(data=separable(5, n=40)), r"data: "),
        (dict(epochs=1), r"already holds 2 epochs but epochs=1"),
    ],
)
def test_resume_refuses_changed_settings(tmp_path, change, match):
    ck, data = _trained(tmp_path)
    kw = dict(lr=0.01)
    model = change.pop("model", torch.nn.Linear(2, 1))
    data = change.pop("data", data)
    epochs = change.pop("epochs", 3)
    batch_size = change.pop("batch_size", 8)
    if "optimizer" in change:
        kw.pop("lr")
    kw.update(change)
    with pytest.raises(SnapshotError, match=match):
        Trainer(progress=False, snapshots=Snapshots(ck, resume=True), **kw).fit(
            model, data, epochs=epochs, batch_size=batch_size
        )


def test_resume_may_extend_epochs_and_leaves_the_global_random_state_alone(tmp_path):
    ck, data = _trained(tmp_path)
    state = torch.get_rng_state()
    with seeded(0):
        model = torch.nn.Linear(2, 1)
    torch.set_rng_state(state)
    hist = Trainer(progress=False, lr=0.01, snapshots=Snapshots(ck, resume=True)).fit(
        model, data, epochs=4, batch_size=8
    )
    assert [h["epoch"] for h in hist] == [0, 1, 2, 3]
    assert torch.equal(torch.get_rng_state(), state)  # the trainer drew from generators of its own


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"is empty \(0 bytes\)"),
        (b"\x80\x02garbage", r"is corrupt or truncated"),
        ("truncated", r"is corrupt or truncated"),
        ("not-a-snapshot", r"is not a cde_nets training snapshot"),
    ],
)
def test_snapshot_loader_says_what_is_wrong(tmp_path, content, match):
    path = tmp_path / "bad.snapshot"
    if content == "truncated":
        save_snapshot(path, _state(1) | {"model": {"w": torch.randn(1000)}})
        path.write_bytes(path.read_bytes()[:-500])
    elif content == "not-a-snapshot":
        torch.save({"weights": 1}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(SnapshotError, match=match):
        load_snapshot(path)


@pytest.mark.parametrize(
    ("data", "exc", "match"),
    [
        (
            Split(torch.randn(8, 2), torch.tensor([0, 2, 1, 0, 1, 0, 1, 0]), None, None),
            ValueError,
            r"y_train has label 2 at sample 1; labels must be 0 or 1 for one logit",
        ),
        (Split(torch.randn(8, 2), torch.rand(8), None, None), TypeError, r"y_train must hold integer class labels"),
        (
            Split(
                torch.randn(8, 2).index_put_((torch.tensor([5]),), torch.tensor(float("nan"))),
                torch.zeros(8).long(),
                None,
                None,
            ),
            ValueError,
            r"x_train holds a non-finite value at sample 5",
        ),
    ],
)
def test_bad_training_data_is_named(data, exc, match):
    with pytest.raises(exc, match=match):
        Trainer(progress=False).fit(torch.nn.Linear(2, 1), data, epochs=1, batch_size=4)


def test_out_of_range_labels_for_several_logits():
    data = Split(torch.randn(8, 2), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), None, None)
    with pytest.raises(ValueError, match=r"label 3 at sample 3; labels must be in 0..2 for 3 logits"):
        Trainer(progress=False).fit(torch.nn.Linear(2, 3), data, epochs=1, batch_size=4)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(lr=-0.1), ValueError, r"`lr` must be a finite number > 0"),
        (dict(lr=0.1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)), ValueError, r"`lr` sets the default Adam"),
        (dict(nonfinite="ignore"), ValueError, r"`nonfinite` must be 'raise' or 'skip'"),
        (dict(seed=-1), ValueError, r"`seed` must be a non-negative integer"),
        (dict(regularisers=[lambda m: 0]), TypeError, r"`regularisers` must hold Regulariser terms"),
        (dict(snapshots=3), TypeError, r"`snapshots` must be a Snapshots policy or a path"),
        (dict(scheduler_interval="step"), ValueError, r"`scheduler_interval` must be 'epoch' or 'batch'"),
    ],
)
def test_trainer_settings_are_checked(kw, exc, match):
    with pytest.raises(exc, match=match):
        Trainer(**kw)


class _BlowsUpOnCall(torch.nn.Module):
    """A discrete cubic-friction net whose ``h = 1`` steps diverge once ``γ x² > 2``: fed a huge input on one
    given training step, its block raises the library's non-finite state error in the forward pass."""

    def __init__(self, call_of_nan: int):
        super().__init__()
        self.net = discretize(CubicFriction(2, layers=4, T=4.0, gamma=0.1), "euler")
        self.out = torch.nn.Linear(2, 1)
        self.calls, self.call_of_nan = 0, call_of_nan

    def forward(self, x):
        self.calls += self.training  # training steps only: the per-epoch test evaluation is not counted
        return self.out(self.net(x * (1e3 if self.training and self.calls == self.call_of_nan else 1.0)))


def test_a_block_diverging_in_the_forward_pass_follows_the_nonfinite_policy():
    data = separable(n=40)
    with seeded(0):
        model = _BlowsUpOnCall(call_of_nan=6)
    with pytest.raises(NonFiniteError, match=r"state became non-finite in epoch 1, batch 0 \(the state became") as e:
        Trainer(progress=False).fit(model, data, epochs=3, batch_size=8)  # 5 batches an epoch: call 6 is epoch 1
    assert isinstance(e.value.__cause__, SolverError) and e.value.__cause__.reason is Reason.NONFINITE
    with seeded(0):
        model = _BlowsUpOnCall(call_of_nan=6)
    hist = Trainer(progress=False, nonfinite="skip").fit(model, data, epochs=3, batch_size=8)
    assert [h["skipped_steps"] for h in hist] == [0, 1, 0]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_evaluate_counts_a_sample_whose_state_diverges_as_wrong_and_says_how_many():
    with seeded(0):
        model = torch.nn.Sequential(
            discretize(CubicFriction(2, layers=4, T=4.0, gamma=0.1), "euler"), torch.nn.Linear(2, 3)
        )
    x = torch.randn(10, 2, generator=torch.Generator().manual_seed(1))
    x[[3, 7]] *= 1e3  # γ x² ≫ 2 for these two: the h = 1 step blows up
    y = model(x[[0, 1, 2, 4, 5, 6, 8, 9]]).argmax(-1)  # the others' own predictions: all right
    y = torch.cat([y[:3], torch.tensor([0]), y[3:6], torch.tensor([0]), y[6:]])
    res = evaluate(model, x, y, batch_size=4)
    finite = evaluate(model, x[[0, 1, 2, 4, 5, 6, 8, 9]], y[[0, 1, 2, 4, 5, 6, 8, 9]])
    assert res["nonfinite"] == 2 and res["accuracy"] == 8 / 10
    assert res["loss"] == pytest.approx(finite["loss"], rel=1e-6) and finite["nonfinite"] == 0
