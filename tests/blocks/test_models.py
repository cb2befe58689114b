"""Classifier wrappers: padding, read-outs, NAIS-style input."""

import pytest
import torch

from cde_nets.blocks.models import Classifier, Readout, ZeroPad


def test_zero_pad_features_and_channels():
    x = torch.randn(3, 2)
    assert torch.equal(ZeroPad(4)(x), torch.cat([x, torch.zeros(3, 2)], 1))
    img = torch.randn(2, 1, 5, 5)
    out = ZeroPad(10)(img)
    assert out.shape == (2, 10, 5, 5) and torch.equal(out[:, :1], img) and not out[:, 1:].any()
    with pytest.raises(ValueError, match="more than the state size"):
        ZeroPad(1)(x)


def test_readouts():
    y = torch.arange(12.0).reshape(2, 6)
    assert torch.equal(Readout("coordinate", 6, 1)(y), y[:, -1:])
    img = torch.randn(2, 3, 4, 4)
    assert torch.equal(Readout("maxpool", 3, 3, affine=False)(img), img.amax((2, 3)))
    with pytest.raises(ValueError, match="`readout` must be"):
        Readout("mean", 3, 1)


def test_classifier_passes_input_as_u():
    class Echo(torch.nn.Module):
        def forward(self, x0, u=None):
            assert not x0.any()
            return x0 + u.sum(1, keepdim=True)

    model = Classifier(Echo(), in_features=3, state_dim=4, n_out=1, readout="coordinate", input_as_u=True)
    x = torch.randn(5, 3)
    assert torch.allclose(model(x), x.sum(1, keepdim=True))
