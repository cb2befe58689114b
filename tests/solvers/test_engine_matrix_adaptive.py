"""The engine matrix's event and dense cells on the explicit adaptive methods (the rest of the matrix is
tests/solvers/test_engine_matrix.py): every gradient method x the whole state at its first event, each sample at its
own event and a dense output, through ``ODEBlock`` and ``cde_nets.odeint``, served by both alike or refused by both
with the same message. A file of its own: their backward solves take half the matrix's time."""

from __future__ import annotations

import pytest
from engine_cases import check_event_and_dense_cells

from cde_nets.solvers.options import ADAPTIVE_METHODS


@pytest.mark.slow
@pytest.mark.parametrize("method", ADAPTIVE_METHODS)
def test_both_doors_serve_or_refuse_the_same_event_and_dense_cells(method: str) -> None:
    check_event_and_dense_cells(method)
