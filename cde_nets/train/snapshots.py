"""Atomic snapshots and the random-number state a bit-exact resume needs.

A snapshot is written to a temporary file in the target's directory, flushed and fsynced, then renamed over the
target with ``os.replace`` (atomic on POSIX), and the directory is fsynced so the rename itself survives a crash.
A process killed at any instant therefore leaves either the previous snapshot or the new one, never a torn file.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "save_snapshot",
    "load_snapshot",
    "atomic_write",
    "SnapshotError",
    "RunLock",
    "RunInUseError",
    "rng_state",
    "set_rng_state",
]


class SnapshotError(ValueError):
    """A snapshot that cannot be used: corrupt, truncated, empty, not a snapshot, or written for another model
    or other settings. The message names the file and what is wrong with it."""


class RunInUseError(RuntimeError):
    """Another live process holds the output folder's lock."""


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_snapshot(path: str | Path, state: dict) -> None:
    """Write ``state`` (anything ``torch.save`` takes) to ``path`` atomically.

    Temporary files that an earlier, killed writer of the same path left behind are removed; those of a live
    process (another run writing the same file) are left alone.
    """
    path = Path(path)
    atomic_write(path, lambda fh: torch.save(state, fh), binary=True)
    _fsync_dir(path.parent)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        pid = _writer_pid(stale.name, path.name)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            stale.unlink(missing_ok=True)


def _writer_pid(tmp_name: str, target: str) -> int | None:
    rest = tmp_name[len(target) + 2 :]  # ".<target>.<pid>.<random>.tmp"
    head = rest.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def atomic_write(path: str | Path, write, binary: bool = False) -> Path:
    """Call ``write(fh)`` on a temporary file beside ``path`` (named with this process's id), fsync it, then rename
    it over ``path``: a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # readable by others like any results file (mkstemp creates 0600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_snapshot(path: str | Path) -> dict:
    """Read a snapshot written by :func:`save_snapshot`, or say what is wrong with the file.

    It holds random-generator states, so it is loaded with ``weights_only=False``: load only snapshots you wrote.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no snapshot at {str(path)!r}; start without resume or pass the right path.")
    size = path.stat().st_size
    if size == 0:
        raise SnapshotError(f"{str(path)!r} is empty (0 bytes); delete it to start afresh.")
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:  # torch reports truncation and corruption through several exception types
        raise SnapshotError(
            f"{str(path)!r} is corrupt or truncated ({size} bytes; {type(exc).__name__}: "
            f"{str(exc)[:120]}); delete it to start afresh."
        ) from exc
    if not isinstance(state, dict) or not {"model", "optimizer", "epoch", "history"} <= set(state):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise SnapshotError(f"{str(path)!r} is not a cde_nets training snapshot (it holds {keys}).")
    return state


class RunLock:
    """One run per output folder: ``with RunLock(folder):`` creates ``folder/.lock`` holding this process's id and
    removes it on exit. A lock left by a process that no longer exists is taken over; one held by a live process
    raises :class:`RunInUseError` naming that process. The folder must be writable (checked before any work)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.path = self.directory / ".lock"

    def __enter__(self) -> RunLock:
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"`--out` {str(self.directory)!r} is a file; name a folder.")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PermissionError(
                f"`--out` {str(self.directory)!r} cannot be created ({exc.strerror}); choose a writable folder."
            ) from exc
        if not os.access(self.directory, os.W_OK):
            raise PermissionError(f"`--out` {str(self.directory)!r} is not writable; choose a writable folder.")
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pid = _lock_owner(self.path)
                if pid is not None and pid != os.getpid() and _alive(pid):
                    raise RunInUseError(
                        f"{str(self.directory)!r} is in use by another run (process {pid}); wait "
                        "for it, stop it, or choose another output folder."
                    ) from None
                self.path.unlink(missing_ok=True)  # left by a process that died
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(str(os.getpid()))
            return self
        raise RunInUseError(f"could not take the lock {str(self.path)!r}; another run is starting in this folder.")

    def __exit__(self, *exc: object) -> None:
        if _lock_owner(self.path) == os.getpid():
            self.path.unlink(missing_ok=True)


def _lock_owner(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def rng_state(*generators: torch.Generator) -> dict:
    """The global torch, numpy and Python RNG states plus those of ``generators`` (e.g. the batching generator)."""
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "generators": [g.get_state() for g in generators],
    }


def set_rng_state(state: dict, *generators: torch.Generator) -> None:
    """Restore what :func:`rng_state` captured, the explicit generators in the same order."""
    if len(state["generators"]) != len(generators):
        raise ValueError(
            f"the snapshot holds {len(state['generators'])} generator states but "
            f"{len(generators)} generators were passed to restore."
        )
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    for g, s in zip(generators, state["generators"]):
        g.set_state(s)
