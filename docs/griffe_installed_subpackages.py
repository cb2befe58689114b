"""Griffe extensions for the API pages.

``InstalledSubpackages`` documents ``cde_nets.solvers`` where it is installed. The repository keeps ``solvers/``
at the top level and the editable install maps it to ``cde_nets.solvers``
(``[tool.setuptools.package-dir]``). Griffe reads ``cde_nets`` from its folder and would not find the subpackage,
so when ``cde_nets`` is loaded this asks the import system (the installed package) where ``cde_nets.solvers``
lives and attaches that folder, read statically, as the member ``solvers``.

``SphinxRoles`` shows the Sphinx cross-reference roles some docstrings use (``:class:`~cde_nets.ODEBlock```) as
code (``ODEBlock``) instead of literal role markup; the docstrings themselves are left as they are.

``SharedArguments`` gives each parameter of a shared entry (``rtol, atol: tolerances ...``) an entry of its own
with the same text. Griffe reads such an entry as one parameter named ``rtol, atol``, which no signature has, and
the parameter table would show its default as "required" (these default to ``None``).
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


# An entry of a Google-style "Args:" section that documents several parameters at once: "    a, b, c: text".
_ARGS = re.compile(r"^\s*(Args|Arguments|Parameters|Other Parameters):\s*$")
_SHARED = re.compile(r"^(?P<indent>[ \t]+)(?P<names>\w+(?:, \w+)+): (?P<text>.*)$")


def _split_shared(doc: str) -> str:
    lines = doc.split("\n")
    out: list[str] = []
    section: int | None = None  # indent of the "Args:" header while inside that section
    i = 0
    while i < len(lines):
        line = lines[i]
        indent_of = len(line) - len(line.lstrip())
        if line.strip() and section is not None and indent_of <= section:
            section = None
        if _ARGS.match(line):
            section = indent_of
        m = _SHARED.match(line) if section is not None else None
        if m is None:
            out.append(line)
            i += 1
            continue
        indent = m.group("indent")
        j = i + 1  # the entry's continuation lines are indented deeper than its first line
        while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > len(indent):
            j += 1
        for name in m.group("names").split(", "):
            out.append(f"{indent}{name}: {m.group('text')}")
            out.extend(lines[i + 1 : j])
        i = j
    return "\n".join(out)


class SharedArguments(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ", " in obj.docstring.value:
            obj.docstring.value = _split_shared(obj.docstring.value)


# A docstring's pointer to a documentation page, ``docs/guides/gradients.md``: on the site it becomes a link. API
# pages live in docs/api/, so the page is one folder up; mkdocs resolves (and with --strict checks) the link.
_DOCS_PAGE = re.compile(r"``docs/([\w/]+)\.md``")


class DocsLinks(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and "docs/" in obj.docstring.value:
            obj.docstring.value = _DOCS_PAGE.sub(r"[\1](../\1.md)", obj.docstring.value)
