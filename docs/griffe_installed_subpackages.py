"""Griffe extensions for the API pages.

``InstalledSubpackages`` documents ``cde_nets.solvers`` where it is installed. The repository keeps ``solvers/``
at the top level and the editable install maps it to ``cde_nets.solvers``
(``[tool.setuptools.package-dir]``). Griffe reads ``cde_nets`` from its folder and would not find the subpackage,
so when ``cde_nets`` is loaded this asks the import system (the installed package) where ``cde_nets.solvers``
lives and attaches that folder, read statically, as the member ``solvers``.

``SphinxRoles`` shows the Sphinx cross-reference roles some docstrings use (``:class:`~cde_nets.ODEBlock```) as
code (``ODEBlock``) instead of literal role markup; the docstrings themselves are left as they are.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import griffe

SUBPACKAGES = ("solvers",)


class InstalledSubpackages(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "cde_nets":
            return
        for name in SUBPACKAGES:
            if name in pkg.members:
                continue
            spec = importlib.util.find_spec(f"cde_nets.{name}")
            if spec is None or not spec.submodule_search_locations:
                raise RuntimeError(f"cde_nets.{name} is not installed: run `pip install -e .` first.")
            folder = Path(next(iter(spec.submodule_search_locations)))
            # Griffe has no public call for "this folder is that submodule"; _load_module with a parent is how it
            # loads every submodule of a package itself.
            sub = loader._load_module(name, folder / "__init__.py", parent=pkg)
            pkg.set_member(name, sub)


_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`(~?)([^`<]+?)(?:\s*<[^`>]+>)?`")


def _role_as_code(m: re.Match) -> str:
    target = m.group(2).strip()
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(_role_as_code, obj.docstring.value)
