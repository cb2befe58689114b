"""One block call's gathering: every piecewise parameter read as views of one ``unbind``, every field's
per-call memo live, for the length of the call (:func:`gathered`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from cde_nets.fields.base import Field
from cde_nets.fields.pieces import Pieces, set_views

__all__ = ["gathered", "suspended"]


@contextmanager
def gathered(module: nn.Module, stacked: bool = True) -> Iterator[nn.Module]:
    """Within the block, every :class:`Pieces` of ``module`` hands out views of one ``data.unbind(0)``, and every
    field's per-call memo (:meth:`cde_nets.fields.base.Field.memo`) is live: its
    :meth:`~cde_nets.fields.base.Field.constants` are built for all pieces at once (``stacked=False``: piece by
    piece, from the views).

    Why: ``data[l]`` in a loop over ``L`` layers records ``L`` slicing nodes, and the backward of each one
    allocates and fills a full ``(L, ...)`` zero gradient, so backward costs O(L² |θ_l|). ``unbind`` is one node
    whose backward stacks the ``L`` piece gradients once. Discrete nets and backprop-mode ODE blocks wrap each
    call in this; nested blocks reuse the outer gathering. Leave the block before the parameters change (the
    views belong to one optimisation step).
    """
    pieces, fields = [], []
    for m in module.modules():
        if isinstance(m, Pieces) and m._unbound is None:
            pieces.append(m)
        elif isinstance(m, Field) and m._memo is None:
            fields.append(m)
    # plain attributes, not parameters or submodules: object.__setattr__ skips nn.Module's registration checks,
    # which cost more than the whole of a small layer
    for p in pieces:
        set_views(p, ())
    for f in fields:
        object.__setattr__(f, "_memo", {})
        object.__setattr__(f, "_constants", {} if stacked else None)
    try:
        yield module
    finally:
        for p in pieces:
            set_views(p, None)
        for f in fields:
            # back to the class defaults (None): a module keeps nothing of a call, not even an attribute
            vars(f).pop("_memo", None)
            vars(f).pop("_constants", None)


@contextmanager
def suspended(module: nn.Module) -> Iterator[nn.Module]:
    """Within the block, no :class:`Pieces` of ``module`` hands out views and no field memoises: every read goes to
    the parameter itself (``data[l]``, :meth:`~cde_nets.fields.base.Field.piece_constants` afresh), also inside an
    outer :func:`gathered`, whose caches come back after.

    Why: a gradient method that swaps the tensors the field reaches for its own inputs under ``torch.func``
    (:mod:`solvers.gradients.vmap_adjoint`) sees them only where the field reads them; a view or a constant cached
    from the parameter it replaced would hide the swap (forward mode's tangents then never reach the output).
    """
    held: list[tuple[nn.Module, str, object]] = []
    for m in module.modules():
        for name in ("_unbound", "_memo", "_constants") if isinstance(m, Pieces | Field) else ():
            if name in vars(m):
                held.append((m, name, vars(m).pop(name)))
    try:
        yield module
    finally:
        for m, name, value in held:
            object.__setattr__(m, name, value)
