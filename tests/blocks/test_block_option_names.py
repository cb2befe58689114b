"""The block's options under the names a torchdiffeq user brings: ``options={"max_num_steps": n}`` is the block's
``max_steps``, and the unknown-option message of a per-sample block lists what that controller takes."""

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, SolverOptions
from cde_nets.solvers.errors import Reason, SolverError


class Blowup(nn.Module):
    """``y' = y²`` from 1 blows up at ``t = 1``: a tight tolerance takes many steps before ``T = 0.9``."""

    def forward(self, t, y):
        return y * y


def test_max_num_steps_is_max_steps():
    """``options={"max_num_steps": 5}`` (what ``odeint`` takes) sets ``max_steps`` and stops the solve there."""
    block = ODEBlock(Blowup(), T=0.9, rtol=1e-10, atol=1e-10, options={"max_num_steps": 5})
    assert block.max_steps == 5 and "max_num_steps" not in block.options
    with pytest.raises(SolverError, match=r"max_steps=5 reached") as info:
        block(torch.ones(2, 1, dtype=torch.float64))
    assert info.value.reason is Reason.MAX_STEPS
    same = SolverOptions(max_steps=7, options={"max_num_steps": 7})
    assert ODEBlock(Blowup(), T=0.9, solver=same).max_steps == 7
    assert SolverOptions(options={"max_num_steps": 9}).replace(rtol=1e-5).max_steps == 9


def test_max_steps_and_max_num_steps_that_disagree_are_refused():
    with pytest.raises(ValueError, match=r"`max_steps`=5 and options\['max_num_steps'\]=7 .* give one of them"):
        SolverOptions(max_steps=5, options={"max_num_steps": 7})
    with pytest.raises(ValueError, match=r"`options\['max_num_steps'\]` must be a positive integer"):
        SolverOptions(options={"max_num_steps": 0})


def test_per_sample_unknown_option_lists_what_per_sample_takes():
    """Under ``controller="per_sample"`` the message says so and lists the per-sample options: not ``step_t``,
    which that controller refuses (with its own message when given)."""
    with pytest.raises(ValueError, match=r"for method 'dopri5' under controller='per_sample'; valid: \[") as info:
        ODEBlock(Blowup(), T=0.9, controller="per_sample", options={"first_stp": 0.1})
    assert "step_t" not in str(info.value) and "first_step" in str(info.value)
    with pytest.raises(ValueError, match=r"controller='per_sample' has no per-sample `step_t`"):
        ODEBlock(Blowup(), T=0.9, controller="per_sample", options={"step_t": torch.tensor([0.5])})
    with pytest.raises(ValueError, match=r"for method 'dopri5'; valid: \[.*'step_t'"):
        ODEBlock(Blowup(), T=0.9, options={"first_stp": 0.1})
