"""The gradient-imbalance measure's raw input: each class's gradient norm on the classifier.

The paper's G^k (Sec. 5.1, Figs. 1-2) averages, over task k's classes, the norm of each class's
classifier row gradient, bias included, as the optimizer receives it (after FGH's reweighting).
The loop reads it here every step; ``core/metrics.py`` turns the per-class norms into G^k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import no_grad, torch

if TYPE_CHECKING:
    from torch import Tensor


@no_grad
def class_grad_norms(weight: torch.nn.Parameter, bias: torch.nn.Parameter | None = None) -> Tensor:
    """Per output row c: sqrt(sum_j weight.grad[c, j]^2 + bias.grad[c]^2).

    Reads the current ``.grad``: called after ``fgh.step()`` it measures the gradient the
    optimizer receives (alpha applied), the quantity the paper's gradient-imbalance plots use.
    """
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [C, D], got shape {tuple(weight.shape)}")
    if weight.grad is None:
        raise ValueError("weight.grad is None; call class_grad_norms after loss.backward()")
    squares = weight.grad.pow(2).sum(dim=1)
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},) to match the weight, "
                f"got {tuple(bias.shape)}"
            )
        if bias.grad is None:
            raise ValueError("bias.grad is None; pass bias=None for a layer without a bias grad")
        squares = squares + bias.grad.pow(2)
    return squares.sqrt()
