"""A fixed-grid solve reads nothing back from the device inside its loop and makes no tensor from host values per
step: the evaluation times are made in one transfer and carry their values (``solvers.steppers.fast_rk.HOST_TIME``), so
a piecewise field finds its piece without ``float(t)``. On a GPU each such read is a synchronisation and would keep
the loop out of a CUDA graph; on CPU we count them: the counts must not grow with the number of steps."""

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.fields import NAIS, Hamiltonian


def _count(monkeypatch) -> dict[str, int]:
    counts = {"read": 0, "made": 0}

    def wrap(name: str, kind: str, owner=torch.Tensor):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            counts[kind] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for name in ("__float__", "__bool__", "item", "tolist"):
        wrap(name, "read")
    wrap("tensor", "made", torch)
    return counts


@pytest.mark.parametrize("method", ["euler", "rk4", "midpoint"])
def test_fixed_grid_loop_reads_nothing_back(monkeypatch, method):
    g = torch.Generator().manual_seed(0)
    field = Hamiltonian(4, layers=8, T=1.0, generator=g)  # piecewise: every evaluation looks up its piece
    y0 = torch.randn(5, 4, generator=g)
    counts = {}
    with torch.no_grad():
        for steps in (8, 64):
            block = ODEBlock(field, method=method, step_size=1.0 / steps)
            block(y0)  # warm: one-off work (option checks, grids) is not what we count
            seen = _count(monkeypatch)
            sol = block.solve(y0)
            monkeypatch.undo()
            counts[steps] = dict(seen)
            assert sol.stats["steps_forward"] == steps
    assert counts[8] == counts[64], counts


def test_solver_time_tensors_carry_their_value():
    """The piece a field reads at a solver's time equals the one ``float(t)`` gives, at and beside boundaries."""
    from cde_nets.solvers.steppers.fast_rk import HOST_TIME, _Clock

    field = NAIS(3, 2, layers=4, T=1.0)
    clock = _Clock(torch.zeros(1, dtype=torch.float32))
    values = [0.0, 0.25, clock.nudge(0.25, -1), clock.nudge(0.5, 1), 0.75, 1.0]
    for t in clock.many(values, host=True):
        assert getattr(t, HOST_TIME) == float(t)
        assert field.grid.index(t) == field.grid.index(float(t))
