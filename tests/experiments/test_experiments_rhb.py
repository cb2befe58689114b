"""Tiny runs of the Ruseckas, Hauser and blog reproductions (Ruseckas; blog; Hauser): JSON rows and exact parts."""

from __future__ import annotations

import json
import math

import pytest

from cde_nets.experiments import blog, hauser, ruseckas_circles
from cde_nets.experiments.report import write_result


def _check_rows(res: dict, tmp_path) -> dict:
    path = write_result(res, tmp_path)
    loaded = json.loads(path.read_text())
    assert loaded["rows"] and all({"setting", "published", "ours"} <= set(r) for r in loaded["rows"])
    assert any(r["published"] is not None and r["ours"] is not None for r in loaded["rows"])
    return {r["setting"]: r for r in loaded["rows"]}


def test_ruseckas_parameter_counts_601_and_240(tmp_path):
    rows = _check_rows(ruseckas_circles.run("tiny", 0, tmp_path), tmp_path)
    assert rows["model 1 parameters"]["ours"] == 601
    assert rows["model 2 parameters"]["ours"] == 240
    assert rows["model 1 learned γ̃ = hγ"]["published"] == 0.014
    assert 0 < rows["model 1 learned γ̃ = hγ"]["ours"] < 1


def test_blog_velocity_buffer_and_toy_slopes(tmp_path):
    res = blog.run("tiny", 0, tmp_path)
    rows = _check_rows(res, tmp_path)
    buf = res["settings"]["velocity_buffer"]
    assert buf["first"] == pytest.approx([0, 1, 0.2, 0.8, 0.4], abs=1e-12)
    assert buf["second"] == pytest.approx([0, 1, 0.7, 1.15, 0.975], abs=1e-12)
    toys = res["settings"]["toys"]
    assert abs(toys["first_slope"] + 1) < 0.2 and abs(toys["second_slope"] + 1) < 0.2
    # x_L = (1 + α/L)^L exactly for the first-order toy
    L, e = toys["depths"][0], toys["first_error"][0]
    assert e == pytest.approx(math.e - (1 + 1 / L) ** L, rel=1e-12)
    assert rows["velocity buffer, second order (m 0.5, η 1) x_0..x_4"]["ours"] == "0, 1, 0.7, 1.15, 0.975"


def test_hauser_tiny_rows_and_ratio(tmp_path):
    res = hauser.run("tiny", 0, tmp_path)
    rows = _check_rows(res, tmp_path)
    assert rows["perturbation ratio, 20-layer C0 net"]["published"] == 1.31
    assert rows["1-D bands, 1 node, C2 (test)"]["published"] == 100.0
    assert rows["1-D bands, 1 node, C1 (test)"]["published"] == "<= 75"
    for r in rows.values():
        if r["unit"] == "%":
            assert _count_of(r["ours"], 200), r  # 200 test points in each tiny set
    assert res["settings"]["results"]["C0"]["ratio"] > 0


def _count_of(percent: float, n: int) -> bool:
    """Whether ``percent`` is a whole number of ``n`` test samples (an accuracy is a count, not any number in
    [0, 100])."""
    k = percent * n / 100
    return abs(k - round(k)) <= 1e-6 * n and 0 <= round(k) <= n
