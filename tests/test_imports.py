"""``import cde_nets`` loads torch and the library, nothing a call may never need: those load with their first use."""

import ast
import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# torch itself imports tqdm (torch.hub) and numpy, so those are not listed.
LAZY = (
    "torch._dynamo",  # torch.compile's tracer: ~0.8 s, loaded by the first solve (cde_nets.blocks.compile_boundary)
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
    """A Runge-Kutta solve runs on the library's own stepper: it loads neither torchdiffeq (nor scipy through it),
    torchsde nor matplotlib."""
    loaded = _loaded("solve")
    assert "torchdiffeq" not in loaded and "scipy" not in loaded
    assert "torchsde" not in loaded and "matplotlib" not in loaded


# --- no import cycles -------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
# installed name -> folder (pyproject.toml's package-dir: solvers/, experiments/ and benchmarks/ sit at the top)
PACKAGES = {
    "cde_nets": ROOT / "cde_nets",
    "cde_nets.solvers": ROOT / "solvers",
    "cde_nets.experiments": ROOT / "experiments",
    "cde_nets.benchmarks": ROOT / "benchmarks",
}
# Cycles another change removes; empty this when it lands.
KNOWN_CYCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = f.relative_to(folder).with_suffix("").parts
            out[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = f
    return out


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except those under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.stmt) and not (
            isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING")
        ):
            yield from _imports(child)


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth of its code (an import inside a function is
    still an edge: it only postpones the cycle), except under ``if TYPE_CHECKING:``."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            edges |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read():
    graph = _import_graph()
    assert "cde_nets.fields.pieces" in graph["cde_nets.fields.base"]  # from ..pieces import TimeGrid
    assert "cde_nets.solvers.errors" in graph["cde_nets.fields.pieces"]  # from cde_nets.solvers.errors import ...
    assert "cde_nets.experiments.report" in graph["cde_nets.experiments.seeds"]  # from .report import ...
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_cycles():
    """A module of the library, its experiments or its benchmarks never imports, at any depth, a module that
    imports it back: a cycle hides which one is the lower layer, and an import moved to the top breaks it."""
    cycles = [c for c in _cycles(_import_graph()) if c not in KNOWN_CYCLES]
    assert cycles == [], f"import cycles: {[sorted(c) for c in cycles]}"


def test_the_doors_go_down_to_the_engine_and_never_back_up():
    """``solvers/`` (the engine, steppers, controllers, gradients) imports nothing of ``cde_nets/`` above it: the
    blocks and ``odeint`` call down into it, never the other way (docs/guides/engine.md)."""
    graph = _import_graph()
    up = {
        (name, dep)
        for name, deps in graph.items()
        if name.startswith("cde_nets.solvers")
        for dep in deps
        if not dep.startswith(("cde_nets.solvers", "cde_nets.experiments", "cde_nets.benchmarks")) and dep != "cde_nets"
    }
    assert up == set(), sorted(up)
    assert "cde_nets.solvers.adapter" in graph["cde_nets.blocks.ode"]  # the block's way down
    assert "cde_nets.solvers.dropin" in graph["cde_nets.functional"]  # odeint's
