"""H-DNN Table I reproduction in its tiny setting: rows carry published and measured values; CLI writes JSON."""

import json

from experiments.__main__ import main
from experiments.hdnn_table1 import PUBLISHED


def test_table1_tiny_via_cli(tmp_path, capsys):
    assert main(["hdnn_table1", "--tiny", "--out", str(tmp_path), "--threads", "1"]) == 0
    res = json.loads((tmp_path / "hdnn_table1.json").read_text())
    h_rows = [r for r in res["rows"] if r["published"] is not None]
    assert len(h_rows) == 4 and all(0 <= r["ours"] <= 100 for r in h_rows)
    assert {r["published"] for r in h_rows} <= {v for pair in PUBLISHED.values() for v in pair}
    assert "| setting | published | ours |" in capsys.readouterr().out
