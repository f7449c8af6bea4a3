"""PILOT's cosine classifier as a layer (EASE, COIL, RanPAC and FeCAM's heads)."""

from __future__ import annotations

import math

from .lazy import F, nn, no_grad, torch


class CosineHead(nn.Linear):
    """PILOT's ``CosineLinear`` / ``EaseCosineLinear`` (one proxy per class) as a layer that
    returns its logits: ``sigma * cos(x, w_c)``; an ``nn.Linear`` without bias to the loop.

    ``sigma`` is a parameter of the network (:func:`attach_cosine_head` registers it beside the
    head) that the head reads without registering it: the head's own parameters are then its
    ``[C, D]`` rows alone, the final layer that FGH's class-wise form reweights and the gradient
    trace reads (a weight and at most a per-class bias). ``bias`` is None, as upstream's."""

    def __init__(self, in_features: int, out_features: int, sigma: nn.Parameter) -> None:
        self._sigma = (sigma,)  # a tuple, so that nn.Module does not register it a second time
        super().__init__(in_features, out_features, bias=False)  # draws the rows: upstream's

    @property
    def sigma(self) -> nn.Parameter:
        return self._sigma[0]

    @no_grad
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Upstream's ``reset_parameters``: rows from U(-1/sqrt(D), 1/sqrt(D)), sigma 1."""
        bound = 1 / math.sqrt(self.in_features)
        fresh = torch.empty(self.weight.shape).uniform_(-bound, bound, generator=generator)
        self.weight.copy_(fresh)
        self.sigma.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = F.normalize(self.weight, dim=1).to(x.dtype)
        return self.sigma.to(x.dtype) * F.linear(F.normalize(x, dim=1), weight)


def attach_cosine_head(
    network: nn.Module, in_features: int, classes: int, attr: str = "fc"
) -> CosineHead:
    """Give ``network`` a :class:`CosineHead` as ``<attr>`` and its sigma as ``<attr>_sigma``
    (both trainable), and return the head."""
    sigma = nn.Parameter(torch.ones(1))
    setattr(network, f"{attr}_sigma", sigma)
    head = CosineHead(in_features, classes, sigma)
    setattr(network, attr, head)
    return head
