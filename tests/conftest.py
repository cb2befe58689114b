import pytest
import torch

# Small tensors: one intra-op thread is 10x faster than two on a busy 2-core machine (measured).
torch.set_num_threads(1)


def _reference_loop() -> None:
    """Tests that switch the library's stepper off (``fast_rk.ENABLED = False``) compare it with torchdiffeq's loop."""
    from torchdiffeq_reference import odeint_reference

    from cde_nets.solvers.steppers import rk_odeint

    rk_odeint.REFERENCE = odeint_reference


_reference_loop()


@pytest.fixture
def f64():
    """Run the test in float64 and restore the default dtype afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """The documentation site, built once per test session with ``mkdocs build --strict``: ``(site folder,
    finished process)``. Tests that read the site skip when the docs extra is not installed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip(
        "mkdocstrings_handlers.python", reason="the docs extra is not installed: pip install -e '.[docs]'"
    )
    site = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return site, proc


@pytest.fixture(scope="session")
def tiny_benchmark(tmp_path_factory):
    """``tiny_benchmark(name) -> (result, folder it wrote)``: the benchmark's tiny run, made once per test session
    and shared by the tests that read it (each asserts something else on the same run)."""
    import importlib

    runs: dict = {}

    def get(name: str):
        if name not in runs:
            folder = tmp_path_factory.mktemp(f"benchmark_{name}")
            module = importlib.import_module(f"cde_nets.benchmarks.{name}")
            runs[name] = (module.run(tiny=True, out_dir=folder), folder)
        return runs[name]

    return get


@pytest.fixture(scope="session")
def nais_digits_tiny(tmp_path_factory):
    """The folder of one uninterrupted ``python -m cde_nets.experiments nais_digits --tiny --threads 1`` run (in
    this process, checkpointed as by default), shared by the tests that read it (four trainings: about 6 s)."""
    from cde_nets.experiments.__main__ import main

    out = tmp_path_factory.mktemp("nais_digits_tiny")
    assert main(["nais_digits", "--tiny", "--threads", "1", "--out", str(out)]) == 0
    return out


# Parametrized cases over about 2 s whose siblings are fast: marked slow by id (the rest carry @pytest.mark.slow).
SLOW_CASES = {
    "tests/blocks/test_block_registry.py::test_every_question_on_a_closed_form[adaptive_heun-forward]",
    "tests/blocks/test_block_registry.py::test_every_question_on_a_closed_form[adaptive_heun-adjoint]",
    "tests/test_api.py::test_gradient_reaches_the_block_input_in_every_continuous_mode[stopping-adjoint]",
    "tests/test_api.py::test_gradient_reaches_the_block_input_in_every_continuous_mode[adjoint]",
    "tests/blocks/test_compile_continuous.py::test_compiled_nais_and_sde_blocks_equal_eager[adjoint]",
    "tests/solvers/per_sample/test_per_sample_grads.py::test_replayed_gradients_equal_backprop[symplectic-bosh3]",
    "tests/solvers/per_sample/test_per_sample_grads.py::test_replayed_gradients_equal_backprop[checkpoint-bosh3]",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
