"""Checkpoint files: where they live, what guards them, how they are written and read.

A run with ``checkpoint_every`` set keeps one checkpoint beside its results file,
``<prefix>_<seed>_<backbone>.ckpt.pt`` (the results file's name with ``.results.json`` replaced),
rewritten atomically (temporary file, fsync, ``os.replace``) so a kill at any moment leaves the
previous checkpoint or the new one, never half of one. The session deletes it once the final
results file is written.

What the state holds is gathered by its owners' ``state_dict()`` (session, loop, mixins,
adapter); this module adds the guards. A checkpoint is refused, with a message that names the
file, what differs and what to do, when:

- it was written by another pilot-online version (state layouts and numerics may differ);
- it was written for another config: the resolved config is compared key by key, except the keys
  in :data:`IGNORED_KEYS`, which cannot change a number in the results;
- it cannot be read (truncated, corrupt, or not a pilot-online checkpoint).

Files are read with ``torch.load(weights_only=True)``: tensors and plain Python values only, no
arbitrary pickles. numpy arrays (replay memory, numpy's generator state) are stored as tensors and
converted back.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.files import write_atomic_with
from ..core.results import RESULTS_SUFFIX, to_jsonable
from ..version import __version__

logger = logging.getLogger(__name__)

CHECKPOINT_SUFFIX = ".ckpt.pt"
#: Layout of the checkpoint payload; bumped when the layout changes.
CHECKPOINT_FORMAT = 1

#: Config keys a checkpoint does not compare, each because it cannot change a result:
IGNORED_KEYS = {
    "config": "the path of the config file (PILOT's main.py adds it)",
    "results_dir": "where files go; the checkpoint is found there anyway",
    "log_interval": "progress-bar updates only",
    "num_workers": "training augmentations are seeded per sample, not per worker",
    "checkpoint_every": "how often to checkpoint, not what is computed",
    "logger": "live logging only reads the run's numbers",
    "logger_dir": "where live logs go",
}
#: ``device`` is compared by kind (cpu / cuda), not by index: a CUDA run may resume on another GPU.


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed; the message says why and what to do."""


def checkpoint_path_for(results_path: Path) -> Path:
    """The checkpoint beside a results file: ``x.results.json`` -> ``x.ckpt.pt``."""
    name = results_path.name
    stem = name[: -len(RESULTS_SUFFIX)] if name.endswith(RESULTS_SUFFIX) else results_path.stem
    return results_path.with_name(stem + CHECKPOINT_SUFFIX)


def _device_kind(device: Any) -> str:
    """PILOT's ``-1`` / ``"0"`` / ``torch.device("cuda:1")`` -> ``"cpu"`` / ``"cuda"``."""
    text = str(device)
    if text in ("-1", "cpu"):
        return "cpu"
    return "cuda" if text.isdigit() else text.split(":")[0]


def comparable_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config that a resumed run must share with the checkpoint, as plain JSON."""
    kept = {key: value for key, value in config.items() if key not in IGNORED_KEYS}
    if "device" in kept:
        devices = kept["device"]
        devices = devices if isinstance(devices, (list, tuple)) else [devices]
        kept["device"] = [_device_kind(device) for device in devices]
    return json.loads(json.dumps(to_jsonable(kept), sort_keys=True, default=str))


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: saved -> current`` for every key whose value differs (or exists on one side only)."""
    missing = object()
    lines = []
    for key in sorted(set(saved) | set(current)):
        before, after = saved.get(key, missing), current.get(key, missing)
        if before != after:
            show = lambda v: "(absent)" if v is missing else json.dumps(v)  # noqa: E731
            lines.append(f"{key}: {show(before)} in the checkpoint, {show(after)} now")
    return lines


# -- numpy <-> tensor, so the file loads with weights_only=True -------------------------------
_NUMPY_TAG = "__numpy_array__"


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {_NUMPY_TAG: torch.from_numpy(np.ascontiguousarray(value).copy())}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(item) for item in value)
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_NUMPY_TAG}:
            return value[_NUMPY_TAG].numpy()
        return {key: _decode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(item) for item in value)
    return value


def save_checkpoint(path: Path, state: dict[str, Any], config: dict[str, Any]) -> None:
    """Write ``state`` with the guards (version, comparable config) atomically to ``path``."""
    payload = {
        "format": CHECKPOINT_FORMAT,
        "pilot_online_version": __version__,
        "config": comparable_config(config),
        "state": _encode(state),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic_with(path, lambda handle: torch.save(payload, handle))


def remove_stale_temporaries(path: Path) -> None:
    """Delete temporary files a killed writer left beside ``path`` (``write_atomic``'s names)."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def load_checkpoint(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The state saved at ``path``, after checking it belongs to this version and config."""
    fix = f"delete {path} to start the run over"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, foreign file: all unreadable
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); it is corrupt, "
            f"truncated or not a pilot-online checkpoint: {fix}"
        ) from err
    if not isinstance(payload, dict) or "format" not in payload or "state" not in payload:
        raise CheckpointError(f"{path} is not a pilot-online checkpoint: {fix}")
    version = payload.get("pilot_online_version")
    if version != __version__:
        raise CheckpointError(
            f"checkpoint {path} was written by pilot-online {version}, this is {__version__}: a "
            "run resumes only under the version that started it (state layout and numerics may "
            f"differ). Install pilot-online {version} to resume it, or {fix}"
        )
    if payload["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has layout {payload['format']}, this version reads "
            f"{CHECKPOINT_FORMAT}: {fix}"
        )
    differences = config_differences(payload["config"], comparable_config(config))
    if differences:
        raise CheckpointError(
            f"checkpoint {path} was written for another config; "
            + "; ".join(differences)
            + f". Rerun with the config that started the run to resume it, or {fix} "
            "with this config"
        )
    return _decode(payload["state"])
