"""Backbone options reach timm.create_model while a network is built (timm, no PILOT)."""

from __future__ import annotations

import pytest

timm = pytest.importorskip("timm", reason="timm is not installed (pip install -e .)")

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
