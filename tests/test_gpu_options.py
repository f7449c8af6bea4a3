"""GPU options of issue 10 (``amp``, ``sdpa``, ``pin_memory``), checked on the CPU.

With PILOT: ``use_sdpa`` swaps the attention of every method's network (timm's, PILOT's prefix
attention, CODA's): every attention module's ``forward`` becomes ours, and one forward calls
``scaled_dot_product_attention`` once per attention module the hand-written network runs (a swap
that only counts modules fails here, where matching logits alone would not notice). In fp32,
logits match the hand-written attention to rounding with equal predictions; ``"sdpa": true`` in
a config reaches the network ``OnlineLearner`` builds; bf16 autocast (CPU autocast supports
bfloat16) runs a training step and gives finite logits. Without PILOT: the options default off
and bad values are refused.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyAdapter, build_smoke_method, requires_pilot, smoke_config
from torch import nn

from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import list_methods
from pilot_online.engine.session import ArrayDataSource

REPO = Path(__file__).resolve().parent.parent
NUM_CLASSES = 8
#: Every registered method: each network's attention (timm's, PILOT's prefix attention, CODA's)
METHODS = list_methods()


def attention_modules(network: nn.Module) -> list[nn.Module]:
    """The attention modules of a PILOT ViT, found independently of ``use_sdpa``'s own rule:
    every module with heads and a fused ``qkv`` projection (timm's ``Attention``,
    ``PreT_Attention``, CODA's, SSF's; oLoRA's ``qkv`` is a module around the projection) or
    separate ``q_proj``/``k_proj``/``v_proj`` (``vit_adapter``, ``vit_ease``, ``vit_mos``)."""
    return [
        m
        for m in network.modules()
        if hasattr(m, "num_heads")
        and any(isinstance(getattr(m, a, None), nn.Module) for a in ("qkv", "q_proj"))
    ]


def accepts_sdpa(name: str) -> bool:
    """Whether the method's smoke config passes check-config with ``"sdpa": true``."""
    from pilot_online.engine.config import ConfigError

    try:
        smoke_config(name, sdpa=True)
    except ConfigError as error:
        assert "sdpa" in str(error), error  # refused for sdpa, naming it
        return False
    return True


#: The methods whose attention ``sdpa`` reproduces; the others refuse the key (LAE).
SDPA_METHODS = [name for name in METHODS if accepts_sdpa(name)]


def test_a_method_sdpa_cannot_run_refuses_it_before_any_work():
    from pilot_online.engine.config import ConfigError

    assert "lae_online" not in SDPA_METHODS and "coda_online" in SDPA_METHODS
    with pytest.raises(ConfigError, match=r"lae_online: sdpa: true cannot run LAE.*false"):
        smoke_config("lae_online", sdpa=True)


def count_attention_calls(network: nn.Module, run) -> int:
    """How many attention-module calls ``run()`` makes through ``network``'s modules."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    handles = [m.register_forward_hook(hook) for m in attention_modules(network)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return calls[0]


class SDPASpy:
    """Stands in for ``F.scaled_dot_product_attention`` and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = F.scaled_dot_product_attention

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def uses_our_forward(module: nn.Module) -> bool:
    """Whether ``module`` runs one of ``pilot/attention.py``'s forwards: bound to it, as a
    partial of it, or through its class."""
    from pilot_online.pilot import attention

    ours = {
        attention.plain_forward,
        attention.prefix_forward,
        attention.coda_forward,
        attention.split_forward,
    }
    forward = module.forward
    found = {getattr(forward, "__func__", None), getattr(forward, "func", None)}
    found.add(getattr(type(module), "forward", None))
    return bool(found & ours)


def assert_every_attention_swapped(network: nn.Module) -> None:
    modules = attention_modules(network)
    assert modules, "the network has no attention module"
    kept = [type(m).__name__ for m in modules if not uses_our_forward(m)]
    assert not kept, f"{len(kept)} of {len(modules)} attention modules keep their forward: {kept}"


@requires_pilot
@pytest.mark.parametrize("name", SDPA_METHODS)
def test_sdpa_matches_hand_written_attention(pilot_on_path, name, monkeypatch):
    from pilot_online.pilot.attention import use_sdpa

    adapter, network, _ = build_smoke_method(name)
    fused = copy.deepcopy(network)
    vits = [
        m
        for m in network.modules()
        if isinstance(getattr(m, "blocks", None), (nn.Sequential, nn.ModuleList))
    ]
    blocks = max(len(vit.blocks) for vit in vits)  # APER: two ViTs, as network.backbones
    assert use_sdpa(fused) == len(attention_modules(fused)) >= blocks  # L2P: both ViTs
    assert_every_attention_swapped(fused)
    images = np.random.default_rng(0).integers(0, 256, size=(10, 32, 32, 3), dtype=np.uint8)
    x = ArrayDataSource._to_tensor(images)
    adapter.set_mode(network, train=False), adapter.set_mode(fused, train=False)
    spy = SDPASpy()
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        executed = count_attention_calls(network, lambda: adapter.forward(network, x, train=False))
        assert spy.calls == 0  # the hand-written network never calls SDPA
        reference = adapter.forward(network, x, train=False).logits
        logits = adapter.forward(fused, x, train=False).logits
    # Each attention module the forward runs calls SDPA once, through our forward (L2P and
    # DualPrompt also run their query ViT: 2 x depth; CODA runs one ViT twice).
    assert executed >= blocks and spy.calls == executed
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    # Top-3 predictions, as the engine evaluates (random weights rank classes alike per image).
    assert torch.equal(logits.topk(3).indices, reference.topk(3).indices)


@requires_pilot
@pytest.mark.parametrize("sdpa", [True, False])
def test_sdpa_config_key_reaches_the_learners_network(pilot_on_path, tmp_path, sdpa):
    """``"sdpa": true`` in a config swaps the attention of the network PILOT's learner trains."""
    from pilot_online.pilot import create_learner

    config = smoke_config("coda_online", sdpa=sdpa, results_dir=str(tmp_path))
    config["device"] = [torch.device("cpu")]  # as PILOT's trainer passes it
    learner = create_learner(config)
    if sdpa:
        assert_every_attention_swapped(learner._network)
    else:
        assert not any(uses_our_forward(m) for m in attention_modules(learner._network))


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
    assert (config["amp"], config["sdpa"], config["pin_memory"]) == (None, False, None)
    for key, value in (("amp", "fp16"), ("sdpa", "yes"), ("pin_memory", 1)):
        with pytest.raises(ConfigError, match=key):
            resolve_config({**smoke, key: value})
    loop = build_loop(TinyAdapter(), TinyAdapter().build_network({}), {}, 6)
    assert loop.amp is None
    with pytest.raises(ValueError, match="amp"):
        build_loop(TinyAdapter(), TinyAdapter().build_network({}), {"amp": "fp16"}, 6)
