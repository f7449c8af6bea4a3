"""APER's PEFT family online (``aper_*_online``) and the online-head helper.

APER's two-branch network: the frozen pre-trained ViT and the adapted one, features concatenated,
one ``nn.Linear`` head. What trains is each method's PEFT part (PILOT's freezing rule) plus the
head; trainable sizes are worked out from the ViT-B/16 shapes (12 blocks, width 768). Networks are
PILOT's, built from the smoke configs at 32 px with random weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import build_network, requires_pilot, smoke_config
from torch import nn

from pilot_online import get_method
from pilot_online.engine.adapter import MethodAdapter, trained_parameters
from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.engine.mixins import build_loop

REPO = Path(__file__).resolve().parent.parent
NUM_CLASSES = 8
HEAD = 2 * 768 * NUM_CLASSES + NUM_CLASSES  # nn.Linear(768 + 768, 8)


# -- the online head helper ------------------------------------------------------------------
class Features(nn.Module):
    feature_dim = 6

    def __init__(self) -> None:
        super().__init__()
        self.fc = None  # as PILOT's networks before update_fc


def test_online_head_is_a_trainable_linear_over_all_classes() -> None:
    network = Features()
    head = MethodAdapter().online_head(network, {"nb_classes": 4})
    assert network.fc is head and isinstance(head, nn.Linear)
    assert (head.in_features, head.out_features) == (6, 4)
    assert head.weight.requires_grad and head.bias is not None
    other = MethodAdapter().online_head(network, {"nb_classes": 3}, attr="head", in_features=12)
    assert network.head is other and tuple(other.weight.shape) == (3, 12)


def test_online_head_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="nb_classes"):
        MethodAdapter().online_head(Features(), {})
    with pytest.raises(ValueError, match="in_features="):
        MethodAdapter().online_head(nn.Identity(), {"nb_classes": 4})


# -- ViTs PILOT builds without timm.create_model ---------------------------------------------
def test_img_size_reaches_vits_built_without_create_model() -> None:
    """VPT's and the adapter ViT's classes are built directly; ``backbone_kwargs.img_size`` must
    size them too, or loading a 32 px ``create_model`` ViT's weights into them fails."""
    from timm.models.vision_transformer import VisionTransformer

    from pilot_online.pilot.backbones import timm_overrides

    def tiny() -> VisionTransformer:
        return VisionTransformer(img_size=224, patch_size=16, embed_dim=16, depth=1, num_heads=1)

    with timm_overrides({"img_size": 32}):
        small = tiny()
    assert small.pos_embed.shape[1] == (32 // 16) ** 2 + 1  # 4 patches + the class token
    assert tiny().pos_embed.shape[1] == (224 // 16) ** 2 + 1  # put back after the block
    with timm_overrides({}):
        assert tiny().pos_embed.shape[1] == 197  # no img_size: untouched


# -- config checks (no PILOT) ----------------------------------------------------------------
def raw_config(short: str, **changes: Any) -> dict[str, Any]:
    return {**load_json(REPO / "exps" / f"smoke_{short}_online.json"), **changes}


@pytest.mark.parametrize(
    "short, wrong, right",
    [
        ("aper_ssf", "vit_base_patch16_224_ssf", "pretrained_vit_b16_224_ssf"),
        ("aper_vpt", "vit_base_patch16_224_vpt", "pretrained_vit_b16_224_vpt"),
        ("aper_adapter", "pretrained_vit_b16_224", "pretrained_vit_b16_224_adapter"),
        ("aper_finetune", "pretrained_vit_b16_224_ssf", "pretrained_vit_b16_224"),
    ],
)
def test_backbones_pilot_cannot_build_are_refused(short: str, wrong: str, right: str) -> None:
    with pytest.raises(ConfigError, match=right):
        resolve_config(raw_config(short, backbone_type=wrong))


@pytest.mark.parametrize(
    "short, key, value",
    [
        ("aper_vpt", "vpt_type", "middle"),
        ("aper_vpt", "prompt_token_num", 0),
        ("aper_adapter", "ffn_num", 2.5),
        ("aper_adapter", "adapter_dropout", 1.5),
    ],
)
def test_method_keys_are_checked(short: str, key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key):
        resolve_config(raw_config(short, **{key: value}))


# -- PILOT's networks ------------------------------------------------------------------------
Built = tuple[Any, nn.Module, dict[str, Any]]

#: method, config changes, trainable element count (None: checked by name only).
CASES = {
    "finetune": ("aper_finetune_online", {}, None),
    "ssf": ("aper_ssf_online", {}, None),
    "vpt_deep": ("aper_vpt_online", {"vpt_type": "deep"}, 12 * 5 * 768 + HEAD),
    "vpt_shallow": ("aper_vpt_online", {"vpt_type": "shallow"}, 1 * 5 * 768 + HEAD),
    # 12 blocks x (down 768x64 + 64, up 64x768 + 768)
    "adapter": (
        "aper_adapter_online",
        {"ffn_num": 64},
        12 * (768 * 64 + 64 + 64 * 768 + 768) + HEAD,
    ),
}


@pytest.fixture(scope="module")
def networks(pilot_on_path: Path) -> Iterator[dict[str, Built]]:
    built: dict[str, Built] = {}
    yield built
    built.clear()


@pytest.fixture(params=sorted(CASES))
def case(request, networks) -> tuple[str, Built]:
    key = request.param
    if key not in networks:
        name, changes, _ = CASES[key]
        config = smoke_config(name, num_classes=NUM_CLASSES, **changes)
        adapter = get_method(name)(args=config)
        networks[key] = (adapter, build_network(adapter, config), config)
    return key, networks[key]


@requires_pilot
def test_what_trains_is_the_peft_part_and_the_head(case) -> None:
    key, (_, network, _) = case
    pretrained, adapted = network.backbones
    assert not any(p.requires_grad for p in pretrained.parameters())
    assert network.fc.in_features == 2 * 768 and network.fc.out_features == NUM_CLASSES
    trainable = dict(trained_parameters(network))
    tuned = {n for n in trainable if n.startswith("backbones.1.")}
    assert set(trainable) == tuned | {"fc.weight", "fc.bias"}
    markers = {"ssf": ("ssf_scale", "ssf_shift_"), "vpt_deep": ("Prompt_Tokens",)}
    markers.update(vpt_shallow=("Prompt_Tokens",), adapter=("adaptmlp",))
    if key == "finetune":
        assert len(tuned) == len(list(adapted.parameters()))
    else:
        every = {f"backbones.1.{n}" for n, _ in adapted.named_parameters()}
        wanted = {n for n in every if any(m in n for m in markers[key])}
        assert tuned == wanted and 0 < len(tuned) < len(every)
    if key == "adapter":  # PILOT builds its adapters with dropout 0.1; the smoke config sets 0
        assert {block.adaptmlp.dropout for block in adapted.blocks} == {0.0}
    expected = CASES[key][2]
    if expected is not None:
        assert sum(p.numel() for p in trainable.values()) == expected


@requires_pilot
def test_features_concatenate_the_two_branches_and_one_step_moves_only_what_trains(
    case,
) -> None:
    _, (adapter, network, config) = case
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    adapter.set_mode(network, train=False)
    with torch.no_grad():
        out = adapter.forward(network, x, train=False)
        assert torch.allclose(out.features[:, :768], network.backbones[0](x))
        assert torch.allclose(out.features[:, 768:], network.backbones[1](x))
        assert torch.allclose(out.logits, network.fc(out.features))
    before = {n: p.detach().clone() for n, p in network.named_parameters()}
    loop = build_loop(adapter, network, {**config, "fgh": None}, NUM_CLASSES)
    loop.train_step(x, torch.tensor([0, 1, 2, 3]))
    trainable = dict(trained_parameters(network))
    for name, param in network.named_parameters():
        moved = not torch.equal(before[name], param.detach())
        if name not in trainable:
            assert not moved, f"{name} is frozen but changed"
    assert not torch.equal(before["fc.weight"], network.fc.weight.detach())
    assert loop.optimizer_steps == 1
