"""``l2p_online`` against upstream's own code (PILOT ``models/l2p.py``, ``backbone/vit_l2p.py``).

The port claims upstream's training loss: cross-entropy of the prompted ViT's logits under the
class mask, minus ``pull_constraint_coeff`` times the key-query similarity ``reduce_sim``, with
the batch's prompt vote, on the parameters upstream's learner leaves trainable. Upstream's
``Learner._init_train`` runs one batch here with an optimiser that only records gradients, on a
copy of our network; our loop's step on the same batch must give the same gradient on every
parameter upstream's ``get_optimizer`` trains. The documented differences (the adapter's
``upstream_differences``) are asserted by the ``test_difference_*`` tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import build_smoke_method, requires_pilot
from test_upstream_finetune import (
    BASE_ROW,
    NUM_CLASSES,
    GradientsOnly,
    assert_same_gradients,
    images,
    one_batch,
    our_gradients,
    upstream_learner,
)
from torch import nn

from pilot_online.engine.mixins import build_loop

pytestmark = requires_pilot

#: Upstream keys its learner reads that our configs do not set (one epoch, no scheduler).
UPSTREAM_KEYS = {
    "tuned_epoch": 1,
    "scheduler": "constant",
    "reinit_optimizer": False,
    "min_lr": None,
}
Built = tuple[Any, nn.Module, dict[str, Any]]


@pytest.fixture(scope="module")
def l2p(pilot_on_path: Path) -> Iterator[Built]:
    yield build_smoke_method("l2p_online", **BASE_ROW)


#: Per upstream module: the network class its ``Learner`` builds and the name of its head weight.
NETWORKS = {
    "models.l2p": ("PromptVitNet", "backbone.head.weight"),
    "models.dualprompt": ("PromptVitNet", "backbone.head.weight"),
    "models.coda_prompt": ("CodaPromptVitNet", "fc.weight"),
}


def upstream_prompt_learner(learner_class: type, built: Built) -> Any:
    """Upstream's learner of a prompt method (``learner_class``) on a copy of our network."""
    adapter, network, config = built
    network_class = NETWORKS[learner_class.__module__][0]
    return upstream_learner(
        learner_class, adapter, config, networks={network_class: network}, **UPSTREAM_KEYS
    )


def init_train_gradients(
    learner_class: type, built: Built, x: torch.Tensor, y: torch.Tensor, task_classes: int
) -> tuple[Any, list[nn.Parameter]]:
    """Upstream's first task (``_init_train``, ``task_classes`` classes) on one batch, on a copy
    of our network: the learner, whose parameters hold upstream's gradients, and the parameters
    its ``get_optimizer`` trains."""
    learner = upstream_prompt_learner(learner_class, built)
    learner._cur_task, learner._known_classes, learner._total_classes = 0, 0, task_classes
    if hasattr(learner, "data_weighting"):  # CODA's per-class loss weights (all 1)
        learner.data_weighting()
    trained = [p for group in learner.get_optimizer().param_groups for p in group["params"]]
    learner._init_train(one_batch(x, y), one_batch(x, y), GradientsOnly(trained), None)
    return learner, trained


def assert_loss_is_upstreams_init_train(learner_class: type, built: Built) -> float:
    """Our step's gradients are those of upstream's ``_init_train`` on a batch holding every class
    of the task (where the task's mask and the batch's agree); the largest difference."""
    adapter, network, config = built
    x, y = images([0, 1, 2, 3])
    learner, trained = init_train_gradients(learner_class, built, x, y, task_classes=4)
    ours = our_gradients(build_loop(adapter, network, config, NUM_CLASSES), x, y)
    return assert_same_gradients(ours, learner._network, trained)


def assert_batch_logit_mask(learner_class: type, built: Built) -> None:
    """A batch of classes 0 and 1 (a vote over three samples) from a task of 0-3: our gradients
    are upstream's for a task of exactly the batch's classes, and differ from upstream's for the
    task's four."""
    adapter, network, config = built
    x, y = images([0, 1, 1])
    batch_task, trained = init_train_gradients(learner_class, built, x, y, task_classes=2)
    whole_task, _ = init_train_gradients(learner_class, built, x, y, task_classes=4)
    ours = our_gradients(build_loop(adapter, network, config, NUM_CLASSES), x, y)
    assert_same_gradients(ours, batch_task._network, trained)
    head_name = NETWORKS[learner_class.__module__][1]
    head = dict(whole_task._network.named_parameters())[head_name].grad
    assert (ours[head_name][:2] - head[:2]).abs().max() > 1e-3 * head.abs().max()


def test_loss_is_upstreams_init_train(l2p: Built) -> None:
    from models.l2p import Learner

    assert_loss_is_upstreams_init_train(Learner, l2p)


def test_difference_batch_logit_mask(l2p: Built) -> None:
    from models.l2p import Learner

    assert_batch_logit_mask(Learner, l2p)


def test_difference_no_batch_vote_at_evaluation(l2p: Built) -> None:
    """Upstream evaluates with the training vote (``batchwise_prompt`` stays on); ours selects
    each sample's prompts alone: our logits are upstream's network's with the vote off."""
    adapter, network, config = l2p
    x, _ = images([0, 1, 2, 3, 4, 5], seed=2)
    adapter.set_mode(network, train=False)
    with torch.no_grad():
        ours = adapter.forward(network, x, train=False).logits
        from models.l2p import Learner

        upstream = upstream_prompt_learner(Learner, l2p)
        upstream._network.eval()
        prompt = upstream._network.backbone.prompt
        prompt.batchwise_prompt = config["batchwise_prompt"]  # as upstream builds it: on
        voted = upstream._network(x, task_id=0)["logits"]
        prompt.batchwise_prompt = False
        alone = upstream._network(x, task_id=0)["logits"]
    torch.testing.assert_close(ours, alone, rtol=1e-5, atol=1e-5)
    assert (ours - voted).abs().max() > 1e-4
