"""``dgr_online`` against upstream's own code (PILOT ``models/dgr.py``).

The port claims DGR's logit-adjusted cross-entropy (``regularized_cn``) and its per-class gradient
reweighting of the head's rows, from the row-gradient norms accumulated since the task began:
``min(G) / G_c`` on the first task (``_init_train``), old and new classes each within their
group, scaled by ``rs_old`` and ``rs_new``, on later ones (``_update_representation``).
Upstream's learner runs one batch of each on the same weights as ours, with an optimiser that
only records gradients; our adapter's step (forward, ``classification_loss``, backward,
``transform_gradients``: what the loop runs, see test_dgr.py) must give the same gradients.

Upstream's ``regularized_cn`` moves its prior to CUDA (``.cuda()``); :func:`prior_on_cpu` leaves
it on the CPU, where these tests run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import PILOT_ROOT, build_smoke_method, requires_pilot
from test_upstream_finetune import (
    BASE_ROW,
    NUM_CLASSES,
    GradientsOnly,
    NoSchedule,
    assert_same_gradients,
    images,
    one_batch,
    upstream_learner,
)
from torch import nn

from pilot_online.core.masks import training_mask
from pilot_online.engine.adapter import StepOutput

pytestmark = requires_pilot

Built = tuple[Any, nn.Module, dict[str, Any]]
OLD = 4  # classes of the first task; the second brings 4 more
UPSTREAM_KEYS = {"init_epoch": 1, "epochs": 1, "T": 2, "lambda": 0}


@pytest.fixture(scope="module")
def dgr(pilot_on_path: Path) -> Iterator[Built]:
    yield build_smoke_method("dgr_online", **BASE_ROW)


@contextmanager
def prior_on_cpu() -> Iterator[None]:
    """``Tensor.cuda()`` returns the tensor itself, so ``regularized_cn`` runs on the CPU."""
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *args, **kwargs: self):
        yield


class TeacherLogits(nn.Module):
    """Upstream's ``_old_network`` as ``_update_representation`` reads it: fixed old-class
    logits (any teacher shows the distillation term)."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.logits = torch.randn(batch, OLD, generator=torch.Generator().manual_seed(7))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.logits}


def our_step(adapter: Any, network: nn.Module, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
    """Our adapter's part of one loop step, without the optimiser: the loss under the batch
    mask, backward, DGR's reweighting. The network's gradients are what the optimiser gets."""
    adapter.train_mode(network)
    network.zero_grad(set_to_none=True)
    out = adapter.forward(network, x, train=True)
    mask = training_mask("batch", y, torch.zeros(NUM_CLASSES, dtype=torch.bool), NUM_CLASSES)
    adapter.classification_loss(network, out, y, mask).backward()
    adapter.transform_gradients(network)
    return out


def gradients(network: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in network.named_parameters() if p.grad is not None}


def upstream_dgr(built: Built, total: int) -> Any:
    """Upstream's learner on a copy of our network, its head grown to ``total`` classes with our
    rows."""
    adapter, network, config = built
    from models.dgr import Learner

    learner = upstream_learner(Learner, adapter, config, network.backbone, **UPSTREAM_KEYS)
    learner._network.update_fc(total)
    with torch.no_grad():
        learner._network.fc.weight.copy_(network.fc.weight[:total])
        learner._network.fc.bias.copy_(network.fc.bias[:total])
    return learner


def test_first_task_is_upstreams_init_train(dgr: Built) -> None:
    """One imbalanced batch of the first task: our gradients are ``_init_train``'s, whose
    reweighting is ``min(G) / G_c``."""
    adapter, network, _ = dgr
    x, y = images([0, 1, 2, 3, 0, 0, 1])
    learner = upstream_dgr(dgr, OLD)
    learner._cur_task, learner._known_classes, learner._total_classes = 0, 0, OLD
    label_distribution = np.bincount(y.numpy(), minlength=OLD)
    with prior_on_cpu():
        learner._init_train(
            one_batch(x, y),
            one_batch(x, y),
            GradientsOnly(learner._network.parameters()),
            NoSchedule(),
            label_distribution,
        )
    adapter.clear_statistics()
    our_step(adapter, network, x, y)
    assert_same_gradients(gradients(network), learner._network)
    assert adapter.weights[:OLD].min() < 0.9  # the reweighting acted


def later_task(built: Built) -> dict[str, Any]:
    """Ours: a first-task step (classes 0-3), a consolidation, then a step on a batch of all 8
    classes. Upstream: ``_update_representation`` on that batch, with 4 known classes, a
    teacher, and ``lambda`` 0 (so distillation reaches the old head rows only)."""
    adapter, network, _ = built
    first_x, first_y = images([0, 1, 2, 3], seed=2)
    x, y = images([0, 1, 2, 3, 4, 5, 6, 7, 4, 4, 5], seed=3)
    learner = upstream_dgr(built, NUM_CLASSES)
    learner._cur_task, learner._known_classes, learner._total_classes = 1, OLD, NUM_CLASSES
    learner._old_network = TeacherLogits(len(y))
    with prior_on_cpu():
        learner._update_representation(
            one_batch(x, y),
            one_batch(x, y),
            GradientsOnly(learner._network.parameters()),
            NoSchedule(),
            np.bincount(y.numpy(), minlength=NUM_CLASSES),
        )
    adapter.clear_statistics()
    our_step(adapter, network, first_x, first_y)
    adapter.consolidate(network, 1)
    out = our_step(adapter, network, x, y)
    return {
        "adapter": adapter,
        "learner": learner,
        "ours": gradients(network),
        "out": out,
        "y": y,
    }


@pytest.fixture(scope="module")
def second_task(dgr: Built) -> dict[str, Any]:
    return later_task(dgr)


def test_later_task_reweighting_is_upstreams(second_task: dict[str, Any]) -> None:
    """New classes' head rows (reweighted within their group and by ``rs_new``) and the whole
    backbone get ``_update_representation``'s gradients (``lambda`` 0)."""
    ours, learner = second_task["ours"], second_task["learner"]
    upstream = dict(learner._network.named_parameters())
    for name in ("fc.weight", "fc.bias"):
        theirs = upstream[name].grad[OLD:]
        torch.testing.assert_close(ours[name][OLD:], theirs, rtol=1e-5, atol=1e-7)
    backbone = {n: g for n, g in ours.items() if n.startswith("backbone.")}
    assert_same_gradients(backbone, learner._network, learner._network.backbone.parameters())
    weights = second_task["adapter"].weights
    assert weights[OLD:].max() < 1 and weights[:OLD].min() < 1  # both groups reweighted


def test_difference_no_distillation(second_task: dict[str, Any]) -> None:
    """Upstream adds distillation from the previous task's network: ``lambda`` times
    ``_KD_loss`` on the loss, and ``ratio_kd`` times the KD gradient on the old classes' head
    rows, ``ratio_kd = ||w * G|| / ||norms of the KD gradient rows||``. Ours has neither: the
    old rows differ from upstream's by exactly that term (here ``lambda`` is 0, so the rest of
    the network agrees: the test above)."""
    from models.dgr import _KD_loss

    adapter, learner, out = second_task["adapter"], second_task["learner"], second_task["out"]
    old_logits = out.logits[:, :OLD].detach().requires_grad_(True)
    teacher = learner._old_network(None)["logits"]
    (logit_gradient,) = torch.autograd.grad(_KD_loss(old_logits, teacher, 2), old_logits)
    features = out.features.detach()
    kd_weight, kd_bias = logit_gradient.T @ features, logit_gradient.sum(0)
    ratio_kd = (adapter.weights * adapter.grad_sums).norm() / kd_weight.norm(dim=1).norm()
    upstream = dict(learner._network.named_parameters())
    ours = second_task["ours"]
    for name, kd in (("fc.weight", kd_weight), ("fc.bias", kd_bias)):
        expected = ours[name][:OLD] + ratio_kd.to(kd.dtype) * kd
        torch.testing.assert_close(upstream[name].grad[:OLD], expected, rtol=1e-4, atol=1e-7)
        assert (upstream[name].grad[:OLD] - ours[name][:OLD]).abs().max() > 1e-6


def test_difference_running_label_prior(pilot_on_path: Path) -> None:
    """Upstream's prior is the task's whole label distribution, known before training; ours
    counts the labels trained on since the last consolidation, batch by batch. After batches
    [0, 0, 1] and [1, 2], our second loss is ``regularized_cn`` with the running counts
    [2, 2, 1], not with the task's distribution."""
    from models.dgr import regularized_cn

    from pilot_online.methods.dgr import DGROnline

    adapter = DGROnline(args={"gammar_r": 1.0})
    network = nn.Module()
    network.fc = nn.Linear(2, 3)
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
    first = StepOutput(torch.zeros(3, 3), None)
    adapter.classification_loss(network, first, torch.tensor([0, 0, 1]), None)
    ours = adapter.classification_loss(
        network, StepOutput(logits, None), torch.tensor([1, 2]), None
    )
    labels = torch.tensor([1, 2])
    with prior_on_cpu():
        running = regularized_cn(logits, labels, np.array([2.0, 2.0, 1.0]))
        task = regularized_cn(logits, labels, np.array([2.0, 3.0, 4.0]))
    assert ours.item() == pytest.approx(running.item(), rel=1e-6)
    assert abs(ours.item() - task.item()) > 1e-3


def test_difference_reservoir_memory() -> None:
    """Upstream keeps herding-selected exemplars per class, chosen at each task's end; ours
    replays from a reservoir of the stream of the same size (exps/dgr.json's memory_size)."""
    from pilot_online.methods.dgr import DGROnline

    upstream = json.loads((Path(PILOT_ROOT) / "exps" / "dgr.json").read_text())
    assert DGROnline.config_keys["er_memory_size"].default == upstream["memory_size"] == 2000
    assert DGROnline.memory_based
