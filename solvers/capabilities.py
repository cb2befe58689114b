"""The capability table: which gradient method serves which method under which step-size controller, read from
the classes themselves (each gradient method's ``supports``/``check`` and the per-sample controller's check, through
:func:`solvers.engine.check_cell`, the one check both doors make) and the methods' own tables (orders, and the
properties the implicit tableaux verify on construction).

``python -m cde_nets.solvers.capabilities`` writes ``docs/guides/capabilities.md``; a test keeps it equal to what
the classes say.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from .controllers import is_per_sample
from .engine import check_cell, check_events
from .gradients import GRADIENTS
from .options import (
    ADAPTIVE_METHODS,
    FIXED_METHODS,
    IMPLICIT_METHODS,
    PER_SAMPLE_METHODS,
    REVERSIBLE_METHODS,
    SPLIT_METHODS,
)
from .steppers.implicit_tableaux import IMPLICIT_TABLEAUX

__all__ = ["FAMILIES", "OUTPUTS", "markdown", "served"]

#: what a solve outputs: states at times ``t``, the whole state at its first event (``event_mode="first"``), each
#: sample at its own event (``event_mode="per_sample"``), a dense output (``ODEBlock.solve(dense=True)``,
#: ``cde_nets.odeint_dense``: the per-sample loop without events)
OUTPUTS = ("times", "first", "per_sample", "dense")

# family name -> {method: order}, in the order the table lists them
FAMILIES: dict[str, Mapping[str, int]] = {
    "explicit Runge-Kutta, adaptive": ADAPTIVE_METHODS,
    "explicit Runge-Kutta, fixed step": FIXED_METHODS,
    "reversible (asynchronous leapfrog; reversible Runge-Kutta on a base)": REVERSIBLE_METHODS,
    "implicit Runge-Kutta, fixed step": IMPLICIT_METHODS,
    "symplectic compositions and splittings, fixed step (separable fields)": SPLIT_METHODS,
}


def served(method: str, gradient: str, controller: str = "batch", output: str = "times") -> bool:
    """Whether ``gradient`` (a registered short name) serves ``method`` under ``controller`` for ``output``
    (one of :data:`OUTPUTS`)."""
    if is_per_sample(controller) and method not in PER_SAMPLE_METHODS:
        return False
    try:
        check_cell(GRADIENTS[gradient](), method, controller)
        if output != "times":
            check_events(method, "first" if output == "first" else "per_sample", controller)
    except ValueError:
        return False
    return True


def _events(method: str) -> str:
    """The event semantics the method serves (with the shared step, with every gradient it serves)."""
    modes = [m for m in ("first", "per_sample") if served(method, "backprop", output=m)]
    return " ".join(f"`{m}`" for m in modes)


def _properties(method: str) -> str:
    tab = IMPLICIT_TABLEAUX.get(method)
    if tab is not None:
        return ", ".join(sorted(tab.properties))
    if method in SPLIT_METHODS or method in REVERSIBLE_METHODS:
        return "symplectic" if method in SPLIT_METHODS else "reversible"
    return ""


def markdown() -> str:
    """The table as the docs page's Markdown."""
    names = list(GRADIENTS)
    lines = [
        "# Capabilities",
        "",
        "Which gradient method serves which method, generated from the classes (`python -m "
        "cde_nets.solvers.capabilities`). Both doors, `ODEBlock` and `cde_nets.odeint`, serve exactly these cells "
        "through one engine, and refuse the others with the same message. `✓`: served with the shared step "
        '(`controller="batch"`); `✓ ps`: also with per-sample steps (`controller="per_sample"`). *events*: the '
        "event semantics served, with the shared step and every gradient the row serves: `first` (the whole state "
        'stops at the first event: `odeint(..., event_fn=g)`, `ODEBlock.solve(y0, event=g, event_mode="first")`), '
        "`per_sample` (each sample at its own: `ODEBlock.solve(y0, event=g)`, `odeint(..., event_fn=g, "
        'event_mode="per_sample")`); dense output (`ODEBlock.solve(y0, dense=True)`, `cde_nets.odeint_dense`) is '
        "served wherever `per_sample` is.",
        "",
    ]
    for family, methods in FAMILIES.items():
        lines += [f"## {family[0].upper()}{family[1:]}", ""]
        lines.append("| method | order | properties | " + " | ".join(f"`{n}`" for n in names) + " | events |")
        lines.append("|---" * (4 + len(names)) + "|")
        for method, order in methods.items():
            cells = []
            for n in names:
                mark = "✓" if served(method, n) else ""
                if mark and all(served(method, n, c) for c in ("batch", "per_sample")):
                    mark = "✓ ps"
                cells.append(mark)
            row = f"| `{method}` | {order} | {_properties(method)} | " + " | ".join(cells)
            lines.append(row + f" | {_events(method)} |")
        lines.append("")
    lines += [
        "The methods torchdiffeq alone has (`explicit_adams`, `implicit_adams`, `fixed_adams`, `scipy_solver`) run "
        'through its public `odeint` from `cde_nets.odeint` only, with `gradient="backprop"` or `"adjoint"`.',
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    out = Path(argv[0] if argv else "docs/guides/capabilities.md")
    out.write_text(markdown(), encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
