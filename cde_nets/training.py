"""The training loop every experiment uses: reproducible, checkpointed atomically each epoch, resumable.

:func:`fit` trains for classification (one logit: binary cross-entropy; several: cross-entropy) or regression (MSE)
with any optimiser, the seeds' regularisers as :class:`Regulariser` terms (eq. R82 smoothness, R_K and R_ℓ of
SPEC §2, weight decay), a post-step hook (NAIS ``project_()``), a tqdm progress bar and per-epoch metrics.

Reproducibility: the data loaders take a seed, :func:`seeded` fixes initialisation, and ``fit(seed=...)`` fixes
the batching (an explicit ``torch.Generator``) and every global random draw during training (dropout, Hutchinson
probes). The checkpoint written after every epoch holds the model, optimiser, scheduler, history and all RNG
states, so a run killed at any instant and resumed with ``resume=True`` ends bit for bit as an uninterrupted one.
:func:`checkpointing` does this for every :func:`fit` inside a block (a script of several trainings, such as a
reproduction: ``python -m cde_nets.experiments <name> --resume``).

Launched with ``torchrun`` (or :func:`cde_nets.distributed.launch.spawn`), :func:`fit` trains data-parallel with
DistributedDataParallel, each rank on its share of every global batch (:mod:`cde_nets.distributed.data_parallel`).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .distributed import data_parallel as dp
from .pieces import smoothness

__all__ = ["Regulariser", "smoothness_R82", "smoothness_RK", "spectral_R_ell", "weight_decay", "seeded", "fit",
           "evaluate", "task_loss", "checkpointing", "save_checkpoint", "load_checkpoint"]

Matrices = Callable[[nn.Module], Iterable[torch.Tensor]]


def _total(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(())
    for t in terms:
        total = total + t
    return total


@dataclass
class Regulariser:
    """``weight · fn(model)`` added to the training loss; its epoch mean is reported as metric ``reg_<name>``."""

    name: str
    weight: float
    fn: Callable[[nn.Module], torch.Tensor]


def smoothness_R82(weight: float) -> Regulariser:
    """eq. R82 (SPEC §1): ``(1/(2h)) Σ_l (‖w_l − w_{l−1}‖_F² + ‖b_l − b_{l−1}‖²)`` over every piecewise parameter."""
    return Regulariser("R82", weight, lambda m: smoothness(m))


def smoothness_RK(weight: float, h: float) -> Regulariser:
    """R_K of SPEC §2: ``(h/2) Σ_j (‖K_j − K_{j−1}‖_F² + ‖b_j − b_{j−1}‖²)`` over every piecewise parameter."""
    if not h > 0:
        raise ValueError(f"`h` must be the positive piece length T/L, got {h!r}.")
    return Regulariser("R_K", weight, lambda m: smoothness(m, scale=h / 2))


def spectral_R_ell(weight: float, matrices: Matrices) -> Regulariser:
    """R_ℓ of SPEC §2: ``Σ_j (‖K_j‖₂ + ‖J_j‖₂)``, spectral norms of the matrices ``matrices(model)`` yields.

    A tensor of shape ``(L, n, m)`` counts as ``L`` matrices.
    """
    def fn(m: nn.Module) -> torch.Tensor:
        return _total(torch.linalg.matrix_norm(M, 2).sum() for M in matrices(m))

    return Regulariser("R_ell", weight, fn)


def weight_decay(weight: float, params: Matrices | None = None) -> Regulariser:
    """``Σ ‖θ‖²`` over ``params(model)`` (e.g. the output layer's, as in H-DNN); all parameters when ``None``."""
    def fn(m: nn.Module) -> torch.Tensor:
        return _total(p.square().sum() for p in (m.parameters() if params is None else params(m)))

    return Regulariser("weight_decay", weight, fn)


def _seed_globals(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


@contextmanager
def seeded(seed: int):
    """Seed torch, numpy and Python RNGs on entry (to initialise models reproducibly); they are not restored."""
    _seed_globals(seed)
    yield


def task_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss :func:`fit` trains on: MSE (regression), BCE on one logit, cross-entropy on several."""
    if task == "regression":
        return F.mse_loss(out, y.to(out.dtype).reshape(out.shape))
    if out.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(out[:, 0], y.to(out.dtype))
    return F.cross_entropy(out, y)


def _correct(out: torch.Tensor, y: torch.Tensor) -> int:
    pred = (out[:, 0] > 0).long() if out.shape[-1] == 1 else out.argmax(-1)
    return int((pred == y).sum())


def _prediction(out):
    """Blocks with stopping return ``(y, depths)``, and models may too: keep the prediction."""
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str = "classification",
             batch_size: int = 1024) -> dict:
    """Mean loss and (classification) accuracy of ``model`` on ``x (n, …)``, ``y (n,)``, in evaluation mode."""
    was = model.training
    model.eval()
    total, correct = 0.0, 0
    try:
        for i in range(0, len(y), batch_size):
            out = _prediction(model(x[i:i + batch_size]))
            total += float(task_loss(task, out, y[i:i + batch_size])) * len(out)
            if task == "classification":
                correct += _correct(out, y[i:i + batch_size])
    finally:
        model.train(was)
    res = {"loss": total / len(y)}
    if task == "classification":
        res["accuracy"] = correct / len(y)
    return res


def _make_optimizer(model: nn.Module, optimizer, lr: float) -> torch.optim.Optimizer:
    if optimizer is None:
        return torch.optim.Adam(model.parameters(), lr=lr)
    opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError("`optimizer` must be a torch.optim.Optimizer or a factory `params -> Optimizer`, "
                        f"got a factory returning {type(opt).__name__}.")
    return opt


def _make_scheduler(scheduler, opt: torch.optim.Optimizer):
    if scheduler is None or hasattr(scheduler, "state_dict"):
        return scheduler
    return scheduler(opt)


def _check_args(task: str, epochs: int, batch_size: int, data) -> tuple:
    if task not in ("classification", "regression"):
        raise ValueError(f"`task` must be 'classification' or 'regression', got {task!r}.")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"`epochs` must be a positive integer, got {epochs!r}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}.")
    if not isinstance(data, Sequence) or len(data) != 4:
        raise ValueError("`data` must be a Split or a tuple (x_train, y_train, x_test, y_test); "
                         "pass None for both test entries to skip testing.")
    x_tr, y_tr, x_te, y_te = data
    if len(x_tr) != len(y_tr) or len(x_tr) == 0:
        raise ValueError(f"x_train and y_train must have the same positive length, got {len(x_tr)} and {len(y_tr)}.")
    if (x_te is None) != (y_te is None):
        raise ValueError("x_test and y_test must both be tensors or both be None.")
    return x_tr, y_tr, x_te, y_te


@dataclass
class _Checkpointing:
    directory: Path
    resume: bool
    calls: int = 0

    def next_path(self, desc: str) -> Path:
        self.calls += 1
        slug = re.sub(r"[^A-Za-z0-9]+", "_", desc).strip("_")[:60] or "fit"
        return self.directory / f"{self.calls:03d}-{slug}.ckpt"


_CHECKPOINTING: ContextVar[_Checkpointing | None] = ContextVar("cde_nets_checkpointing", default=None)


@contextmanager
def checkpointing(directory: str | Path, resume: bool = False):
    """Checkpoint every :func:`fit` called inside the block that was not given its own ``checkpoint``.

    The ``k``-th call writes ``directory/<k>-<desc>.ckpt`` after each epoch; with ``resume=True`` each call
    continues from its file (a finished one returns its stored history at once, a missing one starts afresh). A
    block whose fits are deterministic given their seeds, as every reproduction's are, therefore ends bit for bit
    as an uninterrupted run however often it was killed and restarted. Resuming a different script, setting or
    data set into the same directory is refused by the per-file checks of ``fit`` (seed, batch size, data shape).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    token = _CHECKPOINTING.set(_Checkpointing(directory, bool(resume)))
    try:
        yield directory
    finally:
        _CHECKPOINTING.reset(token)


def _data_signature(x: torch.Tensor, y: torch.Tensor) -> list:
    """Shape and a float64 sum of the training data: enough to refuse resuming onto other data."""
    return [list(x.shape), float(x.double().sum()), float(y.double().sum())]


def fit(model: nn.Module, data, *, epochs: int, batch_size: int = 128, optimizer=None, lr: float = 1e-2,
        task: str = "classification", regularisers: Iterable[Regulariser] = (),
        post_step: Callable[[nn.Module], None] | None = None, scheduler=None, seed: int = 0,
        checkpoint: str | Path | None = None, resume: bool = False, progress: bool = True, desc: str = "train",
        epoch_callback: Callable[[int, nn.Module, dict], None] | None = None,
        batch_hook: Callable[[nn.Module, torch.Tensor, torch.Tensor], None] | None = None,
        scheduler_interval: str = "epoch") -> list[dict]:
    """Train ``model`` on ``data``: a :class:`~cde_nets.datasets.Split` or ``(x_train, y_train, x_test, y_test)``.

    Args:
        epochs: the total number of epochs (a resumed run trains only the missing ones).
        optimizer: an optimiser over ``model``'s parameters, or a factory ``params -> Optimizer``; default Adam(lr).
        task: ``"classification"`` (labels ``(n,)`` long; one logit uses BCE, several cross-entropy) or
            ``"regression"`` (MSE against float targets of the output's shape).
        regularisers: :class:`Regulariser` terms added to the loss.
        post_step: called with the model after every optimiser step (e.g. ``lambda m: m.block.field.project_()``).
        scheduler: an LR scheduler or a factory ``optimizer -> scheduler``; stepped once per epoch
            (``ReduceLROnPlateau`` with the epoch's test loss, or train loss without test data), or after every
            optimiser step with ``scheduler_interval="batch"``.
        batch_hook: ``f(model, x_batch, y_batch)`` before each batch's forward pass (e.g. refit a read-out on the
            batch's frozen features, as H-DNN's reference training does).
        seed: fixes the batch order and seeds the global RNGs at the start of a fresh run.
        checkpoint: file written atomically after every epoch; with ``resume=True`` training continues from it
            (a missing file starts afresh, so the same command serves the first run and every restart). Inside
            :func:`checkpointing`, ``None`` means the block's next file and the block's ``resume``.
        epoch_callback: ``f(epoch, model, metrics)`` after each epoch, before the checkpoint (may add metrics).
    Returns the per-epoch metrics (one dict per epoch, resumed epochs included): ``epoch``, ``train_loss`` and
    ``train_accuracy`` (running, over the epoch's batches), ``reg_<name>``, ``test_loss``, ``test_accuracy``,
    ``lr`` and ``time_s`` (training and evaluation of the epoch).

    Data-parallel: the same script launched as ``torchrun --standalone --nproc_per_node 2 script.py`` (or one whose
    ranks join a process group some other way, e.g. :func:`cde_nets.distributed.launch.spawn`) trains with
    ``DistributedDataParallel`` when ``torch.distributed`` is initialised with more than one process. A script run
    by torchrun initialises the group itself before calling ``fit``::

        torch.distributed.init_process_group("gloo")  # "nccl" on GPUs, with the model on cuda:LOCAL_RANK

    ``batch_size`` stays the global batch (at least the world size): every rank draws the same seeded permutation
    and trains on its contiguous share of each global batch, its loss weighted so that the averaged gradient is
    that of the global batch mean, also when the last batch splits unevenly. Parameters therefore follow the
    single-process run up to rounding (~1e-15 in float64) for models that treat samples independently and use
    fixed-step solvers (adaptive step control and batch norm see the rank's share, random draws such as dropout
    differ). Regularisers, ``post_step`` and ``batch_hook`` (called with the global batch) run on every rank on
    identical parameters; the metrics are summed over ranks, so every rank returns the global history. Only
    rank 0 shows the progress bar and writes the checkpoint (the others wait for it); with ``resume=True`` every
    rank loads the same file.
    """
    x_tr, y_tr, x_te, y_te = _check_args(task, epochs, batch_size, data)
    if scheduler_interval not in ("epoch", "batch"):
        raise ValueError(f"`scheduler_interval` must be 'epoch' or 'batch', got {scheduler_interval!r}.")
    block = _CHECKPOINTING.get()
    if checkpoint is None and block is not None:
        checkpoint, resume = block.next_path(desc), block.resume
    if resume and checkpoint is None:
        raise ValueError("`resume=True` needs `checkpoint`, the file to resume from.")
    signature = None if checkpoint is None else _data_signature(x_tr, y_tr)
    dp.check_batch_size(batch_size)
    opt = _make_optimizer(model, optimizer, lr)
    sched = _make_scheduler(scheduler, opt)
    regularisers = list(regularisers)
    batch_gen = torch.Generator().manual_seed(seed)
    history: list[dict] = []
    start = 0
    if resume and checkpoint is not None and Path(checkpoint).exists():
        ck = load_checkpoint(checkpoint)
        if (ck["seed"], ck["batch_size"]) != (seed, batch_size):
            raise ValueError(f"the checkpoint {str(checkpoint)!r} was written with seed={ck['seed']}, "
                             f"batch_size={ck['batch_size']}; resume with the same values or start afresh without "
                             "`resume`.")
        if ck.get("data") not in (None, signature):
            raise ValueError(f"the checkpoint {str(checkpoint)!r} was written for other training data (shape "
                             f"{ck['data'][0]}, here {list(x_tr.shape)}, or other values); resume on the same data "
                             "or start afresh without `resume`.")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        if sched is not None and ck["scheduler"] is not None:
            sched.load_state_dict(ck["scheduler"])
        set_rng_state(ck["rng"], batch_gen)
        history, start = ck["history"], ck["epoch"] + 1
    else:
        _seed_globals(seed)
    net = dp.wrap(model)
    bar = None
    if progress and start < epochs and dp.is_main():
        from tqdm.auto import tqdm

        bar = tqdm(total=epochs, initial=start, desc=desc, leave=False, dynamic_ncols=True)
    for epoch in range(start, epochs):
        t0 = time.perf_counter()
        step_sched = sched if scheduler_interval == "batch" else None
        metrics = _train_epoch(model, opt, x_tr, y_tr, batch_size, batch_gen, task, regularisers, post_step, epoch,
                               batch_hook, step_sched, net)
        if x_te is not None:
            metrics.update({f"test_{k}": v for k, v in evaluate(model, x_te, y_te, task).items()})
        metrics["lr"] = opt.param_groups[0]["lr"]
        if sched is not None and scheduler_interval == "epoch":
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(metrics.get("test_loss", metrics["train_loss"]))
            else:
                sched.step()
        metrics["time_s"] = time.perf_counter() - t0
        if epoch_callback is not None:
            epoch_callback(epoch, model, metrics)
        history.append(metrics)
        if checkpoint is not None:
            if dp.is_main():
                save_checkpoint(checkpoint, {
                    "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": None if sched is None else sched.state_dict(), "epoch": epoch, "history": history,
                    "seed": seed, "batch_size": batch_size, "rng": rng_state(batch_gen),
                    "data": signature})
            dp.barrier()
        if bar is not None:
            bar.update(1)
            bar.set_postfix({k.replace("accuracy", "acc"): f"{v:.4g}" for k, v in metrics.items()
                             if k in ("train_loss", "train_accuracy", "test_accuracy")})
    if bar is not None:
        bar.close()
    return history


def _train_epoch(model, opt, x_tr, y_tr, batch_size, batch_gen, task, regularisers, post_step, epoch, batch_hook=None,
                 step_sched=None, net=None) -> dict:
    """One epoch; ``net`` runs the forward pass (``model`` wrapped in DDP under torch.distributed)."""
    net = model if net is None else net
    net.train()
    perm = torch.randperm(len(y_tr), generator=batch_gen)
    run_loss, run_correct, seen = 0.0, 0, 0
    reg_sums = {r.name: 0.0 for r in regularisers}
    n_batches = 0
    for i in range(0, len(perm), batch_size):
        idx = perm[i:i + batch_size]
        if batch_hook is not None:
            batch_hook(model, x_tr[idx], y_tr[idx])
        idx, n, weight = dp.shard(idx)
        xb, yb = x_tr[idx], y_tr[idx]
        opt.zero_grad(set_to_none=True)
        out = _prediction(net(xb))
        loss = task_loss(task, out, yb)
        total = loss * weight
        for reg in regularisers:
            value = reg.fn(model)
            reg_sums[reg.name] += float(torch.as_tensor(value).detach())
            total = total + reg.weight * value
        correct = _correct(out.detach(), yb) if task == "classification" and n else 0
        loss_sum, correct, n, finite = dp.reduce_batch_stats(float(loss.detach()) * n, correct, n,
                                                             bool(torch.isfinite(total)))
        if not finite:
            value = float(total) if not torch.isfinite(total) else "non-finite on another rank"
            raise FloatingPointError(f"the loss became {value} in epoch {epoch}; lower the learning rate or "
                                     "tighten the solver tolerance (the last epoch's checkpoint is intact).")
        total.backward()
        opt.step()
        if step_sched is not None:
            step_sched.step()
        if post_step is not None:
            post_step(model)
        run_loss += loss_sum
        seen += n
        run_correct += correct
        n_batches += 1
    metrics = {"epoch": epoch, "train_loss": run_loss / seen}
    if task == "classification":
        metrics["train_accuracy"] = run_correct / seen
    metrics.update({f"reg_{k}": v / n_batches for k, v in reg_sums.items()})
    return metrics
