"""The reproductions, by name: each module has ``run(size, seed, out_dir) -> dict`` (see ``report.result``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

# name -> (module, one-line description). Order is the order of `all`.
REPRODUCTIONS: dict[str, tuple[str, str]] = {}


def register(name: str, module: str, description: str) -> None:
    REPRODUCTIONS[name] = (module, description)


def runner(name: str) -> Callable:
    if name not in REPRODUCTIONS:
        raise SystemExit(f"unknown reproduction {name!r}; choose one of: {', '.join(REPRODUCTIONS)} or 'all'.")
    module, _ = REPRODUCTIONS[name]
    return importlib.import_module(module).run
