"""The shape of the code: no public signature over 12 parameters, no function over 80 lines."""

import ast
import inspect
import types
from pathlib import Path

import cde_nets

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 12
# odeint_adjoint keeps torchdiffeq's signature (13 parameters there too, so that a user swaps the import and
# nothing else).
SIGNATURES_ALLOWED = {"odeint_adjoint": 13}


def _public_callables():
    """Every object ``cde_nets.__all__`` exports (a module: its own ``__all__``), and the public methods of each
    class among them, as ``(name, callable)``."""
    seen = set()
    for name in cde_nets.__all__:
        obj = getattr(cde_nets, name)
        members = (
            [(f"{name}.{m}", getattr(obj, m)) for m in getattr(obj, "__all__", ())]
            if isinstance(obj, types.ModuleType)
            else [(name, obj)]
        )
        for qual, member in members:
            if id(member) in seen or not callable(member):
                continue
            seen.add(id(member))
            yield qual, member
            if inspect.isclass(member):
                for attr, value in vars(member).items():
                    if (not attr.startswith("_") or attr == "__init__") and inspect.isfunction(value):
                        yield f"{qual}.{attr}", value


def _parameters(fn) -> int | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return None
    return sum(1 for p in params.values() if p.name not in ("self", "cls"))


def test_the_walk_sees_the_blocks_and_their_methods():
    names = dict(_public_callables())
    assert {"ODEBlock.__init__", "SDEBlock.__init__", "ODEBlock.solve", "fields.Hamiltonian"} <= set(names)
    assert _parameters(names["ODEBlock.__init__"]) == 12


def test_no_public_signature_over_twelve_parameters():
    """A function that needs more than 12 arguments groups the rare ones in an option object
    (:class:`~cde_nets.SolverOptions`, :class:`~cde_nets.Regularisation`, :class:`~cde_nets.SDESettings`)."""
    over = {name: n for name, fn in _public_callables() if (n := _parameters(fn)) is not None and n > MAX_PARAMETERS}
    assert over == SIGNATURES_ALLOWED


MAX_LINES = 80


def _long_functions(source: str, path: str) -> dict[str, int]:
    """``path::Qualified.name`` -> lines (from the ``def`` to its last line, docstring included) of every function
    over :data:`MAX_LINES`, nested ones and methods too."""
    found = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > MAX_LINES:
                    found[f"{path}::{name}"] = n
                visit(child, f"{name}.")

    visit(ast.parse(source), "")
    return found


def test_the_scan_counts_a_function_from_def_to_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1))
    assert _long_functions(f"def ok():\n{body}\n", "m.py") == {}
    assert _long_functions(f"class C:\n  def long(self):\n{body}\n    x = 0\n", "m.py") == {"m.py::C.long": 81}


def test_no_function_over_eighty_lines():
    """Split a long function into named pieces: each piece says what it does, and a reader sees the whole."""
    found = {}
    for folder in ("cde_nets", "solvers", "experiments", "benchmarks"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            found |= _long_functions(f.read_text(), f.relative_to(ROOT).as_posix())
    assert sorted(found) == []
