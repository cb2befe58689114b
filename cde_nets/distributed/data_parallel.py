"""Data parallelism for :func:`cde_nets.train.trainer.fit` on torch.distributed (DDP): sharding, loss weights, metrics.

Every rank draws the same seeded permutation and cuts it into the same global batches of ``batch_size``; rank
``r`` of ``W`` trains on the ``r``-th of ``W`` contiguous, near-equal pieces of each batch (sizes differ by at
most one). With ``n_r`` samples on rank ``r`` out of ``B`` in the batch, the rank's mean loss ``L_r`` is scaled by
``c_r = W n_r / B``, so DDP's gradient average is the gradient of the global batch mean:

    (1/W) Σ_r ∇(c_r L_r) = Σ_r (n_r / B) ∇L_r = ∇ (1/B) Σ_{i ∈ batch} ℓ_i.

A rank whose piece of the last batch is empty (fewer samples than ranks) runs one sample with ``c_r = 0``: it
still takes part in DDP's gradient all-reduce, and adds nothing. The running loss, the correct count and the
sample count are summed over ranks after every batch, so each rank reports the global numbers.

The process group is the caller's (``torchrun`` or :func:`cde_nets.distributed.launch.spawn`); nothing here
starts or ends one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "is_distributed",
    "rank",
    "world_size",
    "is_main",
    "wrap",
    "shard",
    "reduce_batch_stats",
    "barrier",
    "check_batch_size",
]


def is_distributed() -> bool:
    """``True`` inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the process group (0 outside one)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of processes in the group (1 outside one)."""
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Rank 0, the one that writes snapshots and shows the progress bar (always ``True`` outside a group)."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (a no-op outside a group)."""
    if is_distributed():
        dist.barrier()


def check_batch_size(batch_size: int) -> None:
    """Each rank needs a sample of every full batch: ``batch_size >= world size``."""
    if batch_size < world_size():
        raise ValueError(
            f"`batch_size` ({batch_size}) is the global batch and must be at least the world size "
            f"({world_size()}); raise `batch_size` or launch fewer processes."
        )


def wrap(model: nn.Module) -> nn.Module:
    """``model`` in :class:`~torch.nn.parallel.DistributedDataParallel` inside a group, else ``model`` itself.

    DDP broadcasts rank 0's parameters and buffers on construction, so every rank starts from the same model.
    """
    if not is_distributed():
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def shard(idx: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """This rank's piece of the global batch ``idx``: ``(indices, n_r, c_r)``, ``c_r = W n_r / B`` the loss weight.

    An empty piece comes back as ``(idx[:1], 0, 0.0)``: one sample to run, counted as none, weighted zero.
    Outside a group: ``(idx, B, 1.0)``.
    """
    W = world_size()
    if W == 1:
        return idx, len(idx), 1.0
    mine = torch.tensor_split(idx, W)[rank()]
    if len(mine) == 0:
        return idx[:1], 0, 0.0
    return mine, len(mine), W * len(mine) / len(idx)


def reduce_batch_stats(loss_sum: float, correct: int, n: int, finite: bool) -> tuple[float, int, int, bool]:
    """Sum ``(loss · n_r, correct_r, n_r)`` over the ranks, and whether every rank's loss was finite.

    Called before the backward pass, so all ranks learn together that some rank's loss is not finite and raise
    together (rather than the others waiting forever in DDP's all-reduce).
    """
    if not is_distributed():
        return loss_sum, correct, n, finite
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    t = torch.tensor(
        [loss_sum if finite else 0.0, float(correct), float(n), 0.0 if finite else 1.0],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(t)
    return float(t[0]), int(t[1]), int(t[2]), bool(t[3] == 0)
