"""``dualprompt_online`` against upstream's own code (PILOT ``models/dualprompt.py``,
``backbone/vit_dualprompt.py``, ``backbone/prompt.py``).

The port claims L2P's loss on DualPrompt's G- and E-prompted ViT: cross-entropy under the class
mask minus ``pull_constraint_coeff`` times ``reduce_sim``. Upstream's ``Learner._init_train`` runs
one batch on a copy of our network, which carries the per-sample prefix layout (the forward hook
on its ``EPrompt``); our loop's step must give the same gradients. That layout is a documented
difference: ``test_difference_per_sample_prefix_layout`` runs upstream's own layout against it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import build_smoke_method, requires_pilot
from test_upstream_finetune import BASE_ROW, images
from test_upstream_l2p import (
    Built,
    assert_batch_logit_mask,
    assert_loss_is_upstreams_init_train,
    upstream_prompt_learner,
)

from pilot_online.methods.dualprompt import DualPromptOnline

pytestmark = requires_pilot


@pytest.fixture(scope="module")
def dualprompt(pilot_on_path: Path) -> Iterator[Built]:
    yield build_smoke_method("dualprompt_online", **BASE_ROW)


def upstream_copy(built: Built, hooked: bool) -> torch.nn.Module:
    """Upstream's learner on a copy of our network; ``hooked=False``: with upstream's own
    E-prompt layout (our forward hook removed)."""
    from models.dualprompt import Learner

    learner = upstream_prompt_learner(Learner, built)
    if not hooked:
        learner._network.backbone.e_prompt._forward_hooks.clear()
    return learner._network.eval()


def test_loss_is_upstreams_init_train(dualprompt: Built) -> None:
    from models.dualprompt import Learner

    assert_loss_is_upstreams_init_train(Learner, dualprompt)


def test_difference_batch_logit_mask(dualprompt: Built) -> None:
    from models.dualprompt import Learner

    assert_batch_logit_mask(Learner, dualprompt)


def test_difference_no_batch_vote_at_evaluation(dualprompt: Built) -> None:
    """As L2P's: upstream evaluates with the vote on; ours is upstream's with it off."""
    adapter, network, _ = dualprompt
    x, _ = images([0, 1, 2, 3, 4, 5], seed=2)
    adapter.set_mode(network, train=False)
    upstream = upstream_copy(dualprompt, hooked=True)
    pool = upstream.backbone.e_prompt
    with torch.no_grad():
        ours = adapter.forward(network, x, train=False).logits
        pool.batchwise_prompt = True  # upstream's exps/dualprompt.json
        voted = upstream(x, task_id=0)["logits"]
        pool.batchwise_prompt = False
        alone = upstream(x, task_id=0)["logits"]
    torch.testing.assert_close(ours, alone, rtol=1e-5, atol=1e-5)
    assert (ours - voted).abs().max() > 1e-4


def test_difference_per_sample_prefix_layout(dualprompt: Built) -> None:
    """Upstream's ``EPrompt`` layout is right for a batch of one only (PILOT issue #29): our
    logits for a batch are upstream's for each sample alone, and upstream's for the batch are
    not."""
    adapter, network, _ = dualprompt
    x, _ = images([0, 1, 2, 3], seed=3)
    adapter.set_mode(network, train=False)
    upstream = upstream_copy(dualprompt, hooked=False)
    with torch.no_grad():
        ours = adapter.forward(network, x, train=False).logits
        alone = torch.cat([upstream(x[i : i + 1], task_id=0)["logits"] for i in range(len(x))])
        batched = upstream(x, task_id=0)["logits"]
    torch.testing.assert_close(ours, alone, rtol=1e-5, atol=1e-5)
    assert (ours - batched).abs().max() > 1e-4


def test_difference_no_task_prompt_slots(dualprompt: Built) -> None:
    """Upstream's exps/dualprompt.json trains task t on its own E-prompt slot
    (``use_prompt_mask``) and copies slot t-1 into it at each task start
    (``shared_prompt_pool``); ours selects by key matching at all times and copies nothing."""
    adapter, network, config = dualprompt
    assert not config["use_prompt_mask"] and not config["shared_prompt_pool"]
    assert DualPromptOnline.config_keys["use_prompt_mask"].forced
    assert DualPromptOnline.config_keys["shared_prompt_pool"].forced
    x, _ = images([0, 1, 2, 3], seed=4)
    adapter.set_mode(network, train=True)
    with torch.no_grad():
        query = adapter.evaluation(network).query.features(x)
        ours = network.backbone(x, task_id=-1, cls_features=query, train=True)["prompt_idx"]
        upstream = upstream_copy(dualprompt, hooked=True)
        upstream.backbone.use_prompt_mask = True  # upstream's exps/dualprompt.json
        task = int(ours[0, 0] + 1) % config["size"]  # a task whose slot key matching did not pick
        slots = upstream(x, task_id=task, train=True)["prompt_idx"]
    assert (slots == task).all() and (ours != task).all()
