"""Backbone options reach timm.create_model while a network is built (timm, no PILOT)."""

from __future__ import annotations

import pytest

timm = pytest.importorskip("timm", reason="timm is not installed (pip install -e .)")

from conftest import requires_pilot  # noqa: E402

from pilot_online.pilot.backbones import WeightsUnavailableError, timm_overrides  # noqa: E402


def test_backbone_kwargs_reach_every_create_model_call():
    with timm_overrides({"img_size": 32}):
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    assert model.patch_embed.img_size == (32, 32)
    assert model.pos_embed.shape[1] == 1 + (32 // 16) ** 2  # cls token + 2 x 2 patches


def test_create_model_is_restored_afterwards():
    original = timm.create_model
    with pytest.raises(RuntimeError), timm_overrides({"img_size": 32}):
        raise RuntimeError("boom")
    assert timm.create_model is original


def test_pretrained_path_is_the_file_timm_loads(tmp_path):
    weights = tmp_path / "B_16.npz"
    weights.write_bytes(b"not an npz archive")
    with (
        pytest.raises(WeightsUnavailableError) as caught,
        timm_overrides(pretrained_path=str(weights)),
    ):
        timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=32)
    # timm read our (corrupt) file, not a URL: numpy's complaint about it is the cause.
    assert str(weights) in str(caught.value)
    assert isinstance(caught.value.__cause__, ValueError)


def test_unreachable_download_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(key, "http://127.0.0.1:9")  # closed loopback port: no network
    with pytest.raises(WeightsUnavailableError, match="pretrained_path"), timm_overrides():
        timm.create_model("vit_tiny_patch16_224", pretrained=True)


@pytest.mark.parametrize(
    "backbone_type, forced",
    [
        # get_backbone's plain, APER, LAE and MEMO branches: timm.create_model(name,
        # pretrained=True, num_classes=0), no dropout arguments.
        ("vit_base_patch16_224", {"pretrained": False, "drop_rate": 0.1, "drop_path_rate": 0.2}),
        (
            "pretrained_vit_b16_224_in21k_ssf",
            {"pretrained": False, "drop_rate": 0.1, "drop_path_rate": 0.2},
        ),
        (
            "pretrained_vit_b16_224_adapter",
            {"pretrained": False, "drop_rate": 0.1, "drop_path_rate": 0.2},
        ),
        (
            "vit_base_patch16_224_lae",
            {"pretrained": False, "drop_rate": 0.1, "drop_path_rate": 0.2},
        ),
        (
            "vit_base_patch16_224_memo",
            {"pretrained": False, "drop_rate": 0.1, "drop_path_rate": 0.2},
        ),
        # EASE's and MoS's ViT classes copy weights from a pretrained=True model; dropout is theirs.
        ("vit_base_patch16_224_ease", {"pretrained": False}),
        ("vit_base_patch16_224_in21k_mos", {"pretrained": False}),
        # L2P's and DualPrompt's branches pass args["pretrained"], args["drop"] and
        # args["drop_path"] themselves.
        ("vit_base_patch16_224_l2p", {}),
        ("vit_base_patch16_224_dualprompt", {}),
        # CODA's branch: timm.create_model(name, pretrained=args["pretrained"]), no dropout.
        (
            "vit_base_patch16_224_coda_prompt",
            {"pretrained": False, "drop_rate": 0.1, "drop_path_rate": 0.2},
        ),
    ],
)
def test_factory_overrides_replace_what_each_get_backbone_branch_hard_codes(backbone_type, forced):
    from pilot_online.engine.backbone_names import factory_overrides

    args = {"backbone_type": backbone_type, "pretrained": False, "drop": 0.1, "drop_path": 0.2}
    assert factory_overrides(args) == forced
    # The config's own backbone_kwargs go on top, and win.
    on_top = {**args, "backbone_kwargs": {"img_size": 32, "pretrained": True}}
    assert factory_overrides(on_top) == {**forced, "img_size": 32, "pretrained": True}


@requires_pilot
@pytest.mark.parametrize("method", ["coda_online", "l2p_online", "finetune_online"])
def test_the_configs_dropout_reaches_the_vit_that_pilot_builds(method, pilot_on_path):
    """``drop`` and ``drop_path`` are the trained ViT's rates whichever get_backbone branch
    builds it: CODA's branch passes neither, and once dropped them silently."""
    from conftest import build_smoke_method
    from torch import nn

    _, network, _ = build_smoke_method(method, drop=0.3, drop_path=0.2)
    vit = network.backbone
    assert vit.pos_drop.p == pytest.approx(0.3)
    assert 0.3 in {m.p for m in vit.blocks[0].modules() if isinstance(m, nn.Dropout)}
    deepest = [m.drop_prob for m in vit.blocks[-1].modules() if hasattr(m, "drop_prob")]
    assert deepest and deepest[0] == pytest.approx(0.2)  # stochastic depth's last-block rate
