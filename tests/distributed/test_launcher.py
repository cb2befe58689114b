"""The distributed launcher (``python -m cde_nets.experiments distributed``) runs end to end: its 4-process H2-DNN
equals the centralised one, and its 2-process DDP training the single-process one. A file apart from
test_data_parallel.py (each starts its own processes, about 15 s apiece), so that xdist can run them side by side."""

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_launcher_tiny_h2_on_4_processes_equals_centralised(tmp_path):
    """Four nodes, the fewest whose ring leaves each rank a non-neighbour (r + 2); each process costs a torch
    import (about 1 s of CPU). The 8-process ring of the launcher's default is the H-DNN Table II run's
    (tests/experiments/test_hdnn_protocol.py), which checks its partners the same way."""
    from cde_nets.experiments.distributed import main

    assert main(["--tiny", "--nodes", "4", "--mode", "h2", "--out", str(tmp_path)]) == 0
    h2 = json.loads((Path(tmp_path) / "distributed.json").read_text())["h2"]
    assert h2["nodes"] == 4 and h2["max_abs_diff_outputs"] < 1e-10 and h2["max_abs_diff_gradients"] < 1e-10
    for r, partners in enumerate(h2["partners"]):  # every rank talked, and only to its ring neighbours
        assert partners and set(partners) <= {(r - 1) % 4, (r + 1) % 4}, (r, partners)
    # per half step each rank sends its 1-entry state to one R-neighbour and its Kᵀσ contribution to the other;
    # batch 4, float64: forward 2 halves · 2 messages · 4 · 8 = 128 bytes per layer, the same again backward
    assert h2["forward_bytes_per_rank_per_layer"] == [128.0] * 4 and h2["bytes_per_rank_per_layer"] == [256.0] * 4


@pytest.mark.slow
def test_launcher_tiny_ddp(tmp_path):
    from cde_nets.experiments.distributed import main

    assert main(["--tiny", "--nodes", "2", "--mode", "ddp", "--out", str(tmp_path)]) == 0
    ddp = json.loads((Path(tmp_path) / "distributed.json").read_text())["ddp"]
    assert ddp["processes"] == 2 and ddp["max_abs_parameter_diff"] < 1e-6
    assert ddp["train_loss_ddp"] == pytest.approx(ddp["train_loss_single"], abs=1e-10)
