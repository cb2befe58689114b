r"""What the blocks integrated during a forward pass, collected for the loss without any state on the modules.

A block with ``regularisers=`` returns its terms with its result (``Solution.regularisation``), but a user's model
returns whatever it likes — a tensor, logits — so a loss can rarely reach the terms of the blocks nested inside
it. Inside ``with integrated_terms() as terms:`` every block (and :class:`~cde_nets.flows.ContinuousFlow`)
called reports its :class:`~cde_nets.blocks.solution.Solution`; ``terms["kinetic"]`` is then the sum, over every block
that integrated it, of its batch mean (RNODE, Finlay et al. 2020, eqs. 4-5; TayNODE, Kelly et al. 2020, eq. 3)::

    with integrated_terms() as terms:
        out = model(x)
    loss = task_loss(out) + 0.01 * terms["kinetic"] + 0.01 * terms["jacobian"]

The :class:`~cde_nets.train.trainer.Trainer` opens one collection per optimisation step, so its ``kinetic_energy(λ)``,
``jacobian_frobenius(λ)`` and ``taylor(λ)`` terms read it. Collections nest: each open one sees every call made
inside it. The list of open collections is a plain module-level stack (``torch.compile`` traces it; a
``contextvars`` lookup would break the graph); collect in the thread that calls the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from cde_nets.blocks.solution import Solution

__all__ = ["IntegratedTerms", "integrated_terms", "report", "current_terms"]

_OPEN: list[IntegratedTerms] = []


class IntegratedTerms(Mapping[str, torch.Tensor]):
    """The solutions reported while the collection was open; read like a dict ``name -> summed batch mean``."""

    def __init__(self) -> None:
        self.solutions: list[Solution] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        values = [s.regularisation[name] for s in self.solutions if name in s.regularisation]
        if not values:
            raise KeyError(
                f"no block called inside this collection integrated {name!r} (it holds {sorted(self)}); build the "
                f"model's blocks as ODEBlock/DiscreteNet/ContinuousFlow with regularisers=(..., {name!r})."
            )
        return values[0] if len(values) == 1 else torch.stack(values).sum()

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(k for s in self.solutions for k in s.regularisation))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def nfe_forward(self) -> int:
        """Forward field evaluations of every reported solve, summed."""
        return sum(s.stats.nfe_forward for s in self.solutions)


@contextmanager
def integrated_terms() -> Iterator[IntegratedTerms]:
    """Open a collection: every block called inside reports its solution into it (see the module's text)."""
    terms = IntegratedTerms()
    _OPEN.append(terms)
    try:
        yield terms
    finally:
        # by identity: a Mapping compares equal to any other with the same items
        del _OPEN[next(i for i, t in enumerate(_OPEN) if t is terms)]


def report(solution: Solution) -> Solution:
    """Hand a block's solution to every open collection (nothing when none is open); returns it unchanged."""
    for terms in _OPEN:
        terms.solutions.append(solution)
    return solution


def current_terms() -> IntegratedTerms:
    """The innermost open collection; a clear error when none is open."""
    if not _OPEN:
        raise RuntimeError(
            "the integrated regularisers are read from the blocks' solutions reported inside "
            "`with cde_nets.integrated_terms() as terms:`; the Trainer opens one per step. Outside it, call the "
            "model inside such a block and read `terms['kinetic']`, ..., or read `block.solve(x).regularisation`."
        )
    return _OPEN[-1]
