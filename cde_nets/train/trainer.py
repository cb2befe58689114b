"""The training loop every experiment uses: reproducible, snapshotted atomically, resumable, and refusing to
continue from anything it cannot trust.

A :class:`Trainer` is the training policy — task and loss, optimiser, regularisers, schedule, what is snapshotted
and when, what happens on a non-finite gradient — and ``trainer.fit(model, data, epochs=, batch_size=)`` applies
it. Classification uses binary cross-entropy on one logit and cross-entropy on several; regression MSE. The seeds'
regularisers are :class:`Regulariser` terms (Ruseckas eq. 82 smoothness; Galimberti et al.'s R_K and R_ℓ; weight
decay).

Reproducibility: the data loaders take a seed, :func:`seeded` fixes initialisation, and the trainer's ``seed``
fixes the batching and every random draw during training (dropout, Hutchinson probes) through generators of its
own: the caller's global random state is left as it was. A snapshot holds the model, optimiser, scheduler,
history, those generators and the training configuration, so a run killed at any instant and resumed ends bit
for bit as an uninterrupted one — and a resume under other settings (optimiser, learning rate, loss,
regularisers, data, model) is refused with the list of differences. :func:`snapshotting` snapshots every
``fit`` inside a block (a script of several trainings, such as a reproduction:
``cde-nets experiments <name> --resume``).

Launched with ``torchrun`` (or :func:`cde_nets.distributed.launch.spawn`), ``fit`` trains data-parallel with
DistributedDataParallel, each rank on its share of every global batch (:mod:`cde_nets.distributed.data_parallel`).
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cde_nets.blocks.collected_terms import integrated_terms
from cde_nets.distributed import data_parallel as dp
from cde_nets.fields.pieces import smoothness
from cde_nets.solvers.errors import Reason, SolverError, check_positive_int
from cde_nets.train.progress import progress
from cde_nets.train.snapshots import SnapshotError, load_snapshot, save_snapshot

__all__ = [
    "Trainer",
    "Snapshots",
    "Hooks",
    "NonFiniteError",
    "Regulariser",
    "smoothness_R82",
    "smoothness_RK",
    "spectral_R_ell",
    "weight_decay",
    "seeded",
    "evaluate",
    "task_loss",
    "snapshotting",
    "snapshot_file",
    "save_snapshot",
    "load_snapshot",
    "SnapshotError",
]

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
    """eq. R82 (Ruseckas): ``(1/(2h)) Σ_l (‖w_l − w_{l−1}‖_F² + ‖b_l − b_{l−1}‖²)`` over every piecewise parameter."""
    return Regulariser("R82", weight, lambda m: smoothness(m))


def smoothness_RK(weight: float, h: float) -> Regulariser:
    """R_K of Galimberti et al.: ``(h/2) Σ_j (‖K_j − K_{j−1}‖_F² + ‖b_j − b_{j−1}‖²)`` over every piecewise
    parameter."""
    if not h > 0:
        raise ValueError(f"`h` must be the positive piece length T/L, got {h!r}.")
    return Regulariser("R_K", weight, lambda m: smoothness(m, scale=h / 2))


def spectral_R_ell(weight: float, matrices: Matrices) -> Regulariser:
    """R_ℓ of Galimberti et al.: ``Σ_j (‖K_j‖₂ + ‖J_j‖₂)``, spectral norms of the matrices ``matrices(model)`` yields.

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
    """The loss :func:`fit` trains on: MSE (regression), BCE on one logit, cross-entropy on several, the negative
    mean log-likelihood of a density model whose output is ``log p(x)`` per sample (density)."""
    if task == "density":
        return -out.mean()
    if task == "regression":
        return F.mse_loss(out, y.to(out.dtype).reshape(out.shape))
    if out.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(out[:, 0], y.to(out.dtype))
    return F.cross_entropy(out, y)


def _correct(out: torch.Tensor, y: torch.Tensor) -> int:
    pred = (out[:, 0] > 0).long() if out.shape[-1] == 1 else out.argmax(-1)
    return int((pred == y).sum())


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str = "classification", batch_size: int = 1024
) -> dict:
    """Mean loss and (classification) accuracy of ``model`` on ``x (n, …)``, ``y (n,)``, in evaluation mode.

    A sample whose state goes non-finite in a block (the block's ``SolverError``; a conditionally stable discrete
    net such as an explicit cubic-friction stack meets inputs it cannot carry) has no prediction: it counts as
    wrong, is left out of the mean loss, and ``nonfinite`` says how many there were (the batch holding it is
    evaluated again sample by sample to find them)."""
    was = model.training
    model.eval()
    total, correct, lost = 0.0, 0, 0
    try:
        for i in range(0, len(y), batch_size):
            batch = _scored(model, x[i : i + batch_size], y[i : i + batch_size], task)
            parts = [batch] if batch is not None else [
                _scored(model, x[j : j + 1], y[j : j + 1], task) for j in range(i, min(i + batch_size, len(y)))
            ]  # fmt: skip
            for part in parts:
                if part is None:
                    lost += 1
                else:
                    total, correct = total + part[0], correct + part[1]
    finally:
        model.train(was)
    res = {"loss": total / (len(y) - lost) if lost < len(y) else float("nan"), "nonfinite": lost}
    if task == "classification":
        res["accuracy"] = correct / len(y)
    return res


def _scored(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str) -> tuple[float, int] | None:
    """Summed loss and correct count of one batch; ``None`` where a block's state went non-finite on it."""
    try:
        out = model(x)
    except SolverError as exc:
        if exc.reason is not Reason.NONFINITE:
            raise
        return None
    return float(task_loss(task, out, y)) * len(out), _correct(out, y) if task == "classification" else 0


class NonFiniteError(FloatingPointError):
    """A loss or gradient became NaN/inf; the parameters were not updated with it and nothing non-finite was
    saved. ``last_snapshot`` names the last good snapshot (``None`` if none was written); ``where`` what went
    non-finite and when (``"the state became non-finite in epoch 3, batch 0"``), the solver's error, if one
    raised it, being the ``__cause__``."""

    def __init__(self, message: str, last_snapshot: Path | None, where: str = ""):
        super().__init__(message)
        self.last_snapshot = last_snapshot
        self.where = where


@dataclass(frozen=True)
class Snapshots:
    """What is snapshotted and when: the model, optimiser, scheduler, history, random generators and training
    configuration, written atomically to ``path`` after every ``every``-th epoch and after the last one. With
    ``resume=True`` training continues from ``path`` (a missing file starts afresh, so one command serves the
    first run and every restart)."""

    path: str | Path
    every: int = 1
    resume: bool = False

    def __post_init__(self) -> None:
        check_positive_int("every", self.every, "epochs between snapshots")
        self.check_path()

    def check_path(self) -> None:
        """Refuse a ``path`` that is an existing directory (the snapshot is a file renamed over it), before any
        training is spent."""
        if Path(self.path).is_dir():
            raise ValueError(
                f"snapshot `path` {str(self.path)!r} is an existing directory; name a file in it, e.g. "
                f"{str(Path(self.path) / 'snapshot.pt')!r}."
            )


@dataclass(frozen=True)
class Hooks:
    """Calls into a training run: ``batch(model, x, y)`` before each batch's forward pass (e.g. refit a read-out on
    the batch's frozen features, as H-DNN's reference training does), ``post_step(model)`` after every optimiser
    step (e.g. NAIS's ``project_()``), ``epoch(epoch, model, metrics)`` after each epoch, before its snapshot
    (may add metrics)."""

    batch: Callable[[nn.Module, torch.Tensor, torch.Tensor], None] | None = None
    post_step: Callable[[nn.Module], None] | None = None
    epoch: Callable[[int, nn.Module, dict], None] | None = None


_TASKS = ("classification", "regression", "density")
_NONFINITE = ("raise", "skip")


class Trainer:
    """A training policy; :meth:`fit` applies it to a model and data.

    Args:
        task: ``"classification"`` (labels ``(n,)`` integers; one logit trains binary cross-entropy on labels 0/1,
            ``C`` logits cross-entropy on labels ``0..C−1``) or ``"regression"`` (MSE against float targets of the
            output's shape) or ``"density"`` (the model returns ``log p(x)`` per sample, e.g. a
            :class:`~cde_nets.flows.ContinuousFlow`; the loss is its negative mean, labels are ignored).
        optimizer: a factory ``params -> Optimizer`` (e.g. ``lambda p: torch.optim.SGD(p, lr=0.1)``); default Adam
            with learning rate ``lr``.
        lr: the default Adam's learning rate (> 0); refused together with ``optimizer``, which sets its own.
        regularisers: :class:`Regulariser` terms added to the loss.
        scheduler: a factory ``optimizer -> LR scheduler``, stepped once per epoch (``ReduceLROnPlateau`` with the
            epoch's test loss, or train loss without test data), or after every optimiser step with
            ``scheduler_interval="batch"``.
        seed: fixes the batch order and every random draw of the training (its own generators; the global random
            state is restored afterwards).
        nonfinite: what a non-finite loss or gradient does, or a block's state gone non-finite in the forward pass
            (its :class:`~cde_nets.solvers.errors.SolverError`): ``"raise"`` (:class:`NonFiniteError` naming the
            epoch, the batch and the last good snapshot, the solver's error as its cause) or ``"skip"`` (the step
            is skipped and counted in the epoch's ``skipped_steps``). Either way non-finite values never reach the
            parameters nor a snapshot.
        snapshots: a :class:`Snapshots` policy (or a path: every epoch, no resume). Inside
            :func:`snapshotting`, ``None`` means the block's next file.
        hooks: :class:`Hooks` into the run.
        progress: show a tqdm bar on a terminal, one line per epoch when stderr is a file or a pipe (rank 0
            only); ``desc`` labels it and names the run's snapshot in a block.
    """

    def __init__(
        self,
        *,
        task: str = "classification",
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        lr: float | None = None,
        regularisers: Iterable[Regulariser] = (),
        scheduler: Callable[[torch.optim.Optimizer], object] | None = None,
        scheduler_interval: str = "epoch",
        seed: int = 0,
        nonfinite: str = "raise",
        snapshots: Snapshots | str | Path | None = None,
        hooks: Hooks | None = None,
        progress: bool = True,
        desc: str = "train",
    ):
        if task not in _TASKS:
            raise ValueError(f"`task` must be one of {_TASKS}, got {task!r}.")
        if optimizer is not None and lr is not None:
            raise ValueError(
                "`lr` sets the default Adam's learning rate; `optimizer` sets its own. Drop `lr` (put the "
                "learning rate in the factory) or drop `optimizer`."
            )
        if optimizer is not None and (isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer)):
            raise TypeError(
                "`optimizer` must be a factory `params -> Optimizer` (e.g. `lambda p: torch.optim.SGD(p, "
                "lr=0.1)`), so that a resumed run can rebuild it and check its settings."
            )
        lr = 1e-2 if lr is None else lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"`lr` must be a finite number > 0, got {lr!r}.")
        if scheduler_interval not in ("epoch", "batch"):
            raise ValueError(f"`scheduler_interval` must be 'epoch' or 'batch', got {scheduler_interval!r}.")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"`seed` must be a non-negative integer, got {seed!r}.")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"`nonfinite` must be 'raise' or 'skip', got {nonfinite!r}.")
        regularisers = list(regularisers)
        for r in regularisers:
            if not isinstance(r, Regulariser):
                raise TypeError(f"`regularisers` must hold Regulariser terms, got {type(r).__name__}.")
        if isinstance(snapshots, (str, Path)):
            snapshots = Snapshots(snapshots)
        if snapshots is not None and not isinstance(snapshots, Snapshots):
            raise TypeError(f"`snapshots` must be a Snapshots policy or a path, got {type(snapshots).__name__}.")
        self.task, self.optimizer, self.lr = task, optimizer, float(lr)
        self.regularisers = regularisers
        self.scheduler, self.scheduler_interval = scheduler, scheduler_interval
        self.seed, self.nonfinite = seed, nonfinite
        self.snapshots = snapshots
        self.hooks = hooks or Hooks()
        self.progress, self.desc = bool(progress), str(desc)

    # -- configuration a resume must match -------------------------------------------------------------
    def _configuration(
        self, model: nn.Module, opt: torch.optim.Optimizer, sched, batch_size: int, x: torch.Tensor, y: torch.Tensor
    ) -> dict:
        hyper = {k: v for k, v in opt.defaults.items() if isinstance(v, (bool, int, float, str, tuple, type(None)))}
        return {
            "task": self.task,
            "optimizer": {
                "class": type(opt).__name__,
                **{k: list(v) if isinstance(v, tuple) else v for k, v in hyper.items()},
            },
            "scheduler": None if sched is None else type(sched).__name__,
            "scheduler_interval": self.scheduler_interval,
            "regularisers": [[r.name, r.weight] for r in self.regularisers],
            "seed": self.seed,
            "batch_size": batch_size,
            "nonfinite": self.nonfinite,
            "data": _data_signature(x, y),
            "model": {k: list(v.shape) for k, v in model.state_dict().items()},
        }

    # -- the run ---------------------------------------------------------------------------------------
    def fit(self, model: nn.Module, data, *, epochs: int, batch_size: int = 128) -> list[dict]:
        """Train ``model`` on ``data``: a :class:`~cde_nets.datasets.Split` or ``(x_train, y_train, x_test,
        y_test)`` (``None`` for both test entries to skip testing), for ``epochs`` epochs in all (a resumed run
        trains the missing ones; asking for more epochs than a finished snapshot holds extends it).

        Returns the per-epoch metrics (one dict per epoch, resumed epochs included): ``epoch``, ``train_loss`` and
        ``train_accuracy`` (running, over the epoch's batches), ``reg_<name>``, ``test_loss``, ``test_accuracy``,
        ``lr``, ``skipped_steps`` and ``time_s``.

        Data-parallel: the same script launched as ``torchrun --standalone --nproc_per_node 2 script.py`` trains
        with ``DistributedDataParallel`` once ``torch.distributed`` is initialised with more than one process
        (``torch.distributed.init_process_group("gloo")``; ``"nccl"`` on GPUs). ``batch_size`` stays the global
        batch: every rank draws the same seeded permutation and trains on its contiguous share of each global
        batch, its loss weighted so that the averaged gradient is that of the global batch mean. Parameters
        follow the single-process run up to rounding for models that treat samples independently and use
        fixed-step solvers. Regularisers and hooks run on every rank; metrics are summed over ranks; only rank 0
        shows the progress bar and writes snapshots.
        """
        x_tr, y_tr, x_te, y_te = _check_data(self.task, data)
        check_positive_int("epochs", epochs)
        check_positive_int("batch_size", batch_size)
        dp.check_batch_size(batch_size)
        policy = self.snapshots
        block = _SNAPSHOTTING.get()
        if policy is None and block is not None:
            policy = Snapshots(block.next_path(self.desc), resume=block.resume)
        if policy is not None:
            policy.check_path()  # the directory may have appeared since the policy was made
        opt = self._make_optimizer(model)
        sched = None if self.scheduler is None else self.scheduler(opt)
        config = self._configuration(model, opt, sched, batch_size, x_tr, y_tr)
        devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices):
            return self._run(model, opt, sched, config, policy, x_tr, y_tr, x_te, y_te, epochs, batch_size)

    def _make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.optimizer is None:
            return torch.optim.Adam(model.parameters(), lr=self.lr)
        opt = self.optimizer(model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"`optimizer` must be a factory `params -> Optimizer`, got a factory returning {type(opt).__name__}."
            )
        return opt

    def _run(self, model, opt, sched, config, policy, x_tr, y_tr, x_te, y_te, epochs, batch_size) -> list[dict]:
        batch_gen = torch.Generator().manual_seed(self.seed)
        history: list[dict] = []
        start = 0
        last_good: Path | None = None
        if policy is not None and policy.resume and Path(policy.path).exists():
            ck = load_snapshot(policy.path)
            _check_resume(policy.path, ck, config, epochs)
            _load_model(policy.path, model, ck["model"])
            opt.load_state_dict(ck["optimizer"])
            if sched is not None and ck["scheduler"] is not None:
                sched.load_state_dict(ck["scheduler"])
            torch.set_rng_state(ck["rng"]["torch"])
            batch_gen.set_state(ck["rng"]["batches"])
            history, start = ck["history"], ck["epoch"] + 1
            last_good = Path(policy.path)
        else:
            torch.manual_seed(self.seed)  # inside fit's fork of the global generator: the caller's is restored
        labels_checked = False
        net = dp.wrap(model)
        bar = None
        if self.progress and start < epochs and dp.is_main():
            bar = progress(epochs, start, self.desc)
        for epoch in range(start, epochs):
            t0 = time.perf_counter()
            step_sched = sched if self.scheduler_interval == "batch" else None
            metrics, labels_checked = self._epoch(
                model, net, opt, x_tr, y_tr, batch_size, batch_gen, epoch, step_sched, last_good, labels_checked
            )
            if x_te is not None:
                metrics.update({f"test_{k}": v for k, v in evaluate(model, x_te, y_te, self.task).items()})
            metrics["lr"] = opt.param_groups[0]["lr"]
            if sched is not None and self.scheduler_interval == "epoch":
                if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    sched.step(metrics.get("test_loss", metrics["train_loss"]))
                else:
                    sched.step()
            metrics["time_s"] = time.perf_counter() - t0
            if self.hooks.epoch is not None:
                self.hooks.epoch(epoch, model, metrics)
            history.append(metrics)
            if policy is not None and ((epoch + 1) % policy.every == 0 or epoch + 1 == epochs):
                _check_parameters_finite(model, epoch, last_good)
                if dp.is_main():
                    save_snapshot(
                        policy.path,
                        {
                            "format": _FORMAT,
                            "model": model.state_dict(),
                            "optimizer": opt.state_dict(),
                            "scheduler": None if sched is None else sched.state_dict(),
                            "epoch": epoch,
                            "history": history,
                            "config": config,
                            "rng": {"torch": torch.get_rng_state(), "batches": batch_gen.get_state()},
                        },
                    )
                dp.barrier()
                last_good = Path(policy.path)
            if bar is not None:
                bar.set_postfix(
                    {
                        k.replace("accuracy", "acc"): f"{v:.4g}"
                        for k, v in metrics.items()
                        if k in ("train_loss", "train_accuracy", "test_accuracy")
                    }
                )
                bar.update(1)
        if bar is not None:
            bar.close()
        return history

    def _batch_loss(self, model, net, xb, yb, weight, reg_sums: dict, y_tr, labels_checked: bool) -> tuple:
        """``(out, loss, total, None)`` for one batch: the task's loss and, in ``total``, the regularisers' terms
        added (their values summed into ``reg_sums``); ``(None, None, None, error)`` where a block's state went
        non-finite in the forward pass, which the policy treats as a non-finite loss."""
        try:
            # the blocks report this step's integrated regularisers into it: the modules keep nothing
            with integrated_terms():
                out = net(xb)
                if not labels_checked and self.task == "classification":
                    _check_labels(y_tr, out.shape[-1])
                loss = task_loss(self.task, out, yb)
                total = loss * weight
                for reg in self.regularisers:
                    value = reg.fn(model)
                    reg_sums[reg.name] += float(torch.as_tensor(value).detach())
                    total = total + reg.weight * value
        except SolverError as exc:
            # a block whose state went non-finite in the forward pass is a non-finite loss: the policy decides, as
            # it does for NaN reaching the loss itself
            if exc.reason is not Reason.NONFINITE:
                raise
            return None, None, None, exc
        return out, loss, total, None

    def _epoch(
        self, model, net, opt, x_tr, y_tr, batch_size, batch_gen, epoch, step_sched, last_good, labels_checked
    ) -> tuple[dict, bool]:
        net.train()
        perm = torch.randperm(len(y_tr), generator=batch_gen)
        run_loss, run_correct, seen, skipped = 0.0, 0, 0, 0
        reg_sums = {r.name: 0.0 for r in self.regularisers}
        n_batches = 0
        params = [p for p in model.parameters() if p.requires_grad]
        for b, i in enumerate(range(0, len(perm), batch_size)):
            idx = perm[i : i + batch_size]
            if self.hooks.batch is not None:
                self.hooks.batch(model, x_tr[idx], y_tr[idx])
            idx, n, weight = dp.shard(idx)
            xb, yb = x_tr[idx], y_tr[idx]
            opt.zero_grad(set_to_none=True)
            out, loss, total, diverged = self._batch_loss(model, net, xb, yb, weight, reg_sums, y_tr, labels_checked)
            labels_checked = labels_checked or (diverged is None and self.task == "classification")
            if diverged is None:
                correct = _correct(out.detach(), yb) if self.task == "classification" and n else 0
                loss_sum, correct, n, finite = dp.reduce_batch_stats(
                    float(loss.detach()) * n, correct, n, bool(torch.isfinite(total))
                )
            else:
                loss_sum, correct, n, finite = dp.reduce_batch_stats(0.0, 0, n, False)
            if finite:
                total.backward()
                # one fused norm over every gradient: NaN/inf anywhere makes it non-finite (DDP has already
                # averaged the gradients, so every rank decides alike)
                grads = [p.grad for p in params if p.grad is not None]
                finite = not grads or bool(
                    torch.isfinite(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
                )
                what = "gradient"
            else:
                what = "loss" if diverged is None else "state"
            if not finite:
                if self.nonfinite == "raise":
                    _raise_nonfinite(what, diverged, total, epoch, b, last_good)
                opt.zero_grad(set_to_none=True)
                skipped += 1
                continue
            opt.step()
            if step_sched is not None:
                step_sched.step()
            if self.hooks.post_step is not None:
                self.hooks.post_step(model)
            run_loss += loss_sum
            seen += n
            run_correct += correct
            n_batches += 1
        metrics: dict = {"epoch": epoch, "train_loss": run_loss / seen if seen else float("nan")}
        if self.task == "classification":
            metrics["train_accuracy"] = run_correct / seen if seen else float("nan")
        metrics.update({f"reg_{k}": v / max(n_batches, 1) for k, v in reg_sums.items()})
        metrics["skipped_steps"] = skipped
        return metrics, labels_checked


_FORMAT = "cde_nets.train.trainer/2"


def _check_data(task: str, data) -> tuple:
    if not isinstance(data, Sequence) or len(data) != 4:
        raise ValueError(
            "`data` must be a Split or a tuple (x_train, y_train, x_test, y_test); pass None for both "
            "test entries to skip testing."
        )
    x_tr, y_tr, x_te, y_te = data
    for name, t in (("x_train", x_tr), ("y_train", y_tr)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`data` {name} must be a torch.Tensor, got {type(t).__name__}.")
    if len(x_tr) != len(y_tr) or len(x_tr) == 0:
        raise ValueError(f"x_train and y_train must have the same positive length, got {len(x_tr)} and {len(y_tr)}.")
    if (x_te is None) != (y_te is None):
        raise ValueError("x_test and y_test must both be tensors or both be None.")
    for name, x in (("x_train", x_tr), ("x_test", x_te)):
        if x is not None and x.is_floating_point():
            bad = ~torch.isfinite(x.reshape(len(x), -1)).all(1)
            if bool(bad.any()):
                raise ValueError(
                    f"`data` {name} holds a non-finite value at sample {int(bad.nonzero()[0])} "
                    f"({int(bad.sum())} samples in all); clean or drop them before training."
                )
    if task == "classification":
        for name, y in (("y_train", y_tr), ("y_test", y_te)):
            if y is not None and (y.is_floating_point() or y.is_complex() or y.dtype == torch.bool):
                raise TypeError(
                    f"`data` {name} must hold integer class labels for classification, got {y.dtype}; "
                    "use `.long()`, or task='regression' for real-valued targets."
                )
    elif y_tr.is_floating_point() and not bool(torch.isfinite(y_tr).all()):
        raise ValueError("`data` y_train holds non-finite regression targets.")
    return x_tr, y_tr, x_te, y_te


def _check_labels(y: torch.Tensor, logits: int) -> None:
    hi = 2 if logits == 1 else logits
    bad = (y < 0) | (y >= hi)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        what = (
            "0 or 1 for one logit (binary cross-entropy)" if logits == 1 else f"in 0..{logits - 1} for {logits} logits"
        )
        raise ValueError(f"`data` y_train has label {int(y[i])} at sample {i}; labels must be {what}.")


def _raise_nonfinite(
    what: str, diverged: SolverError | None, total, epoch: int, batch: int, last_good: Path | None
) -> None:
    """Stop training on a non-finite ``what`` (loss, state or gradient), naming the cause and the last snapshot."""
    where = f"the last good snapshot is {str(last_good)!r}" if last_good else "no snapshot was written"
    cause = (
        f"the state became non-finite in the forward pass ({diverged})"
        if diverged is not None
        else f"the loss was {float(total.detach()):.6g}"
    )
    when = f"the {what} became non-finite in epoch {epoch}, batch {batch}"
    raise NonFiniteError(
        f"{when} ({cause}); the parameters were not updated with it and {where}. Lower the learning "
        "rate, tighten the solver tolerance, or train with nonfinite='skip' to skip such steps.",
        last_good,
        when,
    ) from diverged


def _check_parameters_finite(model: nn.Module, epoch: int, last_good: Path | None) -> None:
    for name, p in model.state_dict().items():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            where = f"the last good snapshot {str(last_good)!r} is kept" if last_good else "nothing was saved"
            raise NonFiniteError(
                f"`{name}` holds non-finite values after epoch {epoch}; it was not saved ({where}).", last_good
            )


def _check_resume(path, ck: dict, config: dict, epochs: int) -> None:
    if ck.get("format") != _FORMAT or "config" not in ck:
        raise SnapshotError(
            f"{str(path)!r} was not written by this version's Trainer (format "
            f"{ck.get('format')!r}); start afresh without resume, or delete the file."
        )
    old = ck["config"]
    diffs = []
    for key in config:
        if key == "model":
            continue
        if old.get(key) != config[key]:
            diffs.append(f"{key}: {old.get(key)!r} in the snapshot, {config[key]!r} now")
    diffs += _model_differences(old.get("model", {}), config["model"])
    if diffs:
        raise SnapshotError(
            f"{str(path)!r} was written with other settings; resume with the same ones (only "
            "`epochs` may grow) or start afresh without resume:\n  " + "\n  ".join(diffs)
        )
    if ck["epoch"] + 1 > epochs:
        raise SnapshotError(
            f"{str(path)!r} already holds {ck['epoch'] + 1} epochs but epochs={epochs} was asked "
            f"for; ask for epochs >= {ck['epoch'] + 1}, or start afresh without resume."
        )


def _model_differences(old: dict, new: dict) -> list[str]:
    out = [f"model parameter {k!r} is missing now" for k in old if k not in new]
    out += [f"model parameter {k!r} is new (not in the snapshot)" for k in new if k not in old]
    out += [
        f"model parameter {k!r} has shape {old[k]} in the snapshot, {new[k]} now"
        for k in new
        if k in old and old[k] != new[k]
    ]
    return out


def _load_model(path, model: nn.Module, state: dict) -> None:
    diffs = _model_differences(
        {k: list(v.shape) for k, v in state.items()}, {k: list(v.shape) for k, v in model.state_dict().items()}
    )
    if diffs:
        raise SnapshotError(f"{str(path)!r} holds another model:\n  " + "\n  ".join(diffs))
    model.load_state_dict(state)


@dataclass
class _Snapshotting:
    directory: Path
    resume: bool
    calls: int = 0

    def next_path(self, desc: str) -> Path:
        self.calls += 1
        slug = re.sub(r"[^A-Za-z0-9]+", "_", desc).strip("_")[:60] or "fit"
        return self.directory / f"{self.calls:03d}-{slug}.snapshot"


_SNAPSHOTTING: ContextVar[_Snapshotting | None] = ContextVar("cde_nets_snapshotting", default=None)


@contextmanager
def snapshotting(directory: str | Path, resume: bool = False) -> Iterator[Path]:
    """Snapshot every :meth:`Trainer.fit` called inside the block whose trainer has no ``snapshots`` policy.

    The ``k``-th call writes ``directory/<k>-<desc>.snapshot`` after each epoch; with ``resume=True`` each call
    continues from its file (a finished one returns its stored history at once, a missing one starts afresh). A
    block whose fits are deterministic given their seeds, as every reproduction's are, therefore ends bit for bit
    as an uninterrupted run however often it was killed and restarted. Resuming a different script, setting or
    data set into the same directory is refused by each file's configuration check.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    token = _SNAPSHOTTING.set(_Snapshotting(directory, bool(resume)))
    try:
        yield directory
    finally:
        _SNAPSHOTTING.reset(token)


def snapshot_file(desc: str) -> tuple[Path, bool] | None:
    """For a training loop of one's own inside a :func:`snapshotting` block: its next file (numbered as the
    Trainer's fits are) and whether to resume from it; ``None`` outside such a block."""
    block = _SNAPSHOTTING.get()
    return None if block is None else (block.next_path(desc), block.resume)


def _data_signature(x: torch.Tensor, y: torch.Tensor) -> list:
    """Shape and a float64 sum of the training data: enough to refuse resuming onto other data."""
    return [list(x.shape), float(x.double().sum()), float(y.double().sum())]
