"""``memo_online`` against upstream's own code (PILOT ``models/memo.py``, ``AdaptiveNet`` in
``utils/inc_net.py``, ``backbone/vit_memo.py``).

The port claims upstream's task start and training step as DER's (tests/test_upstream_der.py,
whose helpers run here): upstream's ``after_task`` of the first task freezes the generalized
blocks, its ``incremental_train`` of the second runs ``AdaptiveNet.update_fc`` (a specialized
extractor loaded from the last, the head widened, the older extractor frozen), ``set_network``
and ``_update_representation`` (``CE + alpha_aux * CE_aux``) on one batch with an optimiser that
only records gradients, on a network in the state ours had right before the firing; our loop's
firing step on the same batch gives the same loss terms and gradients. Tiny ``Generalized_Vit`` /
``Specialized_Vit`` (32 px, width 24) stand in for ViT-B through PILOT's ``get_backbone``.
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
from conftest import requires_pilot
from test_upstream_der import (
    WIDTH,
    Port,
    assert_adam_constant_lr,
    assert_firing_step_is_upstreams,
    assert_head_over_every_class,
    assert_online_herding,
    assert_partial_task,
    assert_same_eval_forward,
    assert_same_train_modes,
    assert_seeded_growth,
    firing_equivalence,
    our_loss_terms,
    upstream_losses,
)
from test_upstream_finetune import images
from torch import nn

from pilot_online.methods.memo import trim_specialized

pytestmark = requires_pilot


def tiny_memo() -> tuple[nn.Module, nn.Module]:
    """Upstream's generalized and specialized ViTs as ``get_backbone``'s ``_memo`` branch
    returns them, tiny: 2 blocks (the generalized part keeps 1, the specialized one builds 2
    it never runs and its own ``last_block``)."""
    from backbone.vit_memo import Generalized_Vit, Specialized_Vit

    torch.manual_seed(0)
    kwargs = dict(img_size=32, patch_size=16, embed_dim=WIDTH, depth=2, num_heads=2, num_classes=0)
    base, specialized = Generalized_Vit(**kwargs), Specialized_Vit(**kwargs)
    base.out_dim = specialized.out_dim = WIDTH
    return base, specialized


@contextmanager
def memo_backbones() -> Iterator[None]:
    """Within the block, PILOT's ``get_backbone`` returns copies of the tiny pair."""
    base, specialized = tiny_memo()

    def build(*args: Any, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
        return copy.deepcopy(base), copy.deepcopy(specialized)

    with mock.patch("utils.inc_net.get_backbone", build):
        yield


@pytest.fixture(scope="module")
def memo(pilot_on_path: Path) -> Port:
    from models.memo import Learner

    return Port("memo_online", Learner, memo_backbones, Learner.set_network, "memo")


@pytest.fixture(scope="module")
def memo_firing(memo) -> dict[str, Any]:
    return firing_equivalence(memo)


def test_a_firing_step_is_upstreams_update_fc_and_update_representation(memo_firing) -> None:
    largest = assert_firing_step_is_upstreams(memo_firing)
    assert largest < 1e-5
    network = memo_firing["learner"]._network
    assert not any(p.requires_grad for p in network.TaskAgnosticExtractor.parameters())
    assert all(p.grad is None for p in network.TaskAgnosticExtractor.parameters())


def test_train_modes_are_upstreams(memo, memo_firing) -> None:
    assert_same_train_modes(memo, memo_firing)
    assert not memo_firing["grown"].TaskAgnosticExtractor.training


def test_eval_forward_is_adaptivenets(memo_firing) -> None:
    """Upstream's ``AdaptiveNet.forward`` on the grown weights gives our logits and features."""
    learner = memo_firing["learner"]
    assert_same_eval_forward(memo_firing["adapter"], memo_firing["grown"], learner._network)


# -- the declared differences (DER's, then MEMO's own) ------------------------------------------
def test_difference_one_linear_head_over_every_class(memo, memo_firing) -> None:
    assert_head_over_every_class(memo, memo_firing["adapter"])


@pytest.fixture(scope="module")
def memo_partial_task(memo, memo_firing) -> dict[str, Any]:
    """As DER's: a batch without class 7, upstream's losses for a task of 4-7 and of 4-6."""
    x, y = images([4, 5, 6, 0, 1, 2, 3, 6], seed=3)
    return {
        "task": upstream_losses(memo, memo_firing, 8, x, y),
        "batch": upstream_losses(memo, memo_firing, 7, x, y),
        "ours": our_loss_terms(memo_firing, x, y),
    }


def test_difference_batch_logit_mask(memo_partial_task) -> None:
    assert_partial_task(memo_partial_task, 0, "ce")


def test_difference_auxiliary_head_over_every_class(memo_partial_task) -> None:
    assert_partial_task(memo_partial_task, 1, "aux")


def test_difference_online_herding(memo, memo_firing) -> None:
    """MEMO's learner has its own ``_construct_exemplar`` (``models/base.py``'s herding)."""
    assert_online_herding(memo, memo_firing["adapter"])


def test_difference_adam_constant_lr(memo, memo_firing) -> None:
    assert_adam_constant_lr(memo, memo_firing)


def test_difference_seeded_growth(memo) -> None:
    assert_seeded_growth(memo)


def test_difference_unused_blocks_dropped(memo_firing) -> None:
    """Upstream's ``Specialized_Vit.forward`` reads ``last_block``, ``norm`` and the pooling
    only: its blocks, patch and position embeddings and class token are trainable yet get no
    gradient, and without its blocks it gives the same output bit for bit. Ours holds none of
    the blocks and freezes the rest; the generalized blocks' final norm is never read either."""
    base, specialized = tiny_memo()
    tokens = base(images([0, 1], seed=4)[0])
    output = specialized(tokens)
    output.sum().backward()
    unused = ("blocks.", "patch_embed.", "cls_token", "pos_embed")
    for name, p in specialized.named_parameters():
        assert p.requires_grad
        assert (p.grad is None) == name.startswith(unused), name
    assert len(specialized.blocks) == 2 and base.norm.weight.grad is None
    trimmed = trim_specialized(copy.deepcopy(specialized))
    with torch.no_grad():
        assert torch.equal(trimmed(tokens), output)
    grown = memo_firing["grown"]
    for extractor in grown.AdaptiveExtractors:
        assert len(extractor.blocks) == 0
        trainable = {n.split(".")[0] for n, p in extractor.named_parameters() if p.requires_grad}
        assert trainable <= {"last_block", "norm"}
    assert not grown.TaskAgnosticExtractor.norm.weight.requires_grad
    upstream = memo_firing["learner"]._network.AdaptiveExtractors[-1]
    assert len(upstream.blocks) == 2 and upstream.blocks[0].mlp.fc1.weight.requires_grad
