"""Every boundary mechanism acts on a 20-task stream of CUB-sized tasks, not only on CIFAR's 10.

CUB-200 and ImageNet-R run 20 tasks of 10 classes; CUB's tasks hold about 300 training images
(30 per class; ImageNet-R's about 1200). Each method's paper config (its defaults, as
``scripts/make_exps.py`` writes them) must fire its consolidation trigger at every one of the 19
task boundaries of such a stream, at batch 100 as the paper runs it, and nowhere else: a default
sized for CIFAR's 5000-image tasks (an interval of 1000 samples, a window restarted at each
firing) acts on CIFAR and silently not on CUB. What each firing does on such a stream (an adapter
added, the PET trained, rows transported) is tested in each method's own files.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_exps

from pilot_online import get_method, list_methods
from pilot_online.core.streams import clear_stream
from pilot_online.core.triggers import make_trigger
from pilot_online.engine.config import resolve_config
from pilot_online.harness.protocol import method_short_name

TRIGGERED = [n for n in list_methods() if get_method(n).consolidation.trigger != "never"]
NUM_CLASSES, PER_TASK, PER_CLASS = 200, 10, 30  # CUB-200: 20 tasks of 10 classes


def boundaries_and_firings(name: str, per_class: int) -> tuple[list[int], list[int]]:
    """(stream samples before each task but the first, trigger firings) for the method's
    paper config on a clear stream of 20 tasks with ``per_class`` images per class."""
    config = resolve_config(make_exps().paper_config(method_short_name(name), "base", False))
    labels = np.repeat(np.arange(NUM_CLASSES), per_class)
    stream = clear_stream(labels, init_cls=PER_TASK, increment=PER_TASK, batch_size=100, seed=0)
    trigger = make_trigger(config, NUM_CLASSES)
    boundaries, seen = [], 0
    for task in range(stream.num_tasks):
        if task:
            boundaries.append(seen)
        for batch in stream.batches(task):
            trigger.update(torch.as_tensor(labels[batch.indices]))
            # A loss-reading trigger sees a loss that falls within each task and jumps at its
            # start (new classes), the shape that makes a plateau once per task.
            within = seen - (boundaries[-1] if boundaries else 0)
            trigger.observe(len(batch), 4.0 * np.exp(-within / 50.0))
            seen += len(batch)
    return boundaries, list(trigger.firings)


@pytest.mark.parametrize("name", TRIGGERED)
@pytest.mark.parametrize("per_class", [PER_CLASS, 120], ids=["cub", "imagenet_r"])
def test_the_default_trigger_fires_at_each_of_the_19_boundaries(name, per_class):
    boundaries, firings = boundaries_and_firings(name, per_class)
    assert len(boundaries) == 19
    assert firings == boundaries, (
        f"{name}'s default trigger fired at {firings[:6]}... on 20 tasks of "
        f"{per_class * PER_TASK} samples; the boundaries are at {boundaries[:6]}..."
    )
