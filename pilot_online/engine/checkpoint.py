"""Checkpoint files: where they live, what guards them, how they are written and read.

Every run (unless its ``checkpoint_every`` is null) keeps one checkpoint beside its results file,
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
converted back; unsigned arrays wider than a byte (numpy's generator key is uint32) are stored
as the signed tensor of the same width, which every supported torch can hold.

Seeds of one config: PILOT runs all the seeds of a config in one process. A seed whose results
file is already complete for this version and config (:func:`completed_results`) is not trained
again: :class:`CompletedRun` stands in for its session and returns its stored evaluations, as a
resumed session does for the tasks it finished before the checkpoint.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..core.files import write_atomic_with
from ..core.lazy import torch
from ..core.results import RESULTS_SUFFIX, load_results, to_jsonable
from ..core.scale_backbone import shipped_name
from ..version import __version__

logger = logging.getLogger(__name__)

CHECKPOINT_SUFFIX = ".ckpt.pt"
#: Layout of the checkpoint payload; bumped when the layout changes (2: the RNG state holds
#: the training device's CUDA generator only; unsigned numpy arrays stored as signed tensors).
CHECKPOINT_FORMAT = 2

#: Config keys a checkpoint does not compare, each because it cannot change a result:
IGNORED_KEYS = {
    "config": "the path of the config file (PILOT's main.py adds it)",
    "results_dir": "where files go; the checkpoint is found there anyway",
    "log_interval": "progress-bar updates only",
    "num_workers": "training augmentations are seeded per sample, not per worker",
    "checkpoint_every": "how often to checkpoint, not what is computed",
    "logger": "live logging only reads the run's numbers",
    "logger_dir": "where live logs go",
    "pin_memory": "where host batches live, not their bytes",
    "eval_pixel_cache": "the cached test pixels are the bytes a fresh load gives",
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


def _device_kinds(devices: Any) -> list[str]:
    """The device kinds of a config's ``device``, also as a results file keeps it: the text of
    PILOT's list of ``torch.device`` (``"[device(type='cuda', index=0)]"``)."""
    if isinstance(devices, str) and "type=" in devices:
        return re.findall(r"type='(\w+)'", devices)
    if isinstance(devices, str) and devices.startswith("["):
        try:
            devices = ast.literal_eval(devices)
        except (ValueError, SyntaxError):
            pass
    devices = devices if isinstance(devices, (list, tuple)) else [devices]
    return [_device_kind(device) for device in devices]


def comparable_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config that a resumed run must share with the checkpoint, as plain JSON."""
    kept = {key: value for key, value in config.items() if key not in IGNORED_KEYS}
    if "device" in kept:
        kept["device"] = _device_kinds(kept["device"])
    if isinstance(kept.get("pretrained_path"), str):  # the shipped file, wherever it lies
        kept["pretrained_path"] = shipped_name(kept["pretrained_path"])
    return json.loads(json.dumps(to_jsonable(kept), sort_keys=True, default=str))


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], where: str = "the checkpoint"
) -> list[str]:
    """``key: saved -> current`` for every key whose value differs (or exists on one side only);
    ``where`` names what holds the saved config."""
    missing = object()
    lines = []
    for key in sorted(set(saved) | set(current)):
        before, after = saved.get(key, missing), current.get(key, missing)
        if before != after:
            show = lambda v: "(absent)" if v is missing else json.dumps(v)  # noqa: E731
            lines.append(f"{key}: {show(before)} in {where}, {show(after)} now")
    return lines


# -- numpy <-> tensor, so the file loads with weights_only=True -------------------------------
_NUMPY_TAG = "__numpy_array__"
_NUMPY_DTYPE_TAG = "__numpy_dtype__"


def _encode(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value).copy()
        if array.dtype.kind == "u" and array.dtype.itemsize > 1:
            # torch < 2.3 has no uint16/32/64 tensors: keep the bits in a signed view.
            signed = array.view(np.dtype(f"int{8 * array.dtype.itemsize}"))
            return {_NUMPY_TAG: torch.from_numpy(signed), _NUMPY_DTYPE_TAG: array.dtype.str}
        return {_NUMPY_TAG: torch.from_numpy(array)}
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
        if set(value) == {_NUMPY_TAG, _NUMPY_DTYPE_TAG}:
            return value[_NUMPY_TAG].numpy().view(np.dtype(value[_NUMPY_DTYPE_TAG]))
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
    differences = config_differences(
        comparable_config(payload["config"]), comparable_config(config)
    )
    if differences:
        raise CheckpointError(
            f"checkpoint {path} was written for another config; "
            + "; ".join(differences)
            + f". Rerun with the config that started the run to resume it, or {fix} "
            "with this config"
        )
    return _decode(payload["state"])


# -- seeds of one config -----------------------------------------------------------------------
def completed_results(path: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The results at ``path`` if they are a complete run of this config by this version, with
    the evaluations a rerun must hand back to PILOT's trainer; else None (and a log line saying
    why, when there is a file): the seed is then trained, into a timestamped results file."""
    if not path.is_file():
        return None
    try:
        results = load_results(path)
    except (OSError, ValueError) as err:
        logger.warning("results %s cannot be read (%s): training this seed again", path, err)
        return None
    why = None
    if results.get("status") != "complete":
        why = f"its status is {results.get('status')!r}, not 'complete'"
    elif results.get("pilot_online_version") != __version__:
        why = f"pilot-online {results.get('pilot_online_version')} wrote it, this is {__version__}"
    elif differences := config_differences(
        comparable_config(results["config"]), comparable_config(config), "the results"
    ):
        why = "it was run with another config (" + "; ".join(differences[:5]) + ")"
    elif not isinstance(results["extra"].get("task_reports"), list):
        why = "it holds no per-task evaluations (written before they were kept)"
    if why is not None:
        logger.warning("results %s exist but %s: training this seed again", path, why)
        return None
    return results


class CompletedRun:
    """Stands in for the :class:`~pilot_online.engine.session.OnlineSession` of a seed whose
    results are complete (:func:`completed_results`): it trains nothing and writes nothing, and
    :meth:`complete_task` returns each task's stored evaluation, PILOT's ``cnn_accy``."""

    def __init__(self, path: Path, results: dict[str, Any]) -> None:
        self.written_path = path
        self.stored = results
        self.task_reports: list[dict[str, Any]] = list(results["extra"]["task_reports"])

    def train_task(self, task: int) -> None:
        """Nothing to train: the stored run trained this task."""
        if not 0 <= task < len(self.task_reports):
            raise IndexError(
                f"{self.written_path} holds {len(self.task_reports)} tasks, not task "
                f"{task + 1}: the stream has changed; move the file away to train this seed again"
            )

    def complete_task(self, task: int) -> dict[str, Any]:
        """The stored evaluation at the end of ``task``."""
        self.train_task(task)
        return self.task_reports[task]

    def finish(self) -> dict[str, Any]:
        """The stored results (the file is left as it is)."""
        return self.stored

    def write(self, status: str = "complete", error: str | None = None) -> dict[str, Any]:
        """Nothing to write: the complete results are on disk already."""
        return self.stored


def tensors_to(value: Any, device: torch.device) -> Any:
    """``value`` (tensors, lists and dicts of them, None) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [tensors_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: tensors_to(v, device) for k, v in value.items()}
    return value
