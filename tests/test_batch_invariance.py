"""Evaluation does not depend on how test images are batched (issue 6; PILOT issue #29).

The per-method checks (every registered method: predictions and logits at ``eval_batch_size`` 1,
7 and 256 and on a permuted order, through the engine's evaluation path; per-sample training-mode
logits) are part of the method contract, tests/test_contract.py, which uses :func:`evaluate` from
here. This file keeps DualPrompt's prefix layout: checked against gathers written out here from
``prompt_idx`` and the prompt pool, and upstream's own layout fails the same test.

Networks are PILOT's (from the patched copy), built through each adapter from its smoke config at
32 px with random weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_network, requires_pilot, smoke_config

from pilot_online import get_method
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.session import ArrayDataSource

pytestmark = requires_pilot

NUM_CLASSES = 8
NUM_TEST_IMAGES = 9  # eval_batch_size 7 leaves a batch of 2
BATCH_SIZES = (1, 7, 256)
TOPK = 3


Built = tuple[Any, torch.nn.Module, dict[str, Any]]


@pytest.fixture(scope="module")
def networks(pilot_on_path: Path) -> Iterator[dict[str, Built]]:
    """Each method's (adapter, network, config), built once for the module (ViT-B builds are
    slow), with the patched PILOT copy importable."""
    built: dict[str, Built] = {}
    yield built
    built.clear()


def checked_smoke_config(method: str) -> dict[str, Any]:
    config = smoke_config(method, num_classes=NUM_CLASSES)
    assert config["backbone_kwargs"] == {"img_size": 32} and config["pretrained"] is False
    return config


def built_method(networks: dict[str, Built], name: str) -> Built:
    if name not in networks:
        config = checked_smoke_config(name)
        adapter = get_method(name)(args=config)
        networks[name] = (adapter, build_network(adapter, config), config)
    return networks[name]


@pytest.fixture
def dualprompt(networks) -> Built:
    return built_method(networks, "dualprompt_online")


@pytest.fixture(scope="module")
def test_images() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(NUM_TEST_IMAGES, 32, 32, 3), dtype=np.uint8)


def evaluate(adapter, network, config, images, batch_size: int, order: np.ndarray):
    """Top-k predictions and logits, in ``order``, through the loop's real evaluation path."""
    labels = np.arange(len(images)) % NUM_CLASSES
    data = ArrayDataSource(images[:1], labels[:1], images, labels, eval_batch_size=batch_size)
    loop = build_loop(adapter, network, config, NUM_CLASSES)
    logits: list[torch.Tensor] = []
    forward = adapter.forward

    def recording_forward(net, x, train):
        out = forward(net, x, train)
        logits.append(out.logits)
        return out

    adapter.forward = recording_forward  # the instance attribute shadows the method
    try:
        allowed = torch.ones(NUM_CLASSES, dtype=torch.bool)
        predictions, _ = loop.predict(data.eval_batches(order), allowed, TOPK)
    finally:
        del adapter.forward
    assert [len(chunk) for chunk in logits] == [
        min(batch_size, len(order) - start) for start in range(0, len(order), batch_size)
    ]
    return predictions, torch.cat(logits)


# -- DualPrompt: the prefix layout itself ----------------------------------------------------------
def prompt_inputs(e_prompt, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = e_prompt.prompt_key.shape[1]
    return torch.randn(batch, 5, width, generator=generator), torch.randn(
        batch, width, generator=generator
    )


def prefixes_of(e_prompt, indices: torch.Tensor, key_value: int) -> torch.Tensor:
    """``[L, top_k * length, H, D]``: the key (0) or value (1) prefixes of one sample's indices."""
    pool = e_prompt.prompt[:, key_value]  # [L, pool, length, H, D]
    return torch.cat([pool[:, int(i)] for i in indices], dim=1)


def test_each_sample_gets_the_prefixes_it_selected(dualprompt):
    _, network, _ = dualprompt
    e_prompt = network.backbone.e_prompt
    e_prompt.batchwise_prompt = False
    x_embed, query = prompt_inputs(e_prompt, batch=6, seed=3)
    with torch.no_grad():
        ours = e_prompt(x_embed, cls_features=query)
        upstream = e_prompt.forward(x_embed, cls_features=query)  # .forward skips the hook
    indices = ours["prompt_idx"]
    assert torch.equal(indices, upstream["prompt_idx"])
    assert len(torch.unique(indices[:, 0])) > 1, "degenerate test: every sample chose alike"
    upstream_right = []
    for j in range(len(indices)):
        for key_value in (0, 1):
            expected = prefixes_of(e_prompt, indices[j], key_value)
            assert torch.equal(ours["batched_prompt"][:, j, key_value], expected)
            upstream_right.append(
                torch.equal(upstream["batched_prompt"][:, j, key_value], expected)
            )
    assert not all(upstream_right), "upstream's layout should be wrong for a batch of 6"


def test_batch_vote_keeps_key_and_value_apart(dualprompt):
    """With the vote, every sample gets the voted prompts, keys as keys and values as values;
    upstream hands the first half of the batch the key prefix twice, the second half the value."""
    _, network, _ = dualprompt
    e_prompt = network.backbone.e_prompt
    e_prompt.batchwise_prompt = True
    try:
        x_embed, query = prompt_inputs(e_prompt, batch=6, seed=4)
        with torch.no_grad():
            ours = e_prompt(x_embed, cls_features=query)
            upstream = e_prompt.forward(x_embed, cls_features=query)
    finally:
        e_prompt.batchwise_prompt = False
    voted = ours["prompt_idx"][0]
    assert (ours["prompt_idx"] == voted).all()
    key, value = prefixes_of(e_prompt, voted, 0), prefixes_of(e_prompt, voted, 1)
    for j in range(6):
        assert torch.equal(ours["batched_prompt"][:, j, 0], key)
        assert torch.equal(ours["batched_prompt"][:, j, 1], value)
        upstream_prefix = key if j < 3 else value
        assert torch.equal(upstream["batched_prompt"][:, j, 0], upstream_prefix)
        assert torch.equal(upstream["batched_prompt"][:, j, 1], upstream_prefix)


def test_upstream_layout_fails_the_invariance_test(dualprompt, test_images):
    """The invariance test has teeth: PILOT's network without our hook depends on the batch, and
    agrees with ours on a batch of one (the only size its layout gets right)."""
    from pilot_online.methods.l2p import L2POnline

    adapter, network, config = dualprompt
    upstream = build_network(adapter, config, lambda cfg: L2POnline.build_network(adapter, cfg))
    identity = np.arange(NUM_TEST_IMAGES)
    ours, ours_logits = evaluate(adapter, network, config, test_images, 256, identity)
    first_two = np.arange(2)
    alone, alone_logits = evaluate(adapter, upstream, config, test_images, 1, first_two)
    np.testing.assert_array_equal(alone, ours[:2])
    torch.testing.assert_close(alone_logits, ours_logits[:2], rtol=0, atol=1e-5)
    _, whole_logits = evaluate(adapter, upstream, config, test_images, 256, identity)
    _, batched_logits = evaluate(adapter, upstream, config, test_images, 7, identity)
    assert (whole_logits - ours_logits).abs().max() > 1e-2
    assert (batched_logits - whole_logits).abs().max() > 1e-2
