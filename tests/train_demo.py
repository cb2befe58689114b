"""Subprocess used by test_training: a small H1 classifier on swiss roll, checkpointed every epoch.

``python tests/train_demo.py CKPT OUT [--resume] [--sleep S]`` writes the final parameters and history to OUT.
"""

import sys
import time

import torch

from cde_nets import discretize
from cde_nets.datasets import swiss_roll
from cde_nets.fields import Hamiltonian
from cde_nets.models import Classifier
from cde_nets.training import fit, seeded, smoothness_RK

torch.set_num_threads(1)
ckpt, out = sys.argv[1], sys.argv[2]
resume = "--resume" in sys.argv
sleep = float(sys.argv[sys.argv.index("--sleep") + 1]) if "--sleep" in sys.argv else 0.0
data = swiss_roll(n=400, seed=3)
with seeded(3):
    model = Classifier(discretize(Hamiltonian(4, layers=8, T=1.0), "euler"), 2, 4, 1)
hist = fit(model, data, epochs=6, batch_size=50, lr=0.02, seed=3, checkpoint=ckpt, resume=resume, progress=False,
           regularisers=[smoothness_RK(1e-3, 1 / 8)], epoch_callback=lambda e, m, r: time.sleep(sleep))
torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()}, "history": hist}, out)
