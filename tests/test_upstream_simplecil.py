"""``simplecil_online`` against upstream's own code (PILOT ``models/simplecil.py``,
``utils/inc_net.py``'s ``SimpleVitNet``, ``backbone/linears.py``'s ``CosineLinear``).

The port claims upstream's classifier: a cosine head whose rows are the class means of the frozen
ViT's features. Upstream's ``Learner.replace_fc`` runs here on the batches our loop trained on,
in a ``SimpleVitNet`` whose backbone is a copy of ours; its ``CosineLinear`` logits must be ours.
The documented difference: our means are running means, in the head after every batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_smoke_method, requires_pilot
from test_upstream_finetune import NUM_CLASSES, images, one_batch, upstream_learner
from torch import nn

from pilot_online.engine.mixins import build_loop

pytestmark = requires_pilot

Built = tuple[Any, nn.Module, dict[str, Any]]
TASK = [0, 1, 2, 3]
FIRST, SECOND = images([0, 1, 2, 3, 0], seed=1), images([1, 2, 3, 3], seed=2)


@pytest.fixture(scope="module")
def simplecil(pilot_on_path: Path) -> Iterator[Built]:
    yield build_smoke_method("simplecil_online")


def upstream_logits(built: Built, batches: list, x: torch.Tensor) -> torch.Tensor:
    """Upstream's head after ``replace_fc`` over ``batches`` (a task of classes 0-3), on ``x``."""
    adapter, network, config = built
    from models.simplecil import Learner

    learner = upstream_learner(Learner, adapter, config, network.backbone)
    learner._network.update_fc(len(TASK))
    learner.train_dataset = SimpleNamespace(labels=np.array(TASK))
    loader = [batch for x_batch, y_batch in batches for batch in one_batch(x_batch, y_batch)]
    with torch.no_grad():
        learner.replace_fc(loader, learner._network, None)
        return learner._network(x)["logits"]


def trained_loop(built: Built, batches: list) -> None:
    """Our loop over ``batches``, from no class means (the module's network is shared)."""
    adapter, network, config = built
    for buffer in network.class_means.buffers():
        buffer.zero_()
    loop = build_loop(adapter, network, config, NUM_CLASSES)
    for x, y in batches:
        loop.train_step(x, y)


def our_logits(adapter: Any, network: nn.Module, x: torch.Tensor) -> torch.Tensor:
    adapter.set_mode(network, train=False)
    with torch.no_grad():
        return adapter.forward(network, x, train=False).logits[:, : len(TASK)]


def test_head_is_upstreams_replace_fc(simplecil: Built) -> None:
    """After a task's batches, our logits are upstream's cosine head of its class means."""
    adapter, network, _ = simplecil
    test_x, _ = images([0, 1, 2, 3, 4, 5], seed=3)
    theirs = upstream_logits(simplecil, [FIRST, SECOND], test_x)
    trained_loop(simplecil, [FIRST, SECOND])
    torch.testing.assert_close(our_logits(adapter, network, test_x), theirs, rtol=1e-5, atol=1e-5)


def test_difference_running_class_means(simplecil: Built) -> None:
    """Ours: running means over the stream's training batches, in the head after each batch.
    Upstream: one pass over the finished task's data (with test transforms) at the task's end.
    After the first batch our head is upstream's ``replace_fc`` of that batch alone, not of the
    whole task."""
    adapter, network, _ = simplecil
    test_x, _ = images([0, 1, 2, 3], seed=4)
    alone = upstream_logits(simplecil, [FIRST], test_x)
    whole = upstream_logits(simplecil, [FIRST, SECOND], test_x)
    trained_loop(simplecil, [FIRST])
    ours = our_logits(adapter, network, test_x)
    torch.testing.assert_close(ours, alone, rtol=1e-5, atol=1e-5)
    assert (ours - whole).abs().max() > 1e-4
