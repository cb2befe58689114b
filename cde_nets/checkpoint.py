"""Atomic checkpoints and the random-number state a bit-exact resume needs.

A checkpoint is written to a temporary file in the target's directory, flushed and fsynced, then renamed over the
target with ``os.replace`` (atomic on POSIX), and the directory is fsynced so the rename itself survives a crash.
A process killed at any instant therefore leaves either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_checkpoint", "rng_state", "set_rng_state"]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | Path, state: dict) -> None:
    """Write ``state`` (anything ``torch.save`` takes) to ``path`` atomically.

    Temporary files of earlier writes to the same path that a kill left behind (``.NAME.*.tmp``) are removed.
    """
    path = Path(path)
    atomic_write(path, lambda fh: torch.save(state, fh), binary=True)
    _fsync_dir(path.parent)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def atomic_write(path: str | Path, write, binary: bool = False) -> Path:
    """Call ``write(fh)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``: a reader sees
    the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint` (it holds numpy and Python RNG states, so it is loaded
    with ``weights_only=False``: load only checkpoints you wrote)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}; start without `resume` or pass the right path.")
    return torch.load(path, weights_only=False)


def rng_state(*generators: torch.Generator) -> dict:
    """The global torch, numpy and Python RNG states plus those of ``generators`` (e.g. the batching generator)."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "generators": [g.get_state() for g in generators]}


def set_rng_state(state: dict, *generators: torch.Generator) -> None:
    """Restore what :func:`rng_state` captured, the explicit generators in the same order."""
    if len(state["generators"]) != len(generators):
        raise ValueError(f"the checkpoint holds {len(state['generators'])} generator states but "
                         f"{len(generators)} generators were passed to restore.")
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    for g, s in zip(generators, state["generators"]):
        g.set_state(s)
