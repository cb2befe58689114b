"""What the README and the documentation state that a test can check, checked against the code, the test suite and
the recorded numbers: what runs the default calls, the layout, the devices, the main job's time and threads, the
README's examples and the performance page's counts and GPU numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
import torch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
WORDS = {"six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11}


def _section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next heading of that level."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _flat(text: str) -> str:
    return " ".join(text.split())


# --- what runs the default calls -------------------------------------------------------------------------------


def test_the_default_calls_run_the_librarys_own_engine_as_the_pages_say(monkeypatch):
    """The README's first lines and the package's description say continuous mode runs on this library's engine,
    with torchdiffeq as the reference and fallback; the default ``ODEBlock`` (forward and backward, by backprop
    and by the adjoint) and the default ``odeint`` then run with every torchdiffeq solver disabled, and the
    fallback (a method only torchdiffeq has) is caught by the same patch."""
    from torchdiffeq._impl import solvers

    from cde_nets import ODEBlock, odeint
    from cde_nets.fields import Hamiltonian

    intro = _flat(README.split("```")[0])
    assert "solved by this library's own engine" in intro and "torchdiffeq is the reference" in intro
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    assert "its own ODE engine" in description

    class TorchdiffeqRan(Exception):
        pass

    def refused(*args, **kwargs):
        raise TorchdiffeqRan

    for cls in (solvers.AdaptiveStepsizeODESolver, solvers.FixedGridODESolver):
        monkeypatch.setattr(cls, "integrate", refused)
    torch.manual_seed(0)
    block = ODEBlock(Hamiltonian(4, layers=2))
    block(torch.randn(3, 4)).square().sum().backward()
    y0 = torch.ones(3, requires_grad=True)
    odeint(lambda t, y: -y, y0, torch.linspace(0.0, 1.0, 3)).sum().backward()
    assert y0.grad is not None
    adjoint = ODEBlock(Hamiltonian(4, layers=2), gradient="adjoint")
    adjoint(torch.randn(3, 4)).sum().backward()
    with pytest.raises(TorchdiffeqRan):  # the patch does reach torchdiffeq
        odeint(lambda t, y: -y, y0, torch.linspace(0.0, 1.0, 3), method="explicit_adams")


# --- layout -------------------------------------------------------------------------------------------------------


def test_the_layout_names_only_what_exists_and_every_solvers_subpackage():
    import cde_nets

    layout = _section(README, "Layout")
    named = re.findall(r"`([^`]+)`", layout)
    folders = [n for n in named if n.endswith("/")]
    assert [f for f in folders if not (ROOT / f).is_dir()] == []
    for name in named:
        if name.split(".")[0] == "cde_nets":
            __import__(name)
        elif re.fullmatch(r"[A-Za-z_]\w*", name):
            assert hasattr(cde_nets, name), name
    subpackages = sorted(p.parent.name for p in (ROOT / "solvers").glob("*/__init__.py"))
    assert subpackages and [s for s in subpackages if f"solvers/{s}/" not in folders] == []


# --- devices ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", ["README.md", "docs/install.md"])
def test_the_devices_section_describes_the_cuda_tests_and_the_recorded_gpu_run(page):
    from blocks.test_cuda import RUNS

    devices = _flat(_section((ROOT / page).read_text(), "Devices"))
    assert "untested" not in devices and "CPU only" not in devices
    assert f"`tests/blocks/test_cuda.py` runs {len(RUNS)} models on a CUDA device" in devices
    recorded = ROOT / "benchmarks" / "results" / "per_sample_device.json"
    assert f"`{recorded.relative_to(ROOT)}`" in devices
    assert f"the {json.loads(recorded.read_text())['setting']['device']} " in devices


# --- the main job ---------------------------------------------------------------------------------------------------


def test_the_install_alone_is_the_main_jobs_install():
    from cde_nets.experiments.timings import main_job_command

    install, job = main_job_command().rsplit(" && ", 1)
    assert job == ".venv/bin/python -m cde_nets.experiments all --quick"
    bash = re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M)
    assert f"{install}\n" in bash
    assert f"The **main job**, `{job}` after it" in README


def test_the_readme_states_the_recorded_main_job_time_under_ten_minutes():
    """The README's main-job time is the one ``experiments/timings.py --main-job`` recorded, which is under the ten
    minutes the README promises; the reproductions run side by side, so it lies between the quick column's sum
    (one after another) and that sum shared evenly over the cores."""
    from cde_nets.experiments import timings
    from cde_nets.experiments.registry import THREADS, THREADS_OF, total

    job = timings.load_timings()["main_job"]
    m, s = divmod(round(job["seconds"]), 60)
    setup = _flat(_section(README, "Set up (Python 3.11, from a clone)"))
    assert re.findall(r"(\d+) min (\d+) s measured", setup) == [(str(m), str(s))]
    assert "under ten minutes" in setup and job["seconds"] < 600
    assert job["threads"] == {"default": THREADS, **THREADS_OF} and THREADS == 1
    assert "Each reproduction runs on one torch thread" in setup and "side by side" in setup
    # side by side on the machine's cores: no slower than one after another, no faster than perfectly shared
    cores = job["machine"]["cores"]
    assert 0.9 * total("quick") / cores < job["seconds"] < total("quick")


def test_the_reproductions_run_on_one_thread_unless_asked(monkeypatch, tmp_path):
    """The command's default is one intra-op thread for every reproduction but nais_digits (two); a run that asks
    for a number gets it."""
    from cde_nets.experiments import __main__ as cli
    from cde_nets.experiments import seeds

    seen = []

    class Ran(Exception):
        pass

    def run(size, seed, out_dir):
        seen.append(torch.get_num_threads())
        raise Ran

    monkeypatch.setattr(seeds, "runner", lambda name: run)
    old = torch.get_num_threads()
    try:
        for name, extra in (
            ("blog", []),
            ("blog", ["--threads", "2"]),
            ("nais_digits", []),
            ("nais_digits", ["--threads", "1"]),
        ):
            torch.set_num_threads(2)  # torch's own default on a 2-core machine
            with pytest.raises(Ran):
                cli.main([name, "--tiny", "--no-snapshots", "--out", str(tmp_path / str(len(seen))), *extra])
    finally:
        torch.set_num_threads(old)
    assert seen == [1, 2, 2, 1]


# --- README examples ------------------------------------------------------------------------------------------------


def test_readme_example_2_names_the_printed_columns_and_shows_the_tolerance(capsys):
    from cde_nets.diagnostics import markdown_table

    block = next(b for b in re.findall(r"^```python\n(.*?)^```", README, re.S | re.M) if "adjoint_study(" in b)
    lines = block.splitlines()
    at = lines.index("print(markdown_table(study))")
    comment = []
    for line in reversed(lines[:at]):
        if not line.startswith("#"):
            break
        comment.insert(0, line.lstrip("#"))
    header = markdown_table({"rows": []}).splitlines()[0]
    assert _flat(" ".join(comment)).strip("| ") == header.strip("| ")
    exec(compile(block, "README example 2", "exec"), {"__name__": "readme_example_2"})
    rows = [r.strip("|").split("|") for r in capsys.readouterr().out.splitlines() if "| dopri5 |" in r]
    nfe = {(r[0].strip(), r[2].strip()): int(r[5]) for r in rows}
    assert nfe[("backprop", "1e-06")] > nfe[("backprop", "1e-03")]  # the tolerance shows in the steps


# --- the performance page -----------------------------------------------------------------------------------------


PERFORMANCE = _flat((ROOT / "docs" / "performance.md").read_text())


def test_the_performance_page_counts_and_names_the_fast_methods():
    from cde_nets.solvers.steppers.fast_rk import FAST_METHODS

    m = re.search(r"checks this for the (\w+) fast methods, (.*?) \(", PERFORMANCE)
    assert m is not None
    assert WORDS[m.group(1)] == len(FAST_METHODS) and sorted(re.findall(r"`(\w+)`", m.group(2))) == sorted(FAST_METHODS)
    others = re.findall(r"methods other than the (\w+) above", PERFORMANCE)
    assert others and all(WORDS[w] == len(FAST_METHODS) for w in others)


def test_the_performance_page_quotes_the_recorded_gpu_run():
    recorded = json.loads((ROOT / "benchmarks" / "results" / "per_sample_device.json").read_text())
    rows = {(r["case"], r["batch"], r["mode"]): r for r in recorded["rows"]}
    vdp, neural = rows[("vdp", 256, "forward")], rows[("neural", 512, "forward")]
    assert "for want of a GPU" not in PERFORMANCE
    assert f"(one {recorded['setting']['device']}, {recorded['setting']['dtype']}," in PERFORMANCE
    calls = vdp["calls"]
    assert (
        f"it takes {vdp['per_sample_over_shared']:.2f}x the shared step's time forward ({calls['per_sample']} "
        f"batched calls against {calls['shared']}), and {neural['per_sample_over_shared']:.2f}x on a small neural ODE"
    ) in PERFORMANCE
