"""``coda_online`` against upstream's own code (PILOT ``models/coda_prompt.py``,
``backbone/vit_coda_promtpt.py``, ``backbone/prompt.py``).

The port claims upstream's loss: cross-entropy of the CODA-prompted ViT under the class mask plus
the orthogonality penalty ``mu * sum ||t t^T - I||^2`` over each prompted layer's keys,
attention vectors and prompts. Upstream's ``Learner._init_train`` runs one batch here on a copy
of our network (with ``mu`` = 0.1, so the penalty counts), with an optimiser that only records
gradients; our loop's step must give the same gradients on the prompt and the head, which is
what upstream's ``get_optimizer`` trains.

Upstream's ``train=True`` pass adds to a leaf tensor in place, which fails on the CPU (the leaf
stays a leaf there; on CUDA ``.to(device)`` makes a copy). :func:`cuda_like_prompt_loss` makes the
CPU do what CUDA does, so upstream's own ``_init_train`` runs here; the failure itself is the
documented reason the port computes the penalty in the adapter (``penalty_in_adapter``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import build_smoke_method, requires_pilot
from test_upstream_finetune import BASE_ROW, images
from test_upstream_l2p import (
    Built,
    assert_batch_logit_mask,
    assert_loss_is_upstreams_init_train,
    init_train_gradients,
)
from torch import nn

pytestmark = requires_pilot

PROMPT_PARAM = [100, 8, 0.1]  # components, length, mu (> 0: the penalty counts)


@pytest.fixture(scope="module")
def coda(pilot_on_path: Path) -> Iterator[Built]:
    yield build_smoke_method("coda_online", prompt_param=PROMPT_PARAM, **BASE_ROW)


@contextmanager
def cuda_like_prompt_loss() -> Iterator[None]:
    """``torch.zeros(..., requires_grad=True)`` returns a non-leaf copy, as the ``.to(device)``
    after it does on CUDA, so that upstream's in-place ``prompt_loss += loss`` runs on the CPU."""
    zeros = torch.zeros

    def non_leaf_zeros(*args: Any, requires_grad: bool = False, **kwargs: Any) -> torch.Tensor:
        made = zeros(*args, requires_grad=requires_grad, **kwargs)
        return made.clone() if requires_grad else made

    with mock.patch.object(torch, "zeros", non_leaf_zeros):
        yield


def test_loss_is_upstreams_init_train(coda: Built) -> None:
    from models.coda_prompt import Learner

    with cuda_like_prompt_loss():
        assert_loss_is_upstreams_init_train(Learner, coda)


def perturbed_components(built: Built, scale: float = 0.05) -> Built:
    """A copy of ``built`` whose keys, attention vectors and prompts are moved off orthonormal.

    Upstream initialises each component set by Gram-Schmidt, where the penalty's gradient is
    about 1e-12 against the cross-entropy's 1e-3: a penalty that never reached the gradient would
    pass. Moved off, it is hundreds of times the comparison's tolerance."""
    adapter, network, config = built
    moved = copy.deepcopy(network)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in moved.prompt.e_layers:
            for kind in ("k", "a", "p"):
                component: nn.Parameter = getattr(moved.prompt, f"e_{kind}_{layer}")
                component.add_(scale * torch.randn(component.shape, generator=generator))
    return adapter, moved, config


def test_loss_is_upstreams_init_train_off_orthonormal(coda: Built) -> None:
    """Upstream's ``_init_train`` on components moved off orthonormal: the penalty's gradient is
    now far above the comparison's tolerance, and ours must still be upstream's."""
    from models.coda_prompt import Learner

    from pilot_online.methods.coda_prompt import orthogonality_penalty

    moved = perturbed_components(coda)
    key = moved[1].prompt.e_k_0
    (penalty_gradient,) = torch.autograd.grad(PROMPT_PARAM[2] * orthogonality_penalty(key), key)
    with cuda_like_prompt_loss():
        learner, _ = init_train_gradients(Learner, moved, *images([0, 1, 2, 3]), 4)
    upstream_key_gradient = dict(learner._network.named_parameters())["prompt.e_k_0"].grad
    # The comparison's tolerance is 1e-5 of the largest entry: the penalty's share (about 6e-3
    # here) must stand far above it.
    assert penalty_gradient.abs().max() > 1e-3 * upstream_key_gradient.abs().max()
    with cuda_like_prompt_loss():
        assert_loss_is_upstreams_init_train(Learner, moved)


def test_difference_batch_logit_mask(coda: Built) -> None:
    from models.coda_prompt import Learner

    with cuda_like_prompt_loss():
        assert_batch_logit_mask(Learner, coda)


def test_difference_penalty_in_adapter(coda: Built) -> None:
    """Upstream's training pass fails on the CPU; ours runs the prompted pass with
    ``train=False`` and adds upstream's penalty itself: the same value as the sum of the losses
    upstream's ``CodaPrompt.forward(train=True)`` returns layer by layer."""
    from models.coda_prompt import Learner

    adapter, network, _ = coda
    x, y = images([0, 1])
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        init_train_gradients(Learner, coda, x, y, task_classes=2)
    adapter.set_mode(network, train=True)
    with torch.no_grad():
        query_pass = adapter.evaluation(network).query
        query = query_pass.features(x)
        ours = query_pass.forward(x, query, True).aux_loss
        tokens = torch.zeros(len(x), 3, 768)
        prompt = network.prompt
        upstream = sum(prompt.forward(query, layer, tokens, train=True)[1] for layer in range(12))
    assert ours.item() == pytest.approx(upstream.item(), rel=1e-6)
    assert ours.item() > 0


def test_difference_one_task_all_components(coda: Built) -> None:
    """Ours is built for one task: every component trains at all times. Upstream's CodaPrompt
    for ``nb_tasks`` tasks trains task 0 on the first ``100 / nb_tasks`` components only."""
    from backbone.prompt import CodaPrompt

    network = coda[1]
    query = torch.randn(2, 768, generator=torch.Generator().manual_seed(5))
    tokens = torch.zeros(2, 3, 768)
    torch.manual_seed(0)
    two_tasks = CodaPrompt(768, 2, PROMPT_PARAM)
    for prompt, train, used in ((network.prompt, False, 100), (two_tasks, True, 50)):
        prompt.zero_grad(set_to_none=True)
        key_prefix, value_prefix = prompt.forward(query, 0, tokens, train=train)[0]
        (key_prefix.sum() + value_prefix.sum()).backward()
        rows = prompt.e_p_0.grad.flatten(1).abs().sum(1)
        assert (rows[:used] > 0).all() and (rows[used:] == 0).all()
    network.prompt.zero_grad(set_to_none=True)
