"""The command line: listing without a name, help that lists every experiment and benchmark with its times, tiny
runs that write their JSON and plots with mode 0644. Fast calls only (one ``--tiny`` run of a fast reproduction)."""

from __future__ import annotations

import json
import stat

import pytest

from cde_nets.benchmarks.__main__ import BENCHMARKS
from cde_nets.benchmarks.__main__ import main as benchmarks_main
from cde_nets.cli import main as cli
from cde_nets.experiments.__main__ import main as experiments_main
from cde_nets.experiments.registry import FULL_RUN_PENDING, REPRODUCTIONS, times


def test_no_name_lists_the_reproductions_with_times_and_runs_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["experiments"]) == 0
    out = capsys.readouterr().out
    for name in REPRODUCTIONS:
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert " s " in line or " min " in line, line  # at least one recorded or measured time
    assert "all --quick" in out
    assert not (tmp_path / "results").exists()  # nothing ran


def test_every_reproduction_has_a_time_for_each_setting_it_was_run_in():
    for name in REPRODUCTIONS:
        t = times(name)
        # a reproduction awaiting its first full run says so, and stops saying so once it is recorded
        assert "tiny" in t and ("full" in t) != (name in FULL_RUN_PENDING), (name, t)
        assert all(v > 0 for v in t.values())


def test_experiments_help_lists_every_experiment_and_benchmark(capsys):
    with pytest.raises(SystemExit) as exc:
        experiments_main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in [*REPRODUCTIONS, *(b[0] for b in BENCHMARKS)]:
        assert f"  {name} " in out, name
    assert "tiny" in out and "quick" in out and "full" in out


def test_benchmarks_help_lists_the_benchmarks(capsys):
    with pytest.raises(SystemExit) as exc:
        cli(["benchmarks", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name, _, goal in BENCHMARKS:
        assert f"  {name} " in out and goal in out, name


def test_top_level_help_and_unknown_command(capsys):
    assert cli(["--help"]) == 0
    assert "experiments" in capsys.readouterr().out
    assert cli(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_unknown_reproduction_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        experiments_main(["nope", "--tiny", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "unknown reproduction 'nope'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_tiny_run_writes_json_and_plot_with_mode_0644(tmp_path, capsys):
    assert experiments_main(["hdnn_fig4", "--tiny", "--out", str(tmp_path), "--no-snapshots"]) == 0
    res = json.loads((tmp_path / "hdnn_fig4.json").read_text())
    assert res["size"] == "tiny" and res["figures"]
    for path in (tmp_path / "hdnn_fig4.json", tmp_path / "hdnn_fig4.png"):
        assert path.exists(), path
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert "hdnn_fig4" in capsys.readouterr().out


def test_benchmarks_reject_an_unknown_name(capsys):
    with pytest.raises(SystemExit):
        benchmarks_main(["--only", "nope"])


@pytest.mark.parametrize("command", ["experiments", "benchmarks", "experiments distributed"])
def test_help_names_the_command_typed_and_shows_no_markup(command, capsys):
    with pytest.raises(SystemExit):
        cli([*command.split(), "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: cde-nets {command} ")
    for markup in ("``", ":data:", ":func:", ":mod:", "tests/"):  # reST roles, notes for contributors
        assert markup not in out, markup


def test_a_mistyped_name_gets_a_suggestion(capsys):
    assert cli(["benchmark"]) == 2
    assert "unknown command 'benchmark' (did you mean 'benchmarks'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["experiments", "hdnn_fig5", "--tiny"])
    assert "unknown reproduction 'hdnn_fig5' (did you mean 'hdnn_fig4'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["benchmarks", "--only", "jumpnfe"])
    assert "['jumpnfe'] (did you mean 'jump_nfe'?)" in capsys.readouterr().err


def test_resume_from_a_truncated_snapshot_prints_the_error_alone_and_exits_2(tmp_path, capsys, monkeypatch):
    """``--resume`` onto a truncated snapshot: the SnapshotError's own message on one ``error:`` line (no
    traceback), exit status 2 as for the other command-line errors, and the file left as it was."""
    import torch
    from torch import nn

    import cde_nets.experiments.__main__ as experiments
    import cde_nets.experiments.seeds as seeds
    from cde_nets.train.trainer import Trainer

    def run(size, seed, out_dir):  # a one-epoch training in place of the reproduction: the same snapshotting
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 2, generator=g)
        Trainer(seed=seed, progress=False, desc="probe").fit(
            nn.Linear(2, 2), (x, (x[:, 0] > 0).long(), None, None), epochs=1, batch_size=8
        )
        return {"name": "hauser", "size": size, "rows": [], "figures": []}

    monkeypatch.setattr(seeds, "runner", lambda name: run)
    monkeypatch.setattr(experiments, "attach", lambda res: res)
    monkeypatch.setattr(experiments, "write_result", lambda res, out: tmp_path / "unused.json")
    monkeypatch.setattr(experiments, "format_table", lambda res: "")
    assert experiments_main(["hauser", "--tiny", "--out", str(tmp_path)]) == 0
    (ckpt,) = (tmp_path / "snapshots" / "hauser-tiny-seed0").glob("001-*.snapshot")
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    capsys.readouterr()
    assert cli(["experiments", "hauser", "--tiny", "--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cde-nets experiments: error: ") and "is corrupt or truncated (100 bytes" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert len(ckpt.read_bytes()) == 100  # nothing was deleted
