"""``import cde_nets`` loads torch and the library, nothing a call may never need: those load with their first use."""

import json
import subprocess
import sys

import pytest

# torch itself imports tqdm (torch.hub) and numpy, so those are not listed.
LAZY = (
    "torch._dynamo",  # torch.compile's tracer: ~0.8 s, loaded by the first solve (cde_nets.compile_boundary)
    "torchdiffeq",  # imports scipy.integrate: loaded by the first continuous solve
    "scipy",
    "sympy",
    "torchsde",  # the first SDE solve
    "matplotlib",  # diagnostics.plots and the experiments' figures
    "sklearn",  # datasets.digits
    "mlxtend",
    "cde_nets.experiments",
    "cde_nets.benchmarks",
)


STEPS = {
    "import": "import cde_nets",
    "help": "from cde_nets.cli import main; main(['--help'])",
    "solve": "import torch; cde_nets.ODEBlock(cde_nets.fields.Hamiltonian(dim=2, layers=1))(torch.ones(1, 2))",
}
_after: dict = {}


def _loaded(step: str) -> list[str]:
    """The modules of LAZY loaded after ``step``: the steps run in this order in one fresh interpreter (starting
    one imports torch, about 2 s), each probed after it ran. Each probe sees what the steps before it loaded, so
    it fails wherever a probe of its step alone would (a heavy import by the help fails the solve's test too)."""
    if not _after:
        probe = "import sys, json\nseen = {}\n" + "".join(
            f"{code}\nseen[{name!r}] = [m for m in {list(LAZY)!r} if m in sys.modules]\n"
            for name, code in STEPS.items()
        )
        out = subprocess.run([sys.executable, "-c", probe + "print(json.dumps(seen))"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        _after.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return _after[step]


@pytest.mark.slow
def test_import_cde_nets_loads_no_heavy_module():
    assert _loaded("import") == []


@pytest.mark.slow
def test_the_command_lines_help_loads_no_heavy_module():
    assert _loaded("help") == []


@pytest.mark.slow
def test_a_solve_loads_what_it_needs():
    loaded = _loaded("solve")
    assert "torchdiffeq" in loaded and "torchsde" not in loaded and "matplotlib" not in loaded
