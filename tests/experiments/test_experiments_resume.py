"""The NAIS-digits tiny run's numbers, and ``python -m cde_nets.experiments NAME --resume`` after a SIGKILL ends
with that uninterrupted run's results (one run, made once per session, read by both)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cde_nets.experiments import nais_digits
from cde_nets.experiments.__main__ import main
from cde_nets.train.trainer import SnapshotError, Trainer, load_snapshot, snapshotting

ROOT = Path(__file__).resolve().parents[2]
NAME = "nais_digits"  # four trainings of several epochs in its tiny setting: a kill lands mid-run


def _measured(out: Path) -> list:
    rows = json.loads((out / f"{NAME}.json").read_text())["rows"]
    return [(r["setting"], r["ours"]) for r in rows]


@pytest.mark.slow
def test_nais_digits_tiny(nais_digits_tiny):
    res = json.loads((nais_digits_tiny / "nais_digits.json").read_text())  # the run resumed below
    rows = {r["setting"]: r for r in res["rows"]}
    K = nais_digits.SETTINGS["tiny"]["K"]
    nais = rows[f"NAIS-Net, K = {K} shared stages (test)"]
    assert nais["published"] == 97.28 and rows[f"ResNet-SH, K = {K} shared stages (test)"]["published"] == 95.86
    # two epochs already beat chance (10 %) by a wide margin for the stable net
    assert 20.0 < nais["ours"] <= 100.0
    # evaluation unrolls to convergence: never beyond EVAL_MAX_DEPTH, every sample takes at least one stage
    depths = [d for ds in res["settings"]["depths_per_class"].values() for d in ds]
    assert len(depths) == 450 and 1 <= min(depths) and max(depths) <= nais_digits.EVAL_MAX_DEPTH


@pytest.mark.slow
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, nais_digits_tiny):
    # the uninterrupted run (the same command in this process) is the one test_nais_digits_tiny reads
    whole, broken = nais_digits_tiny, tmp_path / "broken"

    cmd = [sys.executable, "-m", "cde_nets.experiments", NAME, "--tiny", "--threads", "1", "--out", str(broken)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = broken / "snapshots" / f"{NAME}-tiny-seed0"
    deadline = time.monotonic() + 120
    while not any(ckpts.glob("001-*.snapshot")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (broken / f"{NAME}.json").exists(), "the run finished before the kill: nothing was resumed"
    (first,) = ckpts.glob("001-*.snapshot")
    epoch0 = load_snapshot(first)["history"][0]

    assert main([NAME, "--tiny", "--threads", "1", "--out", str(broken), "--resume"]) == 0
    assert _measured(broken) == _measured(whole)
    # the first training's first epoch was resumed, not retrained (a rerun would have measured a new time)
    assert load_snapshot(first)["history"][0] == epoch0


def test_snapshotting_block_names_files_and_refuses_other_data(tmp_path):
    import torch
    from torch import nn

    def data(scale):
        g = torch.Generator().manual_seed(0)
        x = scale * torch.randn(32, 3, generator=g)
        return x, (x[:, 0] > 0).long(), x, (x[:, 0] > 0).long()

    def run(d, resume):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        with snapshotting(tmp_path, resume=resume):
            return Trainer(seed=0, progress=False, desc="probe run").fit(model, d, epochs=2, batch_size=8)

    first = run(data(1.0), resume=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["001-probe_run.snapshot"]
    assert run(data(1.0), resume=True) == first  # finished: the stored history comes back
    with pytest.raises(SnapshotError, match="written with other settings.*\n  data: "):
        run(data(2.0), resume=True)
