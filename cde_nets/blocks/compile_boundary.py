"""Where torch.compile stops tracing: solves run eagerly inside a compiled model.

``torch.compiler.disable`` imports torch._dynamo (about 0.8 s, a third of ``import torch``) when it is applied,
which as a decorator is at import time. :func:`eager_under_compile` applies it on the first call instead, so
``import cde_nets`` does not pay for a compiler that most programs never use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["eager_under_compile"]


def eager_under_compile(fn: Callable[..., Any]) -> Any:
    """``torch.compiler.disable(fn)``, created on the first call: traced code that calls ``fn`` runs it eagerly
    (one graph break), whether that first call happens eagerly or while torch.compile traces."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call
