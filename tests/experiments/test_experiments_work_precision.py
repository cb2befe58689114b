"""Tiny run of the work-precision study: the numbers its construction fixes."""

from __future__ import annotations

import pytest

from cde_nets.experiments import work_precision


@pytest.mark.slow
def test_work_precision_tiny(tmp_path):
    """Five fields, a plot each; costs as the module docstring counts them (per step: rk4 4, verlet 1.5 on H2
    (three halves) and 2 on kepler (two kicks, the drift free), mcate5 6 kicks on kepler, nystrom4 4 on the
    oscillator); every splitting method keeps Kepler's angular momentum to rounding (each substep is the flow of
    a rotation-invariant part) where rk4 does not."""
    res = work_precision.run("tiny", 0, tmp_path)
    curves = res["curves"]
    assert set(curves) == {"H1", "H2", "MS3", "oscillator", "kepler"}
    assert len(res["figures"]) == 5 and all((tmp_path / f"work_precision_{f}.png").exists() for f in curves)
    assert "verlet" not in curves["H1"] and "nystrom4" in curves["oscillator"] and "nystrom4" not in curves["H2"]
    per_step = {
        (f, m): r["drift"]["cost"] / r["drift"]["steps"]
        for f, c in curves.items()
        for m, r in c.items()
        if "drift" in r
    }
    assert per_step[("H1", "rk4")] == 4 and per_step[("H2", "verlet")] == 1.5 and per_step[("kepler", "verlet")] == 2
    assert per_step[("kepler", "mcate5")] == 6 and per_step[("oscillator", "nystrom4")] == 4
    kepler = curves["kepler"]
    for m in ("verlet", "mcate5"):
        assert kepler[m]["drift"]["extra_max"]["angular_momentum"] <= 1e-13
    assert kepler["rk4"]["drift"]["extra_max"]["angular_momentum"] > 1e-11
    assert all("dopri5 (adaptive)" in c for c in curves.values())
    cheapest = [r for r in res["rows"] if r["kind"] == "cheapest"]
    assert len(cheapest) == 5 * 4 and {r["error"] for r in cheapest} == {"energy_error", "state_error"}


def test_the_guide_shows_the_recorded_tables():
    """docs/guides/conservation.md carries the tables generated from the recorded result, as they are."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    guide = (root / "docs" / "guides" / "conservation.md").read_text()
    recorded = json.loads((root / "experiments" / "recorded_results" / "work_precision.json").read_text())
    assert work_precision.cheapest_table(recorded) in guide
    assert work_precision.drift_table(recorded) in guide
