"""The training loop every experiment uses: reproducible, checkpointed atomically each epoch, resumable.

``fit(model, data, ...)`` trains for classification (one logit: BCE; several: cross-entropy) or regression
(MSE) with any optimiser, the seeds' regularisers (``Regulariser`` terms: eq. R82 smoothness, R_K and R_ℓ of
SPEC §2, weight decay), a post-step hook (NAIS ``project_()``), a tqdm progress bar and per-epoch metrics. One
seed fixes the batching (an explicit generator); :func:`seeded` fixes initialisation. A checkpoint holds the
model, optimiser, scheduler, history and every RNG state, written to a temporary file, fsynced and renamed, so a
killed run resumes exactly where it stopped and ends bit for bit as an uninterrupted one.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .pieces import smoothness

__all__ = ["Regulariser", "smoothness_R82", "smoothness_RK", "spectral_R_ell", "weight_decay", "seeded", "fit",
           "evaluate", "save_checkpoint", "load_checkpoint"]


@dataclass
class Regulariser:
    """``weight · fn(model)`` added to the loss; ``name`` appears in the metrics."""

    name: str
    weight: float
    fn: Callable[[nn.Module], torch.Tensor]


def smoothness_R82(weight: float) -> Regulariser:
    """eq. R82: ``(1/(2h)) Σ_l (‖w_l − w_{l−1}‖² + ‖b_l − b_{l−1}‖²)`` over every piecewise parameter."""
    return Regulariser("R82", weight, lambda m: smoothness(m))


def smoothness_RK(weight: float, h: float) -> Regulariser:
    """R_K of SPEC §2: ``(h/2) Σ_j (‖K_j − K_{j−1}‖² + ‖b_j − b_{j−1}‖²)``."""
    return Regulariser("R_K", weight, lambda m: smoothness(m, scale=h / 2))


def spectral_R_ell(weight: float, matrices: Callable[[nn.Module], Iterable[torch.Tensor]]) -> Regulariser:
    """R_ℓ of SPEC §2: ``Σ ‖M‖₂`` over the matrices ``matrices(model)`` yields (e.g. every ``K_j`` and ``J``)."""
    return Regulariser("R_ell", weight, lambda m: sum(torch.linalg.matrix_norm(M, 2) for M in matrices(m)))


def weight_decay(weight: float, params: Callable[[nn.Module], Iterable[torch.Tensor]]) -> Regulariser:
    """``Σ ‖θ‖²`` over chosen parameters (e.g. the output layer's, as in H-DNN)."""
    return Regulariser("weight_decay", weight, lambda m: sum(p.square().sum() for p in params(m)))


@contextmanager
def seeded(seed: int):
    """Fix torch, numpy and Python RNGs inside the block (for initialising models reproducibly)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    yield


def _loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if task == "regression":
        return F.mse_loss(out, y)
    if out.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(out[:, 0], y.to(out.dtype))
    return F.cross_entropy(out, y)


def _correct(out: torch.Tensor, y: torch.Tensor) -> int:
    pred = (out[:, 0] > 0).long() if out.shape[-1] == 1 else out.argmax(-1)
    return int((pred == y).sum())


def _outputs(out):
    """Blocks with stopping return ``(y, depths)``; models may too. Keep the prediction."""
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str = "classification",
             batch_size: int = 1024) -> dict:
    """Loss and (classification) accuracy of ``model`` on ``(x, y)``, in evaluation mode."""
    was = model.training
    model.eval()
    total, correct = 0.0, 0
    for i in range(0, len(y), batch_size):
        out = _outputs(model(x[i:i + batch_size]))
        total += float(_loss(task, out, y[i:i + batch_size])) * len(out)
        if task == "classification":
            correct += _correct(out, y[i:i + batch_size])
    model.train(was)
    res = {"loss": total / len(y)}
    if task == "classification":
        res["accuracy"] = correct / len(y)
    return res


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write atomically: a temporary file in the same directory, fsync, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | Path) -> dict:
    return torch.load(path, weights_only=False)


def _rng_state(batch_gen: torch.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "batches": batch_gen.get_state()}


def _set_rng_state(state: dict, batch_gen: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    batch_gen.set_state(state["batches"])


def fit(model: nn.Module, data, *, epochs: int, batch_size: int = 128, optimizer=None, lr: float = 1e-2,
        task: str = "classification", regularisers: Iterable[Regulariser] = (), post_step: Callable | None = None,
        scheduler=None, seed: int = 0, checkpoint: str | Path | None = None, resume: bool = False,
        progress: bool = True, desc: str = "train", epoch_callback: Callable | None = None) -> list[dict]:
    """Train ``model`` on ``data`` (a :class:`~cde_nets.datasets.Split` or ``(x_train, y_train, x_test, y_test)``).

    Args:
        optimizer: an optimiser over ``model``'s parameters, or a factory ``params -> optimiser``; default Adam(lr).
        regularisers: :class:`Regulariser` terms added to the loss.
        post_step: called with the model after every optimiser step (e.g. ``lambda m: m.block.field.project_()``).
        checkpoint: file written atomically after every epoch; with ``resume=True`` training continues from it.
        epoch_callback: ``f(epoch, model, metrics)`` after each epoch (may add entries to ``metrics``).
    Returns the per-epoch metrics: train loss/accuracy (running, over the epoch), test loss/accuracy, time.
    """
    if task not in ("classification", "regression"):
        raise ValueError(f"`task` must be 'classification' or 'regression', got {task!r}.")
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"`epochs` must be a positive integer, got {epochs!r}.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size!r}.")
    x_tr, y_tr, x_te, y_te = data
    if len(x_tr) != len(y_tr):
        raise ValueError(f"x_train has {len(x_tr)} rows but y_train has {len(y_tr)}.")
    if optimizer is None:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    elif isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    else:
        opt = optimizer(model.parameters())
    regularisers = list(regularisers)
    batch_gen = torch.Generator().manual_seed(seed)
    history: list[dict] = []
    start = 0
    if resume and checkpoint is not None and Path(checkpoint).exists():
        ck = load_checkpoint(checkpoint)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        if scheduler is not None and ck.get("scheduler") is not None:
            scheduler.load_state_dict(ck["scheduler"])
        _set_rng_state(ck["rng"], batch_gen)
        history, start = ck["history"], ck["epoch"] + 1
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=epochs, initial=start, desc=desc, leave=False, dynamic_ncols=True)
    for epoch in range(start, epochs):
        t0 = time.perf_counter()
        model.train()
        perm = torch.randperm(len(y_tr), generator=batch_gen)
        run_loss, run_correct, seen = 0.0, 0, 0
        for i in range(0, len(perm), batch_size):
            idx = perm[i:i + batch_size]
            xb, yb = x_tr[idx], y_tr[idx]
            opt.zero_grad(set_to_none=True)
            out = _outputs(model(xb))
            loss = _loss(task, out, yb)
            total = loss
            for reg in regularisers:
                total = total + reg.weight * reg.fn(model)
            if not torch.isfinite(total):
                raise FloatingPointError(f"loss became {float(total)} in epoch {epoch}; lower the learning rate "
                                         "or tighten the solver tolerance (the checkpoint of the last epoch is intact).")
            total.backward()
            opt.step()
            if post_step is not None:
                post_step(model)
            run_loss += float(loss) * len(yb)
            seen += len(yb)
            if task == "classification":
                run_correct += _correct(out.detach(), yb)
        if scheduler is not None:
            scheduler.step()
        metrics = {"epoch": epoch, "train_loss": run_loss / seen, "time_s": time.perf_counter() - t0}
        if task == "classification":
            metrics["train_accuracy"] = run_correct / seen
        test = evaluate(model, x_te, y_te, task)
        metrics.update({f"test_{k}": v for k, v in test.items()})
        if epoch_callback is not None:
            epoch_callback(epoch, model, metrics)
        history.append(metrics)
        if checkpoint is not None:
            save_checkpoint(checkpoint, {
                "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": None if scheduler is None else scheduler.state_dict(), "epoch": epoch,
                "history": history, "rng": _rng_state(batch_gen)})
        if bar is not None:
            bar.update(1)
            bar.set_postfix({k: f"{v:.4f}" for k, v in metrics.items() if k in ("train_loss", "test_accuracy")})
    if bar is not None:
        bar.close()
    return history
