"""The shipped scale-model backbone: where it lies, its record, and the check of its hash.

``scripts/pretrain_backbone.py`` writes ``pilot_online/data/backbones/scale_vit.safetensors``
(fp16, timm's key names) and ``scale_vit.json`` beside it: the recipe, seed, torch version and
thread count it was trained with, its SHA-256, its training time, and the probe and
nearest-class-mean figures that show it is pretrained. Configs name the file by its path
relative to the package, ``pilot_online/data/backbones/scale_vit.safetensors``, resolved here
(``resolve_weights``), so a config works from any working directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FOLDER = Path(__file__).resolve().parent.parent / "data" / "backbones"
WEIGHTS = FOLDER / "scale_vit.safetensors"
RECORD = FOLDER / "scale_vit.json"
#: How configs name the shipped file: resolved against the installed package.
CONFIG_NAME = "pilot_online/data/backbones/scale_vit.safetensors"
#: What a config sets to build networks that take the shipped file.
REGENERATE = "python scripts/pretrain_backbone.py --ship"


class BackboneRecordError(RuntimeError):
    """The shipped file is missing, or differs from its record."""


def record() -> dict[str, Any]:
    """The shipped file's record (recipe, seed, hash, figures)."""
    if not RECORD.is_file():
        raise BackboneRecordError(f"{RECORD} is missing: regenerate it with {REGENERATE}")
    return json.loads(RECORD.read_text())


def verify() -> dict[str, Any]:
    """The record, after checking that the shipped file's SHA-256 is the recorded one."""
    from .files import sha256

    rec = record()
    if not WEIGHTS.is_file():
        raise BackboneRecordError(f"{WEIGHTS} is missing: regenerate it with {REGENERATE}")
    actual = sha256(WEIGHTS)
    if actual != rec["sha256"]:
        raise BackboneRecordError(
            f"{WEIGHTS} has SHA-256 {actual}, its record {RECORD} says {rec['sha256']}: the "
            f"file was changed or truncated (a Git LFS pointer?); check it out again, or "
            f"regenerate both with {REGENERATE}"
        )
    return rec


def config_keys() -> dict[str, Any]:
    """The keys that make a config build the scale model's networks from the shipped file."""
    recipe = record()["recipe"]
    return {
        "pretrained": True,
        "pretrained_path": CONFIG_NAME,
        "vit_depth": recipe["depth"],
        "backbone_kwargs": {"img_size": recipe["img_size"]},
    }


def shipped_name(path: str) -> str:
    """:data:`CONFIG_NAME` for the shipped file in any checkout, else ``path``: a results file
    records the resolved path of the checkout that ran it, which another checkout of the same
    version (a frozen copy for a long grid, a fresh clone) must still recognise."""
    return CONFIG_NAME if Path(path).as_posix().endswith(CONFIG_NAME) else path


def resolve_weights(path: str) -> str:
    """``path`` as given, or the shipped file when it names it by :data:`CONFIG_NAME`."""
    return str(WEIGHTS) if path == CONFIG_NAME else path
