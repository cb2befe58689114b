"""The field interface every vector field implements.

Any ``nn.Module`` with ``forward(t, y)`` runs in continuous mode, and in discrete mode with ``steps=N``. A
:class:`Field` adds time-varying parameters that both modes share exactly. The contract of a piecewise field:

1. ``super().__init__(T=T, layers=L)`` creates ``self.grid``, the partition of ``[0, T]`` into ``L`` pieces of
   length ``h = T / L`` (piece ``l`` holds on ``[l h, (l + 1) h)``).
2. Every time-varying parameter is a :class:`~cde_nets.fields.pieces.Pieces` on that grid (a ``(L, *shape)`` tensor;
   ``self.W[l]`` is piece ``l``). Parameters that do not vary in time are ordinary ``nn.Parameter``s.
3. ``evaluate(l, y)`` returns ``F(y)`` with the parameters of piece ``l`` for ``y`` of shape
   ``(batch, *state_shape)``. ``forward(t, y)`` (inherited) looks up the piece in force at ``t`` and calls it;
   discrete mode calls ``evaluate`` directly, one scheme step per piece, so no rounding of ``l h`` can pick a
   neighbouring piece. Continuous mode tells adaptive solvers where the pieces jump.
4. Declare ``state_shape`` (and, where they apply, the capabilities below); blocks check inputs against it.

``docs/guides/own_field.md`` walks through a complete example in both modes.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from cde_nets.fields.pieces import TimeGrid
from cde_nets.solvers.errors import check_finite
from cde_nets.solvers.validation import check_floating

__all__ = ["Field", "Shared"]


class Shared(NamedTuple):
    """A constant every piece uses as it is, in :meth:`Field.piece_constants` of all pieces: one tensor (or
    ``None``) in the graph, whose gradient sums over the layers as they use it."""

    value: torch.Tensor | None


class Field(nn.Module):
    """Base class of all vector fields.

    Declared capabilities (class or instance attributes):

    - ``state_shape``: per-sample shape of the state, e.g. ``(dim,)`` or ``(C, None, None)`` (``None``: any size).
    - ``split``: ``(n_p, n_q)`` when the state is a ``(p, q)`` pair whose halves drive each other (separable
      Hamiltonian fields); ``None`` otherwise.
    - ``order``: ``k`` when the state is ``(x, x', ..., x^(k-1))`` stacked along the last feature axis.
    - ``hamiltonian``: has ``energy(t, y)``.
    - ``needs_input``: driven by a per-sample block input ``u`` of shape ``(batch, *input_shape)``, passed with
      every call: ``forward(t, y, u)`` and ``evaluate(l, y, u)`` (NAIS).
    - ``kind``: which row of the solver ↔ architecture map (:mod:`cde_nets.solvers.architectures`) applies.
    """

    state_shape: tuple[int | None, ...] = ()
    split: tuple[int, int] | None = None
    order: int = 1
    hamiltonian: bool = False
    needs_input: bool = False
    input_shape: tuple[int | None, ...] = ()
    kind: str = "generic"  # row of the solver ↔ architecture map (solvers.architectures)
    separable: bool = False  # p' depends on q only and q' on p only: evaluate_half is available
    _memo: dict | None = None  # live only inside cde_nets.blocks.gathering.gathered (one forward call)
    _constants: dict | None = None  # the constants of all pieces, by grad mode (gathered, stacked)

    def __init__(self, T: float = 1.0, layers: int = 1):
        super().__init__()
        self.grid = TimeGrid(T, layers)

    # -- time -----------------------------------------------------------------------------------------
    @property
    def T(self) -> float:
        return self.grid.T

    @property
    def layers(self) -> int:
        return self.grid.L

    @property
    def autonomous(self) -> bool:
        """True when the parameters do not depend on time (one piece)."""
        return self.grid.L == 1

    def forward(self, t: torch.Tensor | float, y: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        """``F(t, y)`` (or ``F(t, y, u)`` for a field with ``needs_input``): the piece in force at ``t``."""
        if u is None:
            if self.needs_input:
                raise ValueError(f"{type(self).__name__} needs its block input: call it as field(t, y, u).")
            return self.evaluate(self.grid.index(t), y)
        if not self.needs_input:
            raise TypeError(f"{type(self).__name__} takes no input `u`; call it as field(t, y).")
        return self.evaluate(self.grid.index(t), y, u)

    def memo(self, key, compute):
        """``compute()``, computed once per :func:`~cde_nets.blocks.gathering.gathered` call for a hashable ``key``
        (e.g. NAIS's ``A_l = −R_lᵀR_l − εI`` across the steps of a weight-shared block); outside it, every time."""
        if self._memo is None:
            return compute()
        key = (key, torch.is_grad_enabled())  # a value built under no_grad has no graph to differentiate
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def piece_constants(self, l: int | None) -> tuple[Any, ...] | None:
        """The tensors :meth:`evaluate` needs on piece ``l`` that do not depend on the state: transposes, masked
        weights, products of weights — what a hand-written layer computes once, outside its loop.

        ``l=None``: all pieces at once, each tensor with the pieces along a new first dimension (one operation
        instead of ``L``) or wrapped in :class:`Shared` when every piece uses it as it is (e.g. ``Jᵀ``); or
        ``None`` where a batched form would not reproduce the one-piece numbers bit for bit (a batched matrix
        product may sum in another order): the pieces are then built one by one. Fields that read
        :meth:`constants` override this; the default has none."""
        return ()

    def constants(self, l: int) -> tuple[torch.Tensor, ...]:
        """:meth:`piece_constants` of piece ``l``.

        Inside :func:`~cde_nets.blocks.gathering.gathered` (one call of a block) every piece is built once and reused by
        every step and stage; with ``gathered(stacked=False)`` piece by piece as they are read (the memory-free
        backward differentiates each layer with respect to its own views). Outside it, on every call: the
        piecewise adjoint and the step replay differentiate each evaluation with respect to the piece in force.
        """
        tables = self._constants
        grad = torch.is_grad_enabled()  # a table built under no_grad has no graph to differentiate
        if tables is not None:
            table = tables.get(grad)
            if table is None:
                stacked = self.piece_constants(None)
                table = tables[grad] = (
                    [self.piece_constants(i) for i in range(self.grid.L)]
                    if stacked is None
                    else list(zip(*(repeat(c.value) if isinstance(c, Shared) else c.unbind(0) for c in stacked)))
                )
            return table[l]
        if self._memo is None:
            return cast(tuple[torch.Tensor, ...], self.piece_constants(l))
        return self.memo(("constants", l), lambda: self.piece_constants(l))

    # (*args, **kwargs): subclasses take (l, y) or, with needs_input, (l, y, u)
    def evaluate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``F(y)`` with the parameters of piece ``l``; ``y`` has shape ``(batch, *state_shape)``. Fields with
        ``needs_input`` take the block input as a third argument: ``evaluate(l, y, u)``."""
        raise NotImplementedError

    def evaluate_part(self, l: int, y: torch.Tensor, part: int) -> torch.Tensor:
        """The ``p`` (``part=0``) or ``q`` (``part=1``) block of ``evaluate(l, y)`` for split fields.

        Separable fields override this to compute only the half asked for.
        """
        if self.split is None:
            raise TypeError(f"{type(self).__name__} has no (p, q) split; `evaluate_part` needs one.")
        n_p = self.split[0]
        f = self.evaluate(l, y)
        return f[..., :n_p] if part == 0 else f[..., n_p:]

    def evaluate_half(self, l: int, z: torch.Tensor, part: int) -> torch.Tensor:
        """Separable fields: ``p'`` from ``z = q`` (``part=0``) or ``q'`` from ``z = p`` (``part=1``)."""
        raise TypeError(f"{type(self).__name__} is not separable; use `evaluate_part`.")

    # -- validation ---------------------------------------------------------------------------------
    def check_input(self, u: torch.Tensor | None, batch: int, name: str = "u") -> None:
        """Raise an error naming ``name`` unless ``u`` is what this field takes: ``None`` for a field without
        input, a finite ``(batch, *input_shape)`` floating-point tensor for one with ``needs_input``."""
        if not self.needs_input:
            if u is not None:
                raise TypeError(f"`{name}` was given but {type(self).__name__} takes no block input; drop `{name}`.")
            return
        if u is None:
            raise ValueError(
                f"{type(self).__name__} needs its block input: pass `{name}=` (shape (batch, "
                f"{', '.join('*' if w is None else str(w) for w in self.input_shape)}))."
            )
        self._check_tensor(
            u, name, self.input_shape, "pass an input of that shape or build the field with matching input size."
        )
        if u.shape[0] != batch:
            raise ValueError(
                f"`{name}` has batch {u.shape[0]} but the state has batch {batch}; pass the input of this batch."
            )
        check_finite(name, u)

    def _check_tensor(self, t: object, name: str, want: tuple[int | None, ...], fix: str) -> None:
        """``t`` must be a floating-point tensor of shape ``(batch, *want)`` (``None``: any size); errors name
        ``name`` and end with ``fix``."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}.")
        want = tuple(want)
        if t.dim() != len(want) + 1 or any(w is not None and w != s for w, s in zip(want, t.shape[1:])):
            sizes = ", ".join("*" if w is None else str(w) for w in want)
            raise ValueError(
                f"`{name}` has shape {tuple(t.shape)}, but {type(self).__name__} expects (batch, {sizes}); {fix}"
            )
        check_floating(name, t)

    def check_state(self, y: torch.Tensor, name: str = "y0") -> None:
        """Raise a ``ValueError`` naming ``name`` if ``y`` is not ``(batch, *state_shape)`` or not finite."""
        self._check_tensor(y, name, self.state_shape, "reshape it or build the field with matching size.")
        check_finite(name, y)
