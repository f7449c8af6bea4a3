"""One JSON results file per run, written atomically, with a documented schema.

Why: PILOT's results live in log lines that must be scraped. Here every finished run leaves
``{log_dir}/{prefix}_{seed}_{backbone_type}.results.json`` that ``json.load`` reads directly,
that ``diff`` compares, and that is never half-written: it is written to a temporary file in
the same directory, flushed, fsync'ed and renamed into place. An existing results file is never
overwritten unless ``overwrite=True`` is passed, so a finished run's results cannot be lost.

Schema (``schema_version`` 2). NaN and infinity are stored as ``null``.

=========================================  ============  ==========================================
key                                        type          meaning
=========================================  ============  ==========================================
schema_version                             int           layout version (2; 1 is read too)
pilot_online_version                       str           pilot-online version that wrote the file
created_utc                                str           ISO 8601 UTC time the results were built
status                                     str           "complete": the run finished
config                                     object        the run's full configuration (PILOT JSON)
stream                                     object        stream description (setting, seed, tasks)
metrics                                    object        output of metrics.summarize, see below
metrics.accuracy_matrix                    [[num|null]]  acc[l][k]: accuracy (%) on task l after k
metrics.A_k                                [num|null]    average accuracy after each task (Sec 4.1)
metrics.AP                                 num|null      average performance: mean of A_k
metrics.A_T                                num|null      A_k after the last measured task
metrics.final_task_accuracies              [num|null]    accuracy on each task at the end
metrics.forgetting                         num|null      average forgetting (Chaudhry et al.)
metrics.A_auc                              num|null      Si-Blurry: mean of periodic accuracies
metrics.A_avg                              num|null      Si-Blurry: mean of end-of-task accuracies
metrics.A_last                             num|null      Si-Blurry: final accuracy
metrics.A_online                           num|null      online accuracy: stream batches predicted
                                                         before training on them (protocol.md)
metrics.F_last                             num|null      Si-Blurry per-class forgetting (note)
timing.train_seconds                       num           wall-clock seconds spent training
timing.eval_seconds                        num           wall-clock seconds spent evaluating
timing.online_eval_seconds                 num           A_online's eval-mode passes (not in
                                                         train_seconds nor eval_seconds)
timing.samples_per_second                  num           training throughput
timing.peak_memory_bytes                   int|null      peak accelerator memory; null if unknown
environment                                object        what the numbers depend on beyond config
                                                         and code: python, torch, numpy and timm
                                                         versions, threads (CPU intra-op threads),
                                                         device, accelerator (a GPU's name)
counters.optimizer_steps                   int           optimizer steps taken
counters.samples_seen                      int           stream samples consumed
counters.online_scored_samples             int           stream samples scored for A_online
counters.batches_trained                   int           stream batches a step trained on
counters.batches_skipped                   int           real-time mode: batches that passed
                                                         during a step, scored only (0 else)
counters.skipped_nonfinite_steps           int           steps skipped: non-finite loss or grads
counters.skipped_nonfinite_hypergradients  int           FGH updates skipped: non-finite values
extra                                      object        free-form additions ({} if none)
=========================================  ============  ==========================================

What the online session puts under ``extra`` (optional for readers: older files may lack a key):

============================================  ==========  =======================================
key (under ``extra``)                         type        meaning
============================================  ==========  =======================================
periodic_evaluations                          [object]    {samples_seen, accuracy}: A_auc's curve
per_class_final_accuracy                      [num|null]  accuracy (%) of each class at the end
gradient_imbalance.class_mean_grad_norm       [num]       g^j = mean over steps of ||g_t^j||
gradient_imbalance.task_grad_norm             [num|null]  G^k = mean of g^j, classes of task k
gradient_imbalance.task_grad_norm_normalized  [num|null]  G^k_n = G^k / max_l G^l (Fig. 1)
gradient_imbalance.task_grad_norm_trace       [[num]]     steps x tasks: G^k at each optimizer
                                                          step, 4 significant digits (Fig. 2);
                                                          only with ``grad_trace``
gradient_imbalance.trace_file                 str         sidecar .gradtrace.npy (steps x classes)
diagnostics                                   object      the mixins' and the method's reports
realtime                                      object      real-time mode only: ``C`` (the
                                                          schedule's cost), ``C_fraction``,
                                                          ``source`` (flops, flops_counted,
                                                          measured, given), ``reference``,
                                                          ``C_unclamped``, ``detail`` (FLOPs or
                                                          step seconds), ``batches_trained``,
                                                          ``batches_skipped``, ``stream_batches``
============================================  ==========  =======================================

The classes of task k are those first exposed in task k (``stream.tasks[k].new_classes``).

``metrics.F_last`` follows upstream Si-Blurry: the mean, over classes whose best earlier
end-of-task accuracy is above zero, of that best minus the final accuracy.

Required keys: all top-level keys above but ``environment`` (older files lack it), the
four ``timing`` and four ``counters`` keys, and
``metrics.accuracy_matrix``, ``metrics.A_k``, ``metrics.AP``, ``metrics.A_T``. Readers must
ignore keys they do not know; adding keys does not change ``schema_version``.

Versions: 2 marks the ``si_blurry`` stream that draws exactly as upstream Si-Blurry (a
``torch.Generator`` seeded with the run's seed; ``stream.info.stream_version`` 2). Version 1
files have the same layout, but a version 1 ``si_blurry`` run trained on the old stream (numpy's
generator: the same distribution, other task lists and sample order for the same seed);
:func:`old_si_blurry_stream` says so, and :func:`load_results` logs a warning for such files.
Clear-stream runs are the same in both versions.
"""

from __future__ import annotations

import dataclasses
import datetime as _datetime
import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pilot_online.version import __version__

from .files import write_atomic

__all__ = [
    "READABLE_SCHEMA_VERSIONS",
    "REQUIRED_COUNTER_KEYS",
    "REQUIRED_METRIC_KEYS",
    "REQUIRED_TIMING_KEYS",
    "REQUIRED_TOP_LEVEL_KEYS",
    "RESULTS_SUFFIX",
    "SCHEMA_VERSION",
    "build_results",
    "load_results",
    "old_si_blurry_stream",
    "results_path",
    "to_jsonable",
    "validate_results",
    "write_results",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
#: Versions this pilot-online reads (1: the same layout, si_blurry runs on the old numpy stream).
READABLE_SCHEMA_VERSIONS = (1, 2)
RESULTS_SUFFIX = ".results.json"

REQUIRED_TOP_LEVEL_KEYS = (
    "schema_version",
    "pilot_online_version",
    "created_utc",
    "status",
    "config",
    "stream",
    "metrics",
    "timing",
    "counters",
    "extra",
)
REQUIRED_TIMING_KEYS = ("train_seconds", "eval_seconds", "samples_per_second", "peak_memory_bytes")
REQUIRED_COUNTER_KEYS = (
    "optimizer_steps",
    "samples_seen",
    "skipped_nonfinite_steps",
    "skipped_nonfinite_hypergradients",
)
REQUIRED_METRIC_KEYS = ("accuracy_matrix", "A_k", "AP", "A_T")
_SECTIONS = {
    "metrics": REQUIRED_METRIC_KEYS,
    "timing": REQUIRED_TIMING_KEYS,
    "counters": REQUIRED_COUNTER_KEYS,
}


def to_jsonable(obj: Any) -> Any:
    """Convert ``obj`` into plain JSON types, without importing torch.

    numpy scalars/arrays and anything with ``tolist()`` (torch tensors) become Python numbers and
    lists; NaN and infinity become ``None`` (JSON has no NaN); tuples and sets become lists;
    ``Path`` becomes ``str``; dataclasses become dicts; mapping keys become strings.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, np.bool_):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, dict):
        return {str(key): to_jsonable(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(value) for value in obj]
    if isinstance(obj, (set, frozenset)):
        return [to_jsonable(value) for value in sorted(obj, key=repr)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, np.ndarray) or callable(getattr(obj, "tolist", None)):
        # ndarray.tolist() / Tensor.tolist() give Python scalars (or one scalar for 0-d).
        return to_jsonable(obj.tolist())
    raise TypeError(
        f"cannot store an object of type {type(obj).__name__} in a results file; convert it to "
        "numbers, strings, lists or dicts first."
    )


def _missing(mapping: dict[str, Any], keys: tuple[str, ...], where: str) -> list[str]:
    return [f"{where}{key}" for key in keys if key not in mapping]


def validate_results(results: Any) -> None:
    """Raise ValueError naming every missing required key (see the schema in the docstring)."""
    if not isinstance(results, dict):
        raise ValueError(f"results must be a dict, got {type(results).__name__}.")
    _check_schema_version(results)
    missing = _missing(results, REQUIRED_TOP_LEVEL_KEYS, "")
    for section, keys in _SECTIONS.items():
        value = results.get(section)
        if value is None:
            continue  # already reported as missing at the top level, or null
        if not isinstance(value, dict):
            raise ValueError(f"results['{section}'] must be a dict, got {type(value).__name__}.")
        missing += _missing(value, keys, f"{section}.")
    for section in ("config", "stream", "extra"):
        if section in results and not isinstance(results[section], dict):
            raise ValueError(
                f"results['{section}'] must be a dict, got {type(results[section]).__name__}."
            )
    if missing:
        raise ValueError(
            f"results are missing required keys: {', '.join(missing)} "
            "(see the schema in pilot_online.core.results)."
        )


def _check_schema_version(results: dict[str, Any]) -> None:
    if "schema_version" not in results:
        raise ValueError(
            "results have no 'schema_version'; this is not a pilot-online results file "
            f"(expected schema_version {SCHEMA_VERSION})."
        )
    version = results["schema_version"]
    if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
        raise ValueError(
            f"unknown results schema_version {version!r}; this pilot-online {__version__} reads "
            f"schema_version {', '.join(map(str, READABLE_SCHEMA_VERSIONS))}. Upgrade "
            "pilot-online to read newer files."
        )


def old_si_blurry_stream(results: dict[str, Any]) -> bool:
    """Whether ``results`` come from a run on an older stream than today's for its seed: a
    ``si_blurry`` run of schema 1 (numpy draws, not upstream Si-Blurry's); the kinds and
    versions are :data:`~pilot_online.core.streams.STREAM_KINDS`' ``outdated_schemas``."""
    from .streams import STREAM_KINDS

    stream = results.get("stream") or {}
    kind = STREAM_KINDS.get(stream.get("kind", (results.get("config") or {}).get("stream")))
    return kind is not None and results.get("schema_version") in kind.outdated_schemas


def build_results(
    *,
    config: dict[str, Any],
    stream: dict[str, Any],
    metrics: dict[str, Any],
    timing: dict[str, Any],
    counters: dict[str, Any],
    extra: dict[str, Any] | None = None,
    environment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble one run's results dict and validate it (ValueError names missing keys)."""
    results = {
        "schema_version": SCHEMA_VERSION,
        "pilot_online_version": __version__,
        "created_utc": _datetime.datetime.now(_datetime.timezone.utc).isoformat(timespec="seconds"),
        "status": "complete",
        "config": config,
        "stream": stream,
        "metrics": metrics,
        "timing": timing,
        "counters": counters,
        "extra": {} if extra is None else extra,
        **({"environment": environment} if environment is not None else {}),
    }
    validate_results(results)
    return results


def write_results(
    path: str | os.PathLike[str], results: dict[str, Any], *, overwrite: bool = False
) -> Path:
    """Write ``results`` as JSON to ``path`` atomically; return the path.

    See :func:`~pilot_online.core.files.write_atomic`: if anything fails, ``path`` is untouched.
    An existing ``path`` raises FileExistsError unless ``overwrite=True``.
    """
    target = Path(path)
    validate_results(results)
    # Serialise first: a conversion error must not leave any file behind.
    text = json.dumps(to_jsonable(results), indent=2, allow_nan=False) + "\n"
    if target.exists() and not overwrite:
        raise FileExistsError(
            f"results file {target} already exists; refusing to overwrite a finished run's "
            "results. Use another prefix/log_dir, delete the file, or pass overwrite=True."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, text)
    logger.info("wrote results to %s", target)
    return target


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a results file and check its schema_version and required keys."""
    target = Path(path)
    with target.open(encoding="utf-8") as handle:
        try:
            results = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{target} is not valid JSON ({error}).") from error
    try:
        validate_results(results)
    except ValueError as error:
        raise ValueError(f"{target}: {error}") from error
    if old_si_blurry_stream(results):
        logger.warning(
            "%s: a si_blurry run of results schema_version 1, trained on the old stream (numpy "
            "draws, not upstream Si-Blurry's task lists for its seed); rerun it to compare with "
            "the paper",
            target,
        )
    return results


class ResultsNotFoundError(FileNotFoundError):
    """A results path that names nothing: a user error (``report``, ``tables``, ``figures``,
    ``best``), which the CLI ends in its line alone."""


def find_results(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The complete results files in ``paths`` (files, or folders searched deeply), sorted per
    folder; ``*.partial.results.json`` (failed runs) are left out."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(path.rglob(f"*{RESULTS_SUFFIX}"))
        elif path.is_file():
            files.append(path)
        else:
            raise ResultsNotFoundError(
                f"{path} does not exist: give results files (*{RESULTS_SUFFIX}) or folders of "
                "them (a run writes its file into results_dir, else into PILOT's logs/)"
            )
    return [file for file in files if ".partial" not in file.name]


def results_path(
    log_dir: str | os.PathLike[str], prefix: str, seed: int, backbone_type: str
) -> Path:
    """``{log_dir}/{prefix}_{seed}_{backbone_type}.results.json``, PILOT's log-file naming.

    Surrounding spaces are stripped from ``prefix`` (PILOT configs use ``"prefix": " "``).
    """
    return Path(log_dir) / f"{str(prefix).strip()}_{seed}_{backbone_type}{RESULTS_SUFFIX}"
