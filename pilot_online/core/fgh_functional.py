"""FGH's step, as functions over lists of tensors (after ``torch/optim/adam.py``'s
``_single_tensor_adam`` and ``_multi_tensor_adam``): :func:`single_tensor_step` is the readable
specification, one parameter at a time; :func:`foreach_step` is the ``torch._foreach_*`` fast
path, tested to give bit-identical results (``tests/test_fgh.py``). The component,
:class:`~pilot_online.core.fgh.FineGrainedHypergradients`, gathers the lists and keeps the state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .lazy import torch

if TYPE_CHECKING:
    from torch import Tensor


def _finite_or_zero_(hypergrad: Tensor, num_skipped: Tensor) -> Tensor:
    """Zero non-finite hypergradient entries in place and count them on the device (no sync).

    ``count_nonzero`` + ``nan_to_num_`` rather than a bool mask, ``sum`` and ``masked_fill_``:
    the same result in fewer passes over the tensor (bench_fgh.py measured the mask on CPU).
    """
    finite = torch.isfinite(hypergrad).count_nonzero()
    count = hypergrad.numel() - finite
    num_skipped.add_(count if count.device == num_skipped.device else count.to(num_skipped.device))
    return hypergrad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _sum_into_blocks(
    products: list[Tensor],
    alpha_views: list[Tensor],
    block_of: list[int],
    block_alphas: list[Tensor],
) -> dict[int, Tensor]:
    """Reduce each product c_t * partner to its alpha's shape and add up products sharing a block.

    element: identity; global: sum of all entries; class: weight rows summed, bias as is.
    Returns block index -> hypergradient shaped like ``block_alphas[index]``.
    """
    hypergrads: dict[int, Tensor] = {}
    for product, view, block in zip(products, alpha_views, block_of):
        contribution = product.sum_to_size(view.shape).view(block_alphas[block].shape)
        hypergrads[block] = (
            contribution if block not in hypergrads else hypergrads[block] + contribution
        )
    return hypergrads


def _upper(hi: float | None, alpha: Tensor) -> float:
    """The clamp's upper bound for ``alpha``. Without one, the square root of the dtype's largest
    value (1.8e19 in float32 and bfloat16): a safety net far above any coefficient measured
    (docs/fgh.md), at which ``alpha * g`` stays finite for every gradient below 1.8e19 and Adam's
    second moment at worst overflows to inf, which makes the step 0, never NaN."""
    return math.sqrt(torch.finfo(alpha.dtype).max) if hi is None else hi


def single_tensor_step(
    grads: list[Tensor],
    partners: list[Tensor | None],
    alpha_views: list[Tensor],
    block_of: list[int],
    block_alphas: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[int],
    *,
    direction: str,
    gamma: float,
    clamp: tuple[float, float | None],
    betas: tuple[float, float],
    eps: float,
    num_skipped: Tensor,
) -> list[Tensor]:
    """Reference FGH step (the specification), one parameter at a time.

    ``partners[i]`` is the previous signal c_{t-1}; None on a parameter's first step, whose alpha
    is then left alone. ``alpha_views[i]`` is a view of ``block_alphas[block_of[i]]`` that
    broadcasts against parameter i. For direction="adam", ``steps[i]`` counts the moment updates
    including this one; it is only read for paired parameters. Returns the signals c_t to pair
    with next step.
    """
    lo, hi = clamp
    beta1, beta2 = betas
    # 1. The signal c_t: the raw gradient, or Adam's normalised direction of the raw gradient.
    #    As in the appendix algorithm, the moments start with the first pairing: a parameter's
    #    first step keeps its raw g_1 (to pair with at step 2) and leaves m, v untouched.
    signals = []
    for i, grad in enumerate(grads):
        if direction == "adam" and partners[i] is not None:
            exp_avgs[i].mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sqs[i].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = exp_avgs[i] / (1 - beta1 ** steps[i])
            v_hat = exp_avg_sqs[i] / (1 - beta2 ** steps[i])
            signals.append(m_hat / (v_hat.sqrt() + eps))
        else:
            signals.append(grad)
    # 2. Hypergradient h = c_t * partner, reduced to each block's alpha (Eq. 8's product).
    paired = [i for i, partner in enumerate(partners) if partner is not None]
    products = [signals[i] * partners[i] for i in paired]
    hypergrads = _sum_into_blocks(
        products, [alpha_views[i] for i in paired], [block_of[i] for i in paired], block_alphas
    )
    # 3. alpha <- clamp(alpha + gamma * h), with non-finite entries of h skipped.
    for block, hypergrad in hypergrads.items():
        hypergrad = _finite_or_zero_(hypergrad, num_skipped)
        alpha = block_alphas[block]
        alpha.add_(hypergrad, alpha=gamma).clamp_(lo, _upper(hi, alpha))
    # 4. Keep c_t for the next step (the RAW g_t on a first step or for direction="grad",
    #    saved before the scaling below).
    new_signals = [
        signal.clone() if partner is None else partner.copy_(signal)
        for signal, partner in zip(signals, partners)
    ]
    # 5. The optimizer receives alpha * g_t.
    for grad, view in zip(grads, alpha_views):
        grad.mul_(view)
    return new_signals


def _copy_all_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """``torch._foreach_copy_`` where this torch has it, else one ``copy_`` per tensor (the
    same values): the stated torch floor (setup.py) predates some foreach kernels."""
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is None:
        for target, source in zip(targets, sources):
            target.copy_(source)
    else:
        foreach_copy(targets, sources)


def foreach_step(
    grads: list[Tensor],
    partners: list[Tensor | None],
    alpha_views: list[Tensor],
    block_of: list[int],
    block_alphas: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[int],
    *,
    direction: str,
    gamma: float,
    clamp: tuple[float, float | None],
    betas: tuple[float, float],
    eps: float,
    num_skipped: Tensor,
) -> list[Tensor]:
    """Same arithmetic as :func:`single_tensor_step`, in ``torch._foreach_*`` kernels."""
    lo, hi = clamp
    beta1, beta2 = betas
    paired = [i for i, partner in enumerate(partners) if partner is not None]
    signals = list(grads)
    if direction == "adam" and paired:
        moments = [exp_avgs[i] for i in paired]
        squares = [exp_avg_sqs[i] for i in paired]
        paired_grads = [grads[i] for i in paired]
        torch._foreach_mul_(moments, beta1)
        torch._foreach_add_(moments, paired_grads, alpha=1 - beta1)
        torch._foreach_mul_(squares, beta2)
        torch._foreach_addcmul_(squares, paired_grads, paired_grads, value=1 - beta2)
        directions = torch._foreach_div(moments, [1 - beta1 ** steps[i] for i in paired])
        denoms = torch._foreach_div(squares, [1 - beta2 ** steps[i] for i in paired])
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, eps)
        torch._foreach_div_(directions, denoms)
        for i, direction_i in zip(paired, directions):
            signals[i] = direction_i

    if paired:
        products = torch._foreach_mul([signals[i] for i in paired], [partners[i] for i in paired])
        hypergrads = _sum_into_blocks(
            products,
            [alpha_views[i] for i in paired],
            [block_of[i] for i in paired],
            block_alphas,
        )
        blocks = list(hypergrads)
        # isfinite has no foreach kernel: one small loop over the (few) hypergradient tensors.
        finite = [_finite_or_zero_(hypergrads[block], num_skipped) for block in blocks]
        alphas = [block_alphas[block] for block in blocks]
        torch._foreach_add_(alphas, finite, alpha=gamma)
        torch._foreach_clamp_min_(alphas, lo)
        torch._foreach_clamp_max_(alphas, [_upper(hi, alpha) for alpha in alphas])
    if paired:
        _copy_all_([partners[i] for i in paired], [signals[i] for i in paired])
    new_signals = [
        signal.clone() if partner is None else partner for signal, partner in zip(signals, partners)
    ]
    torch._foreach_mul_(grads, alpha_views)
    return new_signals
