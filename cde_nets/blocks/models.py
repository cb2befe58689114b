"""Classifier wrappers around a continuous-depth block: embed → block → read out.

The seeds' models are all of this shape: H-DNN pads the 2-D input with zeros to ``R⁴`` and reads out with
``sigmoid(linear)`` (Galimberti et al.); Ruseckas's model 2 augments ``(x, y) → (x, y, 0)`` and reads ``sigmoid(x₃)``,
his
MNIST model pads the image with 9 zero channels and reads the global max pool (Ruseckas); NAIS-Net feeds the input
as the block input ``u`` with ``x(0) = 0`` (Ciccone et al.).
"""

from __future__ import annotations

import torch
from torch import nn

from cde_nets.solvers.errors import check_positive_int

__all__ = ["ZeroPad", "Readout", "Classifier"]


class ZeroPad(nn.Module):
    """Append zero features (``(batch, d) → (batch, dim)``) or channels (``(b, c, H, W) → (b, dim, H, W)``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.dim - x.shape[1]
        if extra < 0:
            raise ValueError(f"input has {x.shape[1]} features/channels, more than the state size {self.dim}.")
        if extra == 0:
            return x
        pad = x.new_zeros(x.shape[0], extra, *x.shape[2:])
        return torch.cat([x, pad], 1)


class Readout(nn.Module):
    """``linear`` (a trained affine map), ``coordinate`` (the last ``n_out`` state entries, no parameters) or
    ``maxpool`` (global max over the spatial axes of an image state, then ``linear`` unless ``n_out`` equals the
    channel count and ``affine=False``)."""

    def __init__(self, kind: str, state_dim: int, n_out: int, affine: bool = True):
        super().__init__()
        if kind not in ("linear", "coordinate", "maxpool"):
            raise ValueError(f"`readout` must be 'linear', 'coordinate' or 'maxpool', got {kind!r}.")
        for name, v in (("state_dim", state_dim), ("n_out", n_out)):
            check_positive_int(name, v)
        self.kind = kind
        self.n_out = n_out
        if kind == "coordinate" and n_out > state_dim:
            raise ValueError(f"`readout='coordinate'` needs n_out <= state size, got {n_out} > {state_dim}.")
        self.linear = nn.Linear(state_dim, n_out) if (kind == "linear" or (kind == "maxpool" and affine)) else None

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "maxpool":
            y = y.amax(dim=tuple(range(2, y.dim())))
        elif self.kind == "coordinate":
            return y[:, -self.n_out :]
        return y[:, : self.n_out] if self.linear is None else self.linear(y)


class Classifier(nn.Module):
    """``logits = readout(block(pad(x)))``, or with ``input_as_u`` (NAIS): ``readout(block(0, u=embed(x)))``.

    ``block`` is any module mapping a state to a state: an :class:`~cde_nets.ODEBlock`, a discretised net, or an
    ``nn.Sequential`` of several. One output logit means binary classification (BCE); more mean softmax.
    """

    def __init__(
        self,
        block: nn.Module,
        in_features: int,
        state_dim: int,
        n_out: int,
        readout: str = "linear",
        input_as_u: bool = False,
        embed: nn.Module | None = None,
        affine: bool = True,
    ):
        super().__init__()
        self.block = block
        self.input_as_u = input_as_u
        self.embed = embed if embed is not None else (nn.Identity() if input_as_u else ZeroPad(state_dim))
        self.state_dim = state_dim
        self.readout = Readout(readout, state_dim, n_out, affine=affine)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output state (before the read-out)."""
        z = self.embed(x)
        if self.input_as_u:
            return self.block(z.new_zeros(z.shape[0], self.state_dim), u=z)
        return self.block(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.features(x))
