"""Tiny run of the long-horizon conservation study: the numbers its construction fixes."""

from __future__ import annotations

import pytest

from cde_nets.experiments import long_conservation


@pytest.mark.slow
def test_long_conservation_tiny(tmp_path):
    res = long_conservation.run("tiny", 0, tmp_path)
    rows = {(r["field"], r["method"]): r for r in res["rows"]}
    assert {m for f, m in rows if f == "H1"} == {"euler", "rk4", "dopri5", "implicit_midpoint", "gl4", "gl6"}
    assert {m for f, m in rows if f == "H2"} >= {"symplectic_euler", "verlet", "yoshida4"}
    for (field, method), r in rows.items():
        symplectic = method in long_conservation.GAUSS or (field == "H2" and method in long_conservation.SPLIT)
        # the step map's defect: rounding for the symplectic methods, truncation error for the explicit ones
        assert (r["defect"] <= 1e-12) == symplectic, (field, method, r["defect"])
    # matched NFE: 4 evaluations per h for euler, rk4 and dopri5 (dopri5's last step may be shorter: ±6)
    assert rows[("H1", "euler")]["nfe"] == rows[("H1", "rk4")]["nfe"] == 800
    assert abs(rows[("H1", "dopri5")]["nfe"] - 800) <= 6
    assert (tmp_path / "long_conservation.png").exists()
