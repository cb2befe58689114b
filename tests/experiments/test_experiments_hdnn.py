"""H-DNN Table I reproduction in its tiny setting: rows carry published and measured values; CLI writes JSON."""

import json

from cde_nets.experiments.__main__ import main
from cde_nets.experiments.hdnn_table1 import PUBLISHED


def test_table1_tiny_via_cli(tmp_path, capsys):
    assert main(["hdnn_table1", "--tiny", "--out", str(tmp_path), "--threads", "1"]) == 0
    res = json.loads((tmp_path / "hdnn_table1.json").read_text())
    h_rows = [r for r in res["rows"] if r["published"] is not None]
    assert len(h_rows) == 4 and all(_count_of(r["ours"], 200) for r in h_rows)  # n = 400: 200 test points
    assert {r["published"] for r in h_rows} <= {v for pair in PUBLISHED.values() for v in pair}
    assert "| setting | published | reference code | ours |" in capsys.readouterr().out


def test_margins_judge_only_full_runs_and_name_misses(tmp_path):
    import json

    from cde_nets.experiments.margins import check
    from cde_nets.experiments.margins import main as margins_main

    def write(name, size, rows):
        (tmp_path / f"{name}.json").write_text(
            json.dumps({"name": name, "size": size, "rows": [{"setting": s, "ours": v} for s, v in rows.items()]})
        )

    write(
        "hdnn_table1",
        "full",
        {
            "swiss roll, H1, 64 layers (test)": 98.9,
            "double moons, H1, 4 layers (test)": 99.5,
            "double moons, H2, 4 layers (test)": 100.0,
        },
    )
    write("hauser", "quick", {"1-D bands, 1 node, C2 (test)": 50.0, "1-D bands, 1 node, C1 (test)": 75.0})
    status = {(r["reproduction"], r["setting"]): r["status"] for r in check(tmp_path)}
    assert status[("hdnn_table1", "swiss roll, H1, 64 layers (test)")] == "missed"  # 98.9 < 99
    assert status[("hdnn_table1", "double moons, H1, 4 layers (test)")] == "met"  # the bound itself passes
    assert status[("hauser", "1-D bands, 1 node, C2 (test)")] == "not judged (quick setting)"
    assert status[("hdnn_fig4", "tanh MLP, 32 layers: test accuracy")] == "not run"
    assert margins_main(["--from", str(tmp_path)]) == 1


def _count_of(percent: float, n: int) -> bool:
    """Whether ``percent`` is a whole number of ``n`` test samples (an accuracy is a count, not any number in
    [0, 100])."""
    k = percent * n / 100
    return abs(k - round(k)) <= 1e-6 * n and 0 <= round(k) <= n
