"""Differentiable point-to-point exchange between neighbouring ranks (torch.distributed, gloo or NCCL).

``exchange(comm, outgoing, incoming)`` sends ``outgoing[dst]`` to each ``dst`` and returns the tensors received
from each ``src`` in ``incoming``. Its backward runs the same exchange in reverse: gradients of the received
tensors go back to their senders, and each outgoing tensor receives its gradient from its destination. Every
message is counted per peer and per direction, so a test can show that no rank talked to a non-neighbour.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Comm", "exchange"]


@dataclass
class Comm:
    """A rank's view of the communication graph: its allowed ``neighbours`` and the traffic it sent.

    ``sent[(phase, dst)] = [messages, bytes]`` with ``phase`` in ``{"forward", "backward"}``.
    """

    rank: int
    neighbours: frozenset[int]
    sent: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    _tag: int = 0

    def next_tag(self) -> int:
        """Even tags for forward messages; the backward of the same exchange uses the odd tag after it."""
        self._tag += 2
        return self._tag

    def _record(self, phase: str, dst: int, t: torch.Tensor) -> None:
        if dst not in self.neighbours:
            raise RuntimeError(f"rank {self.rank} tried to send to rank {dst}, which is not its neighbour in S.")
        entry = self.sent[(phase, dst)]
        entry[0] += 1
        entry[1] += t.numel() * t.element_size()

    def swap(
        self,
        phase: str,
        tag: int,
        outgoing: dict[int, torch.Tensor],
        incoming: dict[int, torch.Size],
        like: torch.Tensor,
    ) -> dict[int, torch.Tensor]:
        """Post every send, receive every expected tensor, then wait for the sends (no ordering deadlock)."""
        handles = []
        for dst in sorted(outgoing):
            t = outgoing[dst].detach().contiguous()
            self._record(phase, dst, t)
            handle = dist.isend(t, dst, tag=tag)
            assert handle is not None  # None only on a rank outside the process group
            handles.append(handle)
        received = {}
        for src in sorted(incoming):
            buf = torch.empty(incoming[src], dtype=like.dtype, device=like.device)
            dist.recv(buf, src, tag=tag)
            received[src] = buf
        for h in handles:
            h.wait()
        return received


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: Comm, dsts: tuple[int, ...], srcs: tuple[int, ...], shapes: tuple, anchor, *tensors):
        tag = comm.next_tag()
        ctx.comm, ctx.dsts, ctx.srcs, ctx.tag, ctx.in_shapes = comm, dsts, srcs, tag, shapes
        ctx.out_shapes = tuple(t.shape for t in tensors)
        got = comm.swap("forward", tag, dict(zip(dsts, tensors)), dict(zip(srcs, shapes)), anchor)
        return (anchor.view_as(anchor), *(got[s] for s in srcs))

    @staticmethod
    def backward(ctx, g_anchor, *grads):
        comm = ctx.comm
        like = g_anchor
        back = {s: (g if g is not None else like.new_zeros(sh)) for s, g, sh in zip(ctx.srcs, grads, ctx.in_shapes)}
        got = comm.swap("backward", ctx.tag + 1, back, dict(zip(ctx.dsts, ctx.out_shapes)), like)
        return (None, None, None, None, g_anchor, *(got[d] for d in ctx.dsts))


def exchange(
    comm: Comm, outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Size], anchor: torch.Tensor
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Send ``outgoing[dst]`` to every ``dst``; receive a tensor of shape ``incoming[src]`` from every ``src``.

    Returns ``(anchor, received)``: ``anchor`` is passed through unchanged and the caller must use the returned
    copy downstream. It ties every exchange into the autograd graph, so each rank runs the reverse exchange in
    its backward pass even when it only sends or only receives (otherwise a peer would wait forever).
    Every rank must call it in the same order (the tag sequence matches sends with receives).
    """
    dsts = tuple(sorted(outgoing))
    srcs = tuple(sorted(incoming))
    shapes = tuple(torch.Size(incoming[s]) for s in srcs)
    out = _Exchange.apply(comm, dsts, srcs, shapes, anchor, *(outgoing[d] for d in dsts))
    return out[0], dict(zip(srcs, out[1:]))
