"""One block call's gathering: every piecewise parameter read as views of one ``unbind``, every field's
per-call memo live, for the length of the call (:func:`gathered`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from cde_nets.fields.base import Field
from cde_nets.fields.pieces import Pieces, set_views

__all__ = ["gathered"]


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
