"""``aper_finetune_online`` against upstream's own code (PILOT ``models/aper_finetune.py``,
``utils/inc_net.py``'s ``SimpleVitNet`` and ``MultiBranchCosineIncrementalNet``).

The port claims APER's network and prototypes: the frozen pre-trained ViT and the adapted ViT,
features concatenated (``construct_dual_branch_network``), and each class's mean feature, which
upstream writes into its cosine head (``replace_fc``) and P keeps as its prototype. Upstream's
learner is built here around a copy of our adapted branch, joins it to a copy of our pre-trained
branch with its own ``construct_dual_branch_network`` and runs ``replace_fc`` on a batch; our
loop's prototypes after a step on the same batch must be its head's rows. What trains must be
what upstream's first task tunes (its freezing code, run on a fully trainable copy).

The helpers here serve the APER family's files (``test_upstream_aper_{ssf,vpt,adapter}.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import build_smoke_method, requires_pilot
from test_upstream_finetune import (
    BASE_ROW,
    NUM_CLASSES,
    images,
    one_batch,
    pilot_backbone,
    upstream_learner,
)
from torch import nn

from pilot_online.engine.adapter import MethodAdapter
from pilot_online.engine.mixins import build_loop

pytestmark = requires_pilot

TASK = [0, 1, 2, 3]
UPSTREAM_KEYS = {"tuned_epoch": 1, "min_lr": None}


def compare_with_upstream(
    method: str, learner_class: type, tuned_rule: bool = True
) -> dict[str, Any]:
    """Our method and upstream's ``Learner`` (``learner_class``) on the same weights and batch: P's
    prototypes and upstream's ``replace_fc`` rows, both heads' logits, what trains on each side
    (``tuned_rule``: upstream's freezing can run without pre-trained weights), and whether
    upstream's second task still tunes."""
    adapter, network, config = build_smoke_method(method, **{**BASE_ROW, "online_prototypes": True})
    adapted, pretrained = network.backbones[1], network.backbones[0]
    x, y = images([0, 1, 2, 3, 1, 2])
    found: dict[str, Any] = {"adapter": adapter, "network": network}

    learner = upstream_learner(learner_class, adapter, config, adapted, thaw=True, **UPSTREAM_KEYS)
    if tuned_rule:
        if learner_class.__module__ == "models.aper_vpt":
            learner._network.backbone.Freeze()  # what build_promptmodel calls
        found["upstream_tuned"] = tuned_names(run_first_task_freezing(learner))
    with pilot_backbone(pretrained):
        learner.construct_dual_branch_network()  # [pre-trained copy, upstream's adapted branch]
    learner._network.update_fc(len(TASK))
    learner.train_dataset = SimpleNamespace(labels=np.array(TASK))
    with torch.no_grad():
        learner.replace_fc(one_batch(x, y), learner._network, None)
        found["upstream_rows"] = learner._network.fc.weight[: len(TASK)].clone()
        upstream = learner._network(x)
        found["upstream_logits"] = upstream["logits"]
        # Our head on the same features (the prototypes' test shows they are ours).
        found["our_logits"] = adapter.classifier(network)(upstream["features"])[:, : len(TASK)]
    found["later_task_tunes"] = later_task_tunes(learner)

    found["our_tuned"] = tuned_names(adapted)
    loop = build_loop(adapter, network, config, NUM_CLASSES)
    loop.train_step(x, y)
    found["our_prototypes"] = loop.prototypes.means[: len(TASK)].clone()
    found["adapted_gradients"] = [p.grad for p in adapted.parameters() if p.requires_grad]
    return found


def run_first_task_freezing(learner: Any) -> nn.Module:
    """Upstream's first-task ``_train`` up to its training loop (which, with the dual-branch
    construction and ``replace_fc``, is skipped): the network it would tune."""
    learner._cur_task = 0
    with (
        mock.patch.object(learner, "_init_train"),
        mock.patch.object(learner, "construct_dual_branch_network"),
        mock.patch.object(learner, "replace_fc"),
    ):
        learner._train(None, None, None)
    return learner._network.backbone


def later_task_tunes(learner: Any) -> bool:
    """Whether upstream's ``_train`` for its second task runs a training loop."""
    learner._cur_task = 1
    with (
        mock.patch.object(learner, "_init_train") as init_train,
        mock.patch.object(learner, "replace_fc"),
    ):
        learner._train(None, None, None)
    return init_train.called


def tuned_names(module: nn.Module) -> set[str]:
    return {name for name, p in module.named_parameters() if p.requires_grad}


def assert_prototypes_are_upstreams_replace_fc(found: dict[str, Any]) -> None:
    torch.testing.assert_close(
        found["our_prototypes"], found["upstream_rows"], rtol=1e-5, atol=1e-5
    )


def assert_tuned_parameters_are_upstreams(found: dict[str, Any]) -> None:
    assert found["our_tuned"] == found["upstream_tuned"]
    assert found["our_tuned"]


def assert_linear_head(found: dict[str, Any]) -> None:
    """Ours predicts with a trained linear head over the concatenated features; upstream with
    the cosine of its class-mean rows: the logits differ."""
    head = found["adapter"].classifier(found["network"])
    assert type(head) is nn.Linear and head.weight.requires_grad
    assert head.in_features == 2 * 768
    assert (found["our_logits"] - found["upstream_logits"]).abs().max() > 1e-3


def assert_no_first_session_phase(found: dict[str, Any]) -> None:
    """Upstream tunes on its first task only (``_train`` of task 1 runs no training loop); ours
    tunes at every step and never consolidates. (Every tuned parameter gets a gradient; some
    are 0 at the first step: the adapters' up-projections start at zero.)"""
    assert not found["later_task_tunes"]
    assert type(found["adapter"]).consolidate is MethodAdapter.consolidate
    assert found["adapter"].consolidation.trigger == "never"
    gradients = found["adapted_gradients"]
    assert gradients and all(g is not None for g in gradients)
    assert any(g.abs().sum() > 0 for g in gradients)


@pytest.fixture(scope="module")
def aper(pilot_on_path: Path) -> Iterator[dict[str, Any]]:
    from models.aper_finetune import Learner

    yield compare_with_upstream("aper_finetune_online", Learner)


def test_prototypes_are_upstreams_replace_fc(aper: dict[str, Any]) -> None:
    assert_prototypes_are_upstreams_replace_fc(aper)


def test_tuned_parameters_are_upstreams(aper: dict[str, Any]) -> None:
    assert_tuned_parameters_are_upstreams(aper)


def test_difference_linear_head(aper: dict[str, Any]) -> None:
    assert_linear_head(aper)


def test_difference_no_first_session_phase(aper: dict[str, Any]) -> None:
    assert_no_first_session_phase(aper)
