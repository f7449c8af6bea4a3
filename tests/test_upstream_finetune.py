"""``finetune_online`` against upstream's own code (PILOT ``models/finetune.py``).

The port claims upstream's fine-tuning loss: cross-entropy of the whole ViT and a linear head over
the current task's classes. Upstream's ``Learner._update_representation`` runs here on one batch
with an optimiser that only records gradients, on the same weights as ours; our loop's step on the
same batch must give the same gradient on every parameter. The head is the one documented
difference: one linear layer over every class of the stream, where upstream grows it task by task.

This file also holds the helpers the other ``test_upstream_*.py`` files share: an upstream
``Learner`` built with our network's backbone options, an optimiser stand-in that keeps the
gradients upstream's training loop leaves behind, and a one-batch loader in PILOT's
``(index, inputs, targets)`` form.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import build_smoke_method, classification_term, requires_pilot
from torch import nn

from pilot_online.core.masks import training_mask
from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.mixins import build_loop

pytestmark = requires_pilot

NUM_CLASSES = 8  # smoke_config's stream: two tasks of four classes
BASE_ROW = {"online_prototypes": False, "fgh": None, "optimizer": "sgd", "init_lr": 0.01}


class GradientsOnly:
    """An optimiser stand-in for upstream's training loops: ``zero_grad`` clears, ``step`` does
    nothing, so the gradients of upstream's last batch stay on the parameters to be compared."""

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self.parameters = list(parameters)

    def zero_grad(self) -> None:
        for p in self.parameters:
            p.grad = None

    def step(self) -> None:
        pass


class NoSchedule:
    """A scheduler stand-in: one batch, one epoch, no learning-rate change to make."""

    def step(self) -> None:
        pass


def one_batch(x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """A loader of one batch in PILOT's ``(index, inputs, targets)`` form."""
    return [(torch.arange(len(y)), x, y)]


def images(labels: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random 32 px images with ``labels``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(len(labels), 3, 32, 32, generator=generator), torch.tensor(labels)


def upstream_learner(
    learner_class: type,
    adapter: Any,
    config: dict[str, Any],
    backbone: nn.Module | None = None,
    networks: dict[str, nn.Module] | None = None,
    thaw: bool = False,
    **args: Any,
) -> Any:
    """Upstream's ``Learner`` (of ``models/<name>.py``) on our config, on the CPU (``args``
    override upstream keys), built by its own ``__init__`` on our weights without a second ViT
    build: PILOT's ``get_backbone`` returns a copy of ``backbone`` (``thaw``: every parameter
    trainable), and each class named in ``networks`` (looked up in the learner's module) returns
    a copy of that network, which our adapter built with the same PILOT constructor, with every
    parameter trainable (upstream's learner then freezes what it freezes, not our adapter)."""
    from pilot_online.pilot.backbones import run_overrides

    module = sys.modules[learner_class.__module__]
    pilot_args = {**adapter.pilot_args(config), "device": [torch.device("cpu")], **args}
    with ExitStack() as patches:
        patches.enter_context(run_overrides(config))
        if backbone is not None:
            patches.enter_context(pilot_backbone(backbone, thaw))
        for name, network in (networks or {}).items():
            patches.enter_context(mock.patch.object(module, name, copies(network, thaw=True)))
        return learner_class(pilot_args)


def pilot_backbone(backbone: nn.Module, thaw: bool = False) -> Any:
    """Within the block, PILOT's ``get_backbone`` returns a copy of ``backbone``."""
    return mock.patch("utils.inc_net.get_backbone", copies(backbone, thaw))


def copies(module: nn.Module, thaw: bool = False) -> Any:
    """A factory that ignores its arguments and returns a deep copy of ``module``; ``thaw``: with
    every parameter trainable, as PILOT's constructors leave them."""

    def build(*args: Any, **kwargs: Any) -> nn.Module:
        built = copy.deepcopy(module)
        return built.requires_grad_(True) if thaw else built

    return build


def our_gradients(loop: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """One step of our loop; the gradients it applied (what the optimiser received), by name."""
    loop.train_step(x, y)
    return {n: p.grad.clone() for n, p in loop.network.named_parameters() if p.grad is not None}


def assert_same_gradients(
    ours: dict[str, torch.Tensor],
    theirs: nn.Module,
    trained: Iterable[nn.Parameter] | None = None,
    rtol: float = 1e-5,
) -> float:
    """Every parameter upstream trains (``trained``: what its optimiser gets; default: every
    parameter with a gradient) has our gradient, to ``rtol`` of its largest entry, and we train no
    other (classifier rows past upstream's head, absent there, are left out); returns the largest
    relative difference measured."""
    kept = None if trained is None else {id(p) for p in trained}
    upstream = {
        n: p.grad
        for n, p in theirs.named_parameters()
        if p.grad is not None and (kept is None or id(p) in kept)
    }
    assert set(upstream) == set(ours), set(upstream) ^ set(ours)
    largest = 0.0
    for name, grad in upstream.items():
        scale = grad.abs().max().clamp_min(1e-12)
        difference = ((ours[name][: grad.shape[0]] - grad).abs().max() / scale).item()
        assert difference <= rtol, f"{name}: relative difference {difference:.3g}"
        largest = max(largest, difference)
    return largest


@pytest.fixture(scope="module")
def finetune(pilot_on_path: Path) -> Iterator[tuple[Any, nn.Module, dict[str, Any], type]]:
    from models.finetune import Learner

    yield (*build_smoke_method("finetune_online", **BASE_ROW), Learner)


def test_loss_is_upstreams_update_representation(finetune) -> None:
    """Upstream's later task (``_update_representation``: CE over ``logits[:, known:]``) on a
    batch holding every class of the task gives our batch-masked CE's gradient everywhere."""
    adapter, network, config, learner_class = finetune
    learner = upstream_learner(learner_class, adapter, config, network.backbone, epochs=1)
    learner._network.update_fc(NUM_CLASSES)
    learner._network.load_state_dict(network.state_dict())
    learner._known_classes, learner._total_classes, learner._cur_task = 4, NUM_CLASSES, 1
    x, y = images([4, 5, 6, 7, 5, 4])
    learner._update_representation(
        one_batch(x, y), one_batch(x, y), GradientsOnly(learner._network.parameters()), NoSchedule()
    )
    loop = build_loop(adapter, network, config, NUM_CLASSES)
    assert_same_gradients(our_gradients(loop, x, y), learner._network)


def test_difference_batch_logit_mask(finetune) -> None:
    """A batch of classes 4 and 5 in a task of 4-7: our masked CE's head gradient is upstream's
    for a task of exactly the batch's classes (a head of 6), not for the task's four."""
    adapter, network, config, learner_class = finetune
    x, y = images([4, 5, 5])
    head_gradients = []
    for total in (6, NUM_CLASSES):
        learner = upstream_learner(learner_class, adapter, config, network.backbone, epochs=1)
        learner._network.update_fc(total)
        with torch.no_grad():
            learner._network.fc.weight.copy_(network.fc.weight[:total])
            learner._network.fc.bias.copy_(network.fc.bias[:total])
        learner._network.backbone.requires_grad_(False)  # the head's gradient is enough here
        learner._known_classes, learner._total_classes, learner._cur_task = 4, total, 1
        loader = one_batch(x, y)
        optimiser = GradientsOnly(learner._network.parameters())
        learner._update_representation(loader, loader, optimiser, NoSchedule())
        head_gradients.append(learner._network.fc.weight.grad)
    adapter.set_mode(network, train=True)
    with torch.no_grad():
        features = network.backbone(x)
    out = StepOutput(network.fc(features), features)
    mask = training_mask(
        config["logit_mask"], y, torch.zeros(NUM_CLASSES, dtype=torch.bool), NUM_CLASSES
    )
    loss = classification_term(adapter, network, out, y, mask)
    (ours,) = torch.autograd.grad(loss, network.fc.weight)
    torch.testing.assert_close(ours[:6], head_gradients[0], rtol=1e-5, atol=1e-8)
    assert (ours - head_gradients[1]).abs().max() > 1e-3 * head_gradients[1].abs().max()


def test_difference_one_linear_head_over_every_class(finetune) -> None:
    """Ours: one ``nn.Linear`` over all the stream's classes from the start. Upstream's
    ``update_fc`` makes a head of the task's total at each task, keeping the old rows."""
    adapter, network, config, learner_class = finetune
    head = adapter.classifier(network)
    assert type(head) is nn.Linear and head.out_features == NUM_CLASSES
    learner = upstream_learner(learner_class, adapter, config, network.backbone)
    learner._network.update_fc(4)
    old = learner._network.fc.weight.detach().clone()
    learner._network.update_fc(NUM_CLASSES)
    assert learner._network.fc.out_features == NUM_CLASSES
    assert torch.equal(learner._network.fc.weight[:4], old)
