"""GPU options of issue 10 (``amp``, ``sdpa``, ``pin_memory``), checked on the CPU.

With PILOT: ``use_sdpa`` swaps the attention of every method's network (timm's, PILOT's prefix
attention, CODA's) and, in fp32, logits match the hand-written attention to rounding with equal
predictions; bf16 autocast (CPU autocast supports bfloat16) runs a training step and gives finite
logits. Without PILOT: the options default off and bad values are refused.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, build_smoke_method, requires_pilot

from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.engine.loop import build_loop
from pilot_online.engine.session import ArrayDataSource

REPO = Path(__file__).resolve().parent.parent
NUM_CLASSES = 8
METHODS = ("l2p_online", "dualprompt_online", "coda_online", "mvp_online", "convprompt_online")


@requires_pilot
@pytest.mark.parametrize("name", METHODS)
def test_sdpa_matches_hand_written_attention(pilot_on_path, name):
    from pilot_online.pilot.attention import use_sdpa

    adapter, network, _ = build_smoke_method(name)
    fused = copy.deepcopy(network)
    blocks = len(network.backbone.blocks)
    assert use_sdpa(fused) >= blocks  # every block's attention (L2P: both ViTs)
    images = np.random.default_rng(0).integers(0, 256, size=(10, 32, 32, 3), dtype=np.uint8)
    x = ArrayDataSource._to_tensor(images)
    adapter.eval_mode(network), adapter.eval_mode(fused)
    with torch.no_grad():
        reference = adapter.forward(network, x, train=False).logits
        logits = adapter.forward(fused, x, train=False).logits
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    # Top-3 predictions, as the engine evaluates (random weights rank classes alike per image).
    assert torch.equal(logits.topk(3).indices, reference.topk(3).indices)


@requires_pilot
def test_bf16_autocast_trains_on_cpu(pilot_on_path):
    adapter, network, config = build_smoke_method("coda_online", amp="bf16")
    loop = build_loop(adapter, network, config, NUM_CLASSES)
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    stats = loop.train_step(x, torch.tensor([0, 1, 2, 3]))
    assert not stats.skipped and torch.isfinite(stats.loss)
    with loop.autocast():
        logits = adapter.forward(network, x, train=False).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_options_default_off_and_refuse_bad_values():
    smoke = load_json(REPO / "exps" / "smoke_l2p_online.json")
    config = resolve_config(smoke)
    assert (config["amp"], config["sdpa"], config["pin_memory"]) == (None, False, False)
    for key, value in (("amp", "fp16"), ("sdpa", "yes"), ("pin_memory", 1)):
        with pytest.raises(ConfigError, match=key):
            resolve_config({**smoke, key: value})
    loop = build_loop(TinyAdapter(), TinyAdapter().build_network({}), {}, 6)
    assert loop.amp is None
    with pytest.raises(ValueError, match="amp"):
        build_loop(TinyAdapter(), TinyAdapter().build_network({}), {"amp": "fp16"}, 6)
