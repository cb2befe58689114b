"""Subprocess used by test_training: a small H1 classifier on swiss roll, snapshotted every epoch.

``python tests/train_demo.py CKPT OUT [--resume] [--hang-at E]`` (or ``main`` in-process) writes the final
parameters and history to OUT.
The model has dropout (it draws from the global torch RNG while training) and a step LR schedule, so an exact
resume needs every RNG state and the scheduler's state. ``--hang-at E`` trains epoch E, writes ``OUT.hang`` and
waits before that epoch's snapshot is written: the test kills the process there with SIGKILL.
"""

import sys
import time
from pathlib import Path

import torch

from cde_nets import discretize
from cde_nets.blocks.models import Classifier
from cde_nets.datasets import swiss_roll
from cde_nets.fields import Hamiltonian
from cde_nets.train.trainer import Hooks, Snapshots, Trainer, seeded, smoothness_RK


def main(ckpt: str, out: Path, resume: bool = False, hang_at: int = -1) -> None:
    def hang(epoch, model, metrics):
        if epoch == hang_at:
            out.with_suffix(".hang").write_text(str(epoch))
            time.sleep(600)

    data = swiss_roll(n=400, seed=3)
    with seeded(3):
        model = torch.nn.Sequential(
            torch.nn.Dropout(0.1), Classifier(discretize(Hamiltonian(4, layers=8, T=1.0), "euler"), 2, 4, 1)
        )
    trainer = Trainer(
        lr=0.02,
        seed=3,
        snapshots=Snapshots(ckpt, resume=resume),
        progress=False,
        regularisers=[smoothness_RK(1e-3, 1 / 8)],
        hooks=Hooks(epoch=hang),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    )
    hist = trainer.fit(model, data, epochs=6, batch_size=50)
    torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()}, "history": hist}, out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    hang = int(sys.argv[sys.argv.index("--hang-at") + 1]) if "--hang-at" in sys.argv else -1
    main(sys.argv[1], Path(sys.argv[2]), "--resume" in sys.argv, hang)
