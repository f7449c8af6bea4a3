"""Pretrained weights from a local file, in the forms clusters hold (``pretrained_path``).

Without PILOT: the safetensors package's read of bytes written by hand (and the error naming the
install extra without it), the strict state-dict load
of a small timm ViT (a missing, extra or mismatched key is an error naming it, and leaves the
model untouched; heads sized for the run and the model's own additions are listed), and the
suffixes refused. With PILOT: a random ViT-B (img_size 32) saved as timm 0.6's npz, as a torch
state dict and as safetensors loads into every registered method's network, and every backbone
weight equals the file's.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_network, requires_pilot, smoke_config

timm = pytest.importorskip("timm", reason="timm is not installed (pip install -e .)")

from pilot_online.engine.config import ConfigError, load_json, resolve_config  # noqa: E402
from pilot_online.pilot.backbones import (  # noqa: E402
    BACKBONE_KEY,
    WeightsMismatchError,
    WeightsUnavailableError,
    blocks_it_has,
    load_vit_state_dict,
    read_safetensors,
    read_state_dict,
    timm_overrides,
    weights_file_keys,
)

REPO = Path(__file__).resolve().parent.parent
FORMS = ("npz", "pth", "safetensors")
SAFETENSORS_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


# -- writers of each form (independent of the readers under test) ------------------------------


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors layout: u64 header length, JSON header, raw little-endian bytes."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {
            "dtype": SAFETENSORS_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def write_google_npz(path: Path, state: dict[str, torch.Tensor], heads: int) -> None:
    """A timm ViT state dict in the Google/Flax layout of the npz timm 0.6 downloads (the
    inverse of timm's ``_load_weights``)."""
    s = {k: v.numpy() for k, v in state.items()}
    dim = s["cls_token"].shape[-1]
    out = {
        "embedding/kernel": s["patch_embed.proj.weight"].transpose(2, 3, 1, 0),  # OIHW -> HWIO
        "embedding/bias": s["patch_embed.proj.bias"],
        "cls": s["cls_token"],
        "Transformer/posembed_input/pos_embedding": s["pos_embed"],
        "Transformer/encoder_norm/scale": s["norm.weight"],
        "Transformer/encoder_norm/bias": s["norm.bias"],
        "head/kernel": s["head.weight"].T,
        "head/bias": s["head.bias"],
    }
    depth = 1 + max(int(k.split(".")[1]) for k in s if k.startswith("blocks."))
    for i in range(depth):
        b, p = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        mha = p + "MultiHeadDotProductAttention_1/"
        qkv_w, qkv_b = s[b + "attn.qkv.weight"], s[b + "attn.qkv.bias"]
        for j, name in enumerate(("query", "key", "value")):
            rows = slice(j * dim, (j + 1) * dim)
            out[f"{mha}{name}/kernel"] = qkv_w[rows].T.reshape(dim, heads, dim // heads)
            out[f"{mha}{name}/bias"] = qkv_b[rows].reshape(heads, dim // heads)
        out[mha + "out/kernel"] = (
            s[b + "attn.proj.weight"].reshape(dim, heads, -1).transpose(1, 2, 0)
        )
        out[mha + "out/bias"] = s[b + "attn.proj.bias"]
        for r in range(2):
            out[f"{p}MlpBlock_3/Dense_{r}/kernel"] = s[f"{b}mlp.fc{r + 1}.weight"].T
            out[f"{p}MlpBlock_3/Dense_{r}/bias"] = s[f"{b}mlp.fc{r + 1}.bias"]
        for n, ln in (("norm1", "LayerNorm_0"), ("norm2", "LayerNorm_2")):
            out[f"{p}{ln}/scale"] = s[f"{b}{n}.weight"]
            out[f"{p}{ln}/bias"] = s[f"{b}{n}.bias"]
    np.savez(path, **out)


def random_vit_state(name: str, seed: int, **kwargs) -> dict[str, torch.Tensor]:
    """A timm ViT's state dict with every tensor random (no weight keeps an init value such as
    LayerNorm's ones, which an unloaded model would match by chance)."""
    model = timm.create_model(name, pretrained=False, **kwargs)
    generator = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=generator) * 0.02 for k, v in model.state_dict().items()
    }


# -- without PILOT -------------------------------------------------------------------------------


def test_safetensors_reader_against_hand_written_bytes(tmp_path):
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I64", "shape": [1, 1], "data_offsets": [8, 16]},
        "c": {"dtype": "F16", "shape": [2], "data_offsets": [16, 20]},
    }
    encoded = json.dumps(header).encode()
    data = struct.pack("<2f", 1.5, -2.0) + struct.pack("<q", -7) + struct.pack("<2e", 0.5, 3.0)
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    tensors = read_safetensors(path)
    assert sorted(tensors) == ["a", "b", "c"]
    assert torch.equal(tensors["a"], torch.tensor([1.5, -2.0]))
    assert torch.equal(tensors["b"], torch.tensor([[-7]]))
    assert tensors["c"].dtype == torch.float16 and tensors["c"].tolist() == [0.5, 3.0]
    # bfloat16 (no numpy dtype) through our writer.
    write_safetensors(path, {"x": torch.tensor([1.0, -0.25], dtype=torch.bfloat16)})
    assert read_safetensors(path)["x"].tolist() == [1.0, -0.25]


def test_safetensors_reader_refuses_a_corrupt_file(tmp_path):
    path = tmp_path / "w.safetensors"
    encoded = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * 8)  # 8 of 16 bytes
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        read_safetensors(path)
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    for read in (read_safetensors, weights_file_keys):
        with pytest.raises(ValueError, match="is not a readable safetensors file"):
            read(path)


def test_without_the_safetensors_package_the_error_names_the_extra(tmp_path, monkeypatch):
    """The package is imported only when a .safetensors file is given; missing, the error says
    which extra installs it (and no other form needs it)."""
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"x": torch.ones(2)})
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors: ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    for read in (read_safetensors, weights_file_keys, read_state_dict):
        with pytest.raises(WeightsUnavailableError, match=re.escape("'pilot-online[safetensors]'")):
            read(path)
    torch.save({"x": torch.ones(2)}, tmp_path / "w.pth")
    assert list(read_state_dict(tmp_path / "w.pth")) == ["x"]


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    return random_vit_state("vit_tiny_patch16_224", 1, img_size=32, num_classes=1000)


def tiny_vit(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, **kwargs)


def test_state_dict_loads_every_weight_and_lists_the_head(tiny_state):
    model = tiny_vit(num_classes=7)  # a head sized for the run, not ImageNet's 1000
    report = load_vit_state_dict(model, tiny_state, "file")
    own = model.state_dict()
    backbone = [k for k in own if BACKBONE_KEY.fullmatch(k)]
    assert len(backbone) == len(own) - 2 == 4 + 12 * 12 + 2  # embeddings, 12 blocks, norm
    for key in backbone:
        assert torch.equal(own[key], tiny_state[key]), key
    assert report.head_not_loaded == ["head.weight", "head.bias"]
    assert sorted(report.dropped_from_file) == ["head.bias", "head.weight"]
    assert not report.added_by_model and not report.resized


def test_state_dict_load_refuses_missing_extra_and_mismatched_keys(tiny_state):
    model = tiny_vit(num_classes=1000)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = dict(tiny_state)
    del state["blocks.3.mlp.fc2.bias"]
    state["blocks.0.attn.qkv.weight"] = state["blocks.0.attn.qkv.weight"][:, :10]
    state["prompt.prompt"] = torch.zeros(3)
    with pytest.raises(WeightsMismatchError) as caught:
        load_vit_state_dict(model, state, "w.pth")
    message = str(caught.value)
    assert "missing from the file: blocks.3.mlp.fc2.bias" in message
    assert "blocks.0.attn.qkv.weight (file (576, 10), model (576, 192))" in message
    assert "in the file but not in VisionTransformer: prompt.prompt" in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched


def test_additions_of_the_model_are_listed_not_refused(tiny_state):
    model = tiny_vit(num_classes=1000)
    model.prompt = torch.nn.Parameter(torch.zeros(4, 192))  # as the prompt ViTs add
    report = load_vit_state_dict(model, tiny_state, "file")
    assert report.added_by_model == ["prompt"]
    assert report.head_not_loaded == [] and torch.equal(model.head.bias, tiny_state["head.bias"])


def test_pos_embed_is_resized_to_the_models_grid():
    state = random_vit_state("vit_tiny_patch16_224", 2)  # 224 px: 1 + 14 x 14 tokens
    model = tiny_vit(num_classes=1000)  # 32 px: 1 + 2 x 2 tokens
    report = load_vit_state_dict(model, state, "file")
    assert report.resized == ["pos_embed (1, 197, 192) -> (1, 5, 192)"]
    # The class token's row is kept as it is; the grid is interpolated.
    assert torch.equal(model.pos_embed[:, 0], state["pos_embed"][:, 0])


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_create_model_loads_a_state_dict_file(tiny_state, tmp_path, suffix):
    path = tmp_path / f"w{suffix}"
    if suffix == ".pth":
        torch.save({"state_dict": tiny_state}, path)  # a training checkpoint's wrapper
    else:
        write_safetensors(path, tiny_state)
    with timm_overrides(pretrained_path=str(path)):
        model = timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=32)
    for key, value in model.state_dict().items():
        assert torch.equal(value, tiny_state[key]), key


def test_unknown_suffixes_are_refused(tmp_path):
    path = tmp_path / "vit.ckpt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"'\.ckpt'.*\.npz, \.pth, \.pt, \.bin, \.safetensors"):
        with timm_overrides(pretrained_path=str(path)):
            pass
    smoke = load_json(REPO / "exps" / "smoke_coda_online.json")
    with pytest.raises(ConfigError, match=r"pretrained_path.*\.ckpt"):
        resolve_config({**smoke, "pretrained_path": str(path)})
    with pytest.raises(ValueError, match="no state dict"):
        torch.save([1, 2], tmp_path / "list.pth")
        read_state_dict(tmp_path / "list.pth")


# -- with PILOT: every method's backbone, each form -----------------------------------------------


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """A random ViT-B/16 at img_size 32 (PILOT's factories fix depth and width) in each form."""
    state = random_vit_state("vit_base_patch16_224", 3, img_size=32)
    folder = tmp_path_factory.mktemp("weights")
    files = {"npz": folder / "B_16.npz", "pth": folder / "vit.pth"}
    write_google_npz(files["npz"], state, heads=12)
    torch.save(state, files["pth"])
    files["safetensors"] = folder / "model.safetensors"
    write_safetensors(files["safetensors"], state)
    return state, files


def check_network_backbones(
    name: str, path: Path, state: dict[str, torch.Tensor], depth: int | None = None
) -> torch.nn.Module:
    """Build ``name``'s smoke network from ``path`` (``vit_depth`` ``depth``; None: the
    factory's 12); every ViT it built holds the file's backbone weights exactly (oLoRA's
    wrapped projections included). Returns the network."""
    from pilot_online.engine.registry import get_method

    # DER's and MEMO's smoke ViTs keep 2 blocks: checked at the depth asked for.
    config = smoke_config(name, pretrained=True, pretrained_path=str(path), vit_depth=depth)
    adapter = get_method(name)(args=config)
    built: list[torch.nn.Module] = []
    original = timm.create_model

    def recording(*args, **kwargs):
        model = original(*args, **kwargs)
        built.extend(model if isinstance(model, tuple) else [model])  # vit_memo: a pair
        return model

    timm.create_model = recording  # timm_overrides wraps it: records the models it loads
    try:
        network = build_network(adapter, config)
    finally:
        timm.create_model = original
    modules = list(network.modules())
    vits = [m for m in built if any(m is n for n in modules)]
    # PILOT's vit_adapter, vit_ease and vit_mos build their own ViT and copy a timm model's
    # weights into it, splitting qkv into q_proj, k_proj and v_proj: checked as well.
    vits += [
        m
        for m in modules
        if hasattr(m, "blocks") and any(".attn.q_proj." in k for k in m.state_dict())
    ]
    assert vits, f"{name}: the network holds no ViT"
    blocks = depth or 12
    assert len([k for k in state if BACKBONE_KEY.fullmatch(k)]) >= 4 + 12 * blocks + 2
    for vit in vits:
        # MEMO splits the ViT: depth - 1 generalized blocks, and specialized extractors whose
        # unused blocks the port drops (their last_block starts random, as upstream's npz load
        # leaves it).
        assert len(vit.blocks) == blocks or (
            name == "memo_online" and len(vit.blocks) in (0, blocks - 1)
        )
        expected = [k for k in blocks_it_has(vit, state) if BACKBONE_KEY.fullmatch(k)]
        own = {re.sub(r"attn\.qkv\.qkv\.", "attn.qkv.", k): v for k, v in vit.state_dict().items()}
        # vit_ease/vit_mos/vit_adapter also hold the MLP's layers on the block itself.
        own = {re.sub(r"^(blocks\.\d+)\.(fc[12])\.", r"\1.mlp.\2.", k): v for k, v in own.items()}
        for key in [k for k in own if ".attn.q_proj." in k]:
            parts = [own[key.replace("q_proj", proj)] for proj in ("q_proj", "k_proj", "v_proj")]
            own[key.replace("q_proj", "qkv")] = torch.cat(parts)
        for key in expected:
            value = own[key]
            if key == "pos_embed" and value.shape != state[key].shape:
                # L2P's prompt tokens have positions too: the class token's, then the grid's.
                grid = state[key].shape[1] - 1
                extra = value.shape[1] - grid
                assert torch.equal(value[:, -grid:], state[key][:, 1:]), f"{name}: pos_embed"
                assert torch.equal(value[:, :extra], state[key][:, :1].expand(-1, extra, -1))
                continue
            assert torch.equal(value, state[key].to(value.dtype)), f"{name} ({path.suffix}): {key}"
    return network


@requires_pilot
@pytest.mark.parametrize("form", ["npz", "pth"])  # safetensors: every method, below
@pytest.mark.parametrize("name", ["coda_online", "finetune_online", "l2p_online"])
def test_every_form_loads_into_prompt_and_plain_vits(pilot_on_path, weight_files, name, form):
    """CODA's and L2P's prompt ViTs (L2P's prompt tokens get the class token's position, as
    PILOT's npz loader gives them) and the baselines' plain ViT."""
    state, files = weight_files
    check_network_backbones(name, files[form], state)


@requires_pilot
def test_every_registered_method_loads_a_safetensors_file(pilot_on_path, weight_files):
    """Every registered method; methods that build the same backbone the same way (ER and
    fine-tuning, say) are built once."""
    from pilot_online.engine.registry import get_method, list_methods

    state, files = weight_files
    built = set()
    for name in list_methods():
        adapter = get_method(name)
        key = (adapter.build_network, smoke_config(name)["backbone_type"])
        if key in built:
            continue
        built.add(key)
        check_network_backbones(name, files["safetensors"], state)
    assert len(built) >= 8


def test_the_doctor_recognises_every_form(weight_files, tmp_path):
    """``missing_vit_keys`` (what ``pilot-online doctor`` reads) finds a ViT-B in each form,
    from the safetensors header and the npz index alone, and names what a tiny ViT lacks."""
    from pilot_online.pilot.backbones import missing_vit_keys

    _, files = weight_files
    for form in FORMS:
        assert missing_vit_keys(files[form]) == [], form
    shallow = tmp_path / "shallow.safetensors"  # without blocks 1, 10 and 11
    state = random_vit_state("vit_tiny_patch16_224", 0, img_size=32)
    write_safetensors(shallow, {k: v for k, v in state.items() if not k.startswith("blocks.1")})
    assert missing_vit_keys(shallow) == ["blocks.11.mlp.fc2.weight"]


# -- the shipped scale-model backbone --------------------------------------------------------------

#: One method per ViT family PILOT builds: the prompt ViTs, the adapters, SSF, VPT, EASE, MOS,
#: LAE and MEMO's pair.
FAMILIES = (
    "l2p_online",
    "dualprompt_online",
    "coda_online",
    "aper_adapter_online",
    "aper_ssf_online",
    "aper_vpt_online",
    "ease_online",
    "mos_online",
    "lae_online",
    "memo_online",
)


def per_layer_names_kept(names: set[str], depth: int) -> set[str]:
    """The parameter names of a 12-block build that a ``depth``-block build should have: every
    index in a name (a block, an adapter of a layer, EASE's subspace of a layer) below ``depth``
    (the smoke stream's other indices, branches and heads, stay below 5). MEMO's generalized
    part holds the first ``depth - 1`` blocks (upstream's 11 of 12): its last is specialized."""

    def kept(name: str) -> bool:
        limit = depth - 1 if name.startswith("TaskAgnosticExtractor.blocks.") else depth
        return all(int(part) < limit for part in name.split(".") if part.isdigit())

    return {n for n in names if kept(n)}


def test_the_shipped_backbone_matches_its_record():
    from pilot_online.core import scale_backbone as backbone

    record = backbone.verify()  # the SHA-256 of the file is the recorded one
    assert backbone.WEIGHTS.stat().st_size == record["bytes"] <= 80 * 2**20
    recipe = record["recipe"]
    assert recipe["embed_dim"] == 768 and recipe["num_heads"] == 12 and recipe["depth"] >= 5
    state = read_safetensors(backbone.WEIGHTS)
    assert {v.dtype for v in state.values()} == {torch.float16}
    blocks = {int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))}
    assert blocks == set(range(recipe["depth"]))
    assert not [k for k in state if k.startswith("head")]


@requires_pilot
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_builds_the_shipped_backbone_at_its_depth(pilot_on_path, name):
    """``vit_depth`` is honoured when each family builds its network: every backbone tensor
    equals the shipped file's, and the trainable set is the 12-block build's, less the layers
    past the depth."""
    from pilot_online.core import scale_backbone as backbone
    from pilot_online.engine.registry import get_method

    depth = backbone.record()["recipe"]["depth"]
    state = read_state_dict(backbone.WEIGHTS)
    network = check_network_backbones(name, backbone.WEIGHTS, state, depth)
    trainable = {n for n, p in network.named_parameters() if p.requires_grad}
    config = smoke_config(name, vit_depth=None)
    full = build_network(get_method(name)(args=config), config)
    full_trainable = {n for n, p in full.named_parameters() if p.requires_grad}
    assert trainable == per_layer_names_kept(full_trainable, depth)


def test_the_doctor_checks_the_blocks_vit_depth_asks_for(tmp_path):
    """A 5-block file is whole for ``vit_depth`` 5 and lacks block 11 for a 12-block run."""
    from pilot_online.pilot.backbones import missing_vit_keys

    state = random_vit_state("vit_tiny_patch16_224", 0, img_size=32)
    shallow = tmp_path / "five.safetensors"
    blocks_0_to_4 = {k: v for k, v in state.items() if not re.match(r"blocks\.([5-9]|1\d)\.", k)}
    write_safetensors(shallow, blocks_0_to_4)
    assert missing_vit_keys(shallow, 5) == []
    assert missing_vit_keys(shallow) == ["blocks.11.mlp.fc2.weight"]
