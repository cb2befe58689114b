"""``import cde_nets`` loads torch and the library, nothing a call may never need: those load with their first use."""

import json
import subprocess
import sys

# torch itself imports tqdm (torch.hub) and numpy, so those are not listed.
LAZY = (
    "torch._dynamo",  # torch.compile's tracer: ~0.8 s, loaded by the first solve (cde_nets.compile_boundary)
    "torchdiffeq",  # imports scipy.integrate: loaded only for a method only it has (Adams, scipy_solver)
    "scipy",
    "sympy",
    "torchsde",  # the first SDE solve
    "matplotlib",  # diagnostics.plots and the experiments' figures
    "sklearn",  # datasets.digits
    "mlxtend",
    "cde_nets.experiments",
    "cde_nets.benchmarks",
)


def _loaded(code: str) -> list[str]:
    probe = f"import sys, json; {code}; print(json.dumps([m for m in {list(LAZY)!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_cde_nets_loads_no_heavy_module():
    assert _loaded("import cde_nets") == []


def test_the_command_lines_help_loads_no_heavy_module():
    assert _loaded("from cde_nets.cli import main; main(['--help'])") == []


def test_a_solve_loads_what_it_needs():
    """A Runge-Kutta solve runs on the library's own stepper: it loads neither torchdiffeq (nor scipy through it),
    torchsde nor matplotlib."""
    code = "import torch, cde_nets; cde_nets.ODEBlock(cde_nets.fields.Hamiltonian(dim=2, layers=1))(torch.ones(1, 2))"
    loaded = _loaded(code)
    assert "torchdiffeq" not in loaded and "scipy" not in loaded
    assert "torchsde" not in loaded and "matplotlib" not in loaded
