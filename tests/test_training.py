"""Training loop: learns, is reproducible bit for bit, and resumes exactly after SIGKILL."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.datasets import Split
from cde_nets.fields import NAIS
from cde_nets.models import Classifier
from cde_nets.training import fit, load_checkpoint, save_checkpoint, seeded

DEMO = str(Path(__file__).with_name("train_demo.py"))


def separable(seed=0, n=200):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, 2, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    x = x + 0.3 * (2 * y[:, None] - 1) * torch.tensor([1.0, 0.5])  # a margin: 100 % is attainable
    return Split(x[:n], y[:n], x[n:], y[n:])


def test_learns_a_linearly_separable_set():
    data = separable()
    with seeded(0):
        model = torch.nn.Linear(2, 1)
    hist = fit(model, data, epochs=30, batch_size=20, lr=0.1, progress=False)
    assert hist[-1]["test_accuracy"] == 1.0 and hist[-1]["train_accuracy"] == 1.0


def test_same_seed_same_bits():
    data = separable(1)
    params = []
    for _ in range(2):
        with seeded(7):
            model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        fit(model, data, epochs=3, batch_size=16, seed=7, progress=False)
        params.append(torch.cat([p.flatten() for p in model.parameters()]))
    assert torch.equal(params[0], params[1])


def test_post_step_projects_nais_after_every_step():
    data = separable(2)
    field = NAIS(4, 2, T=0.5, init_std=3.0)
    model = Classifier(ODEBlock(field, method="euler", gradient="backprop"), 2, 4, 1, input_as_u=True)
    norms = []

    def project(m):
        m.block.field.project_()
        R = m.block.field.R.data[0]
        norms.append(float(torch.linalg.matrix_norm(R.T @ R)))

    fit(model, data, epochs=1, batch_size=50, lr=0.5, post_step=project, progress=False)
    assert len(norms) == 4 and max(norms) <= (1 - 2 * field.eps) * (1 + 1e-6)


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    full = tmp_path / "full.pt"
    subprocess.run([sys.executable, DEMO, str(tmp_path / "a.ckpt"), str(full)], check=True, env=env, timeout=120)
    ckpt, out = tmp_path / "b.ckpt", tmp_path / "resumed.pt"
    proc = subprocess.Popen([sys.executable, DEMO, str(ckpt), str(out), "--sleep", "0.5"], env=env)
    deadline = time.time() + 90
    while time.time() < deadline:
        if ckpt.exists() and load_checkpoint(ckpt)["epoch"] >= 1:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = load_checkpoint(ckpt)["epoch"]
    assert 1 <= killed_at < 5 and not out.exists()  # really interrupted mid-run
    subprocess.run([sys.executable, DEMO, str(ckpt), str(out), "--resume"], check=True, env=env, timeout=120)
    a, b = torch.load(full), torch.load(out)
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    strip = lambda h: [{k: v for k, v in r.items() if k != "time_s"} for r in h]  # noqa: E731
    assert strip(a["history"]) == strip(b["history"])


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.ckpt"
    save_checkpoint(path, {"epoch": 1})

    def crash(*a, **k):
        raise KeyboardInterrupt("killed between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"epoch": 2})
    assert load_checkpoint(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]  # no temporary file left behind


def test_errors():
    with pytest.raises(ValueError, match="`task` must be"):
        fit(torch.nn.Linear(2, 1), separable(), epochs=1, task="ranking")
    with pytest.raises(ValueError, match="`epochs` must be a positive integer"):
        fit(torch.nn.Linear(2, 1), separable(), epochs=0)
